"""Expert-parallel groups planned as units: the members of an EP group are the lanes of one unit.

With expert parallelism the MoE all-to-all of every layer couples micro-batch i of every member of an EP
group (Megatron's fixed groups of e consecutive HDP ranks, `timing.expert_groups`): every member runs the
group's largest micro-batch count, and index i lasts as long as its slowest member. A plan made rank by
rank pays for both at run time (padding micro-batches, and a wait at every index). Here every index of a
unit is a *row* of e lanes, planned together, so that the lanes of a row run micro-batches of about one
time and every lane runs the unit's count:

1. ring sizes (`unit_ring_sizes`): a ring of k ranks takes k mod e lanes of a row of its last unit, and
   the other lanes of that row can match its member time only with other rings' shards: whole sequences
   of at most C tokens take at most a whole C-token document's time. Rows are formed much as step 3 forms
   them; the rings of a row whose free lanes would idle more than growing its rings to the next multiple
   of e adds (ring traffic; zigzag work is otherwise conserved over k) grow, and then fill whole units,
   where their equal zigzag shards wait for nobody. When the all-to-all has a cost, the first choice of
   ring sizes is also planned with every ring `within_capacity` (no member over C tokens): a ring member
   that offloads holds more tokens than the lanes beside it, and all of its row waits for its transfers;
   that choice as it is and with rings grown (the growth judges a row by alike rings alone, while
   `ring_rows` also fills rows with rings of other times and widens rings into lanes left free, which
   mostly serves better than a ring grown to a unit);
2. rings of more than one unit, aligned at one index in every unit they span: `placement.place_rings`
   over the G = D / e units, a ring of k ranks on ceil(k / e) of them, its last unit's other lanes free.
   Where its members outlast a lane's mean work (the batch's lane-seconds, each token's all-to-all
   included, over D) by enough that the pool could spare its free lanes (`critical_rows`), the rest is
   also planned with that row kept light, its free lanes taking no lane ring and no more tokens than its
   fullest member holds (its lanes wait for the all-to-all of the fullest and for the routed expert work
   the all-to-all spreads over them), and the arrangement whose slowest unit's rows sum to less is kept
   (a model without either cost is planned once, and rows `IDLE_POOL` times a lane's mean work light
   only). Filling those lanes cost up to 10.5% of the step: of 192 Mixtral-8x7B, qwen3-30B-A3B and
   DeepSeek-V3 EP batches of 32M tokens at C = 16K on 512-16,384 ranks (`benchmarks/light_rows.py`), 100
   plan faster (Mixtral from 896 ranks on by up to 8.6%, DeepSeek-V3 from 2,048 by up to 10.5%, qwen3 up
   to 1.9%), 2 slower (qwen3, 0.4% and 1.0%), the rest alike;
3. the rest in rows (`ring_rows`, `unit_rows.level_rows`, `unit_rows.widen_rings`, `fill_holes`,
   `whole_rows`): rings of at most e ranks (*lane rings*) heaviest first, each into a row of about its
   member time with lanes free (step 2's rows included), else a new one; rings moved and swapped between
   new rows adjacent in time where that lowers their summed time once widened; the lanes a row's rings
   leave free go to those rings as extra members while their members are slower than whole sequences in a
   free lane could be; whole sequences,
   heaviest first, into free lanes and the spare time and tokens of ring members where they fit the row's
   time, C and its fullest lane (best fit; times here without the routed expert work, which the
   all-to-all spreads over the row's lanes: a free lane of many short documents matches a ring member's
   attention-heavy time with more tokens than a ring member holds); the rest in rows of e bins in order
   of time, each sequence into the bin of least time with room, a new row when none has room, so a row's
   bins hold alike sequences: first those of at least C / LARGE_PARTS tokens, whose rows' holes the
   shorter ones then fill as they fill the rings' rows, then the shorter ones left, in rows of their own.
   The last `fine_work` lane-seconds go into rows of C / `unit_rows.FINE_PARTS` tokens: light rows to balance the
   units with;
4. rows to units (`placement.lpt` heaviest first from each unit's ring finish, then `refine.refine_local`
   on the units' times: moves and swaps of whole rows), each unit's rows after its step-2 rows. A row's
   time is as the timeline counts it (`experts.spread_grid`): its slowest lane apart from the routed
   expert work, that work's mean over the lanes, and the all-to-all's for its fullest lane (every lane
   waits for the transfers of the row's largest sender): at DeepSeek-V3's EP 32 over NICs those are ~1 s
   a full row, and balancing units without them left units 24-35% apart; with the slowest lane's expert
   work counted in full instead of spread, 1.3%.

Every lane of a unit holds the unit's rows, so the runtime pads nothing (a lane with nothing at an index
runs an empty micro-batch at the micro-batch overhead, as the runtime's padding would). Rings of several
units couple units as rings couple ranks, at the one index they share. `balance` plans this way and rank
by rank, and keeps the plan of least predicted step time (timed with the EP coupling either way): on
small batches a plan rank by rank may already run its EP groups in step.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.flat_ids import flat_ids
from megatron_hdp.plan.search.placement import lpt, place_rings
from megatron_hdp.plan.search.refine import refine_local
from megatron_hdp.plan.search.unit_rows import (Row, fill_holes, lane_sums, level_rows, ring_rows, whole_rows,
                                                widen_rings)
from megatron_hdp.plan.cost.sharding import max_member_tokens, member_time, ring_offload_ratio, whole_times

ROW_TOLERANCE = 0.1
"""`unit_ring_sizes`: a lane ring shares a row whose time is at most this fraction above its member time
(the rows it judges growth by: rings of alike time only)."""

LARGE_PARTS = 4
"""Whole sequences of at least C / LARGE_PARTS tokens are put in rows first, and the shorter ones fill
those rows' holes before rows of their own (`place_units`). DeepSeek-V3 at EP 32, 2,048 GPUs, seeds 0-3:
+0.26 to +0.57 points of the work floor on all 8 batches (2: +0.3 to +0.5, 8: -0.1 to +0.6, 6 as 4)."""

ALLTOALL_SHARE = 0.1
"""The rings are also planned `within_capacity` where the all-to-all of C tokens takes at least this share
of a whole C-token document's time (DeepSeek-V3 at EP 32 over NICs 0.75, Mixtral and qwen3 over NICs
0.18-0.24; inside an NVLink node ~0.02, where a lane's extra tokens cost its row next to nothing and the
extra family ~20% of Mixtral's plan time at 16,384 ranks)."""

IDLE_POOL = 2.0
"""`place_units` plans rows of rings of several units light without also planning them filled where each
outlasts a lane's mean work this many times over: the pool idles beside them. On the 192 batches of
`benchmarks/light_rows.py` this picks the arrangement comparing both picked in every batch, and saves
DeepSeek-V3's 16,384-rank plans one arrangement a unit family (~60 ms)."""

Option = tuple[np.ndarray, np.ndarray]
"""(ring sizes, offload ratios) of every sequence: one choice of `widening.widening_options`."""


def unit_ring_sizes(lengths: np.ndarray, option: Option, *, ep_size: int, capacity: int, cost_model: CostModel,
                    pp_size: int = 1, member_seconds: dict[tuple[int, int], float] | None = None) -> Option:
    """`option` with rings grown to whole units where that pays (step 1 of the module doc).

    The rings of k ranks not a multiple of e take k mod e lanes of a row (of their last unit); heaviest
    first, each joins the first row with lanes free whose time is within `ROW_TOLERANCE` above its member
    time, else opens one (as `ring_rows` will). A row's free lanes hold whole sequences of at most C
    tokens, at most `full` seconds (a whole C-token document): they idle free x (T - full) lane-seconds
    when its time T is above that. The rings of such a row grow to the next multiple of e when the work
    that adds (ring traffic and latency: size w(size) - k w(k) lane-seconds each) is less. A wider ring
    holds fewer tokens a member, so it fits wherever the narrower one did, at the smallest offload ratio
    that lets its members hold their shards; a ring stays as it is where it cannot grow (zigzag chunks of
    a document of fewer than 2 x size tokens would be empty). `member_seconds`: `member_time` by (length,
    size), shared by the options of one batch (`unit_options`), which time the same rings again and again."""
    ring_sizes, offload_ratios = option
    member_seconds = {} if member_seconds is None else member_seconds

    def seconds(length: int, size: int) -> float:
        if (length, size) not in member_seconds:
            member_seconds[length, size] = member_time(length, size, cost_model=cost_model, pp_size=pp_size)
        return member_seconds[length, size]

    sizes, ratios = ring_sizes.copy(), offload_ratios.copy()
    odd = np.flatnonzero((ring_sizes > 1) & (ring_sizes % ep_size != 0))
    if not len(odd):
        return sizes, ratios
    full = float(whole_times([capacity], cost_model=cost_model, pp_size=pp_size)[0])
    weights = np.array([seconds(int(lengths[seq]), int(ring_sizes[seq])) for seq in odd.tolist()])
    rows: list[list] = []  # [time, free lanes, ring ids]
    neg_times: list[float] = []  # rows open heaviest first, so their times fall: these rise (for bisect)
    for j in np.lexsort((odd, -weights)).tolist():
        lanes = int(ring_sizes[odd[j]]) % ep_size
        within = bisect.bisect_left(neg_times, -(weights[j] * (1 + ROW_TOLERANCE)))  # the first row in range
        row = next((row for row in itertools.islice(rows, within, None) if row[1] >= lanes), None)
        if row is None:
            row = [float(weights[j]), ep_size, []]
            rows.append(row)
            neg_times.append(-row[0])
        row[1] -= lanes
        row[2].append(j)
    for time, free, members in rows:
        idle = free * max(0.0, time - full)
        grown = {}
        for j in members:
            s, k = int(lengths[odd[j]]), int(ring_sizes[odd[j]])
            size = -(-k // ep_size) * ep_size
            if size <= s // 2:
                grown[j] = size
        added = sum(size * seconds(int(lengths[odd[j]]), size) - int(ring_sizes[odd[j]]) * float(weights[j])
                    for j, size in grown.items())
        if grown and added < idle:
            for j, size in grown.items():
                seq = int(odd[j])
                sizes[seq] = size
                ratios[seq] = ring_offload_ratio(cost_model, length=int(lengths[seq]), ring_size=size,
                                                 capacity=capacity)
    return sizes, ratios


def within_capacity(lengths: np.ndarray, option: Option, *, capacity: int, cost_model: CostModel) -> Option:
    """`option` with every ring, and every whole sequence of more than C tokens, widened to the fewest
    members whose fullest holds at most C tokens (and so offloads nothing), where the document allows it
    (zigzag chunks of >= 1 token: size <= s / 2), except rings that fill whole rows with their twins.

    Under expert parallelism every lane of a row waits for the all-to-all of the row's fullest lane. A
    ring that offloads holds more than C tokens a member, and beside lanes of at most C (whole sequences,
    or other rings) it makes every lane of the row wait for its extra tokens' transfers: at DeepSeek-V3's
    EP 32 over NICs ~0.07 ms a token, so a member of 2C tokens costs each of the 32 lanes about a C-token
    document's all-to-all. Rings of at most C tokens a member cost ring traffic instead (a wider ring);
    `balance` plans both and keeps the faster. Rings of one length and size that divides e, e / size of
    them to a row, wait for nobody's transfers but their own: as many of them as fill whole rows keep
    their size (byted's clipped 131,072-token documents: 4 members of 2C tokens, where 8 of C would pay
    ring traffic their attention no longer hides). A whole sequence of more than C tokens offloads to fit
    its one rank and holds more tokens than the lanes beside it just as a ring member that offloads does
    (github's 16-23K-token documents at C = 16K, a row of their own of 32 lengths apart); on 2 members it
    is a lane ring that rows of alike rings take (DeepSeek-V3 at 2,048 GPUs: +0.04 to +0.44 points of the
    work floor on github and byted seeds 0-3)."""
    ring_sizes, offload_ratios = option
    sizes, ratios = ring_sizes.copy(), offload_ratios.copy()
    ep_size = cost_model.expert_parallel_size
    twins: dict[tuple[int, int], list[int]] = {}
    for seq in np.flatnonzero((ring_sizes > 1) & (ep_size % np.maximum(ring_sizes, 1) == 0)).tolist():
        twins.setdefault((int(lengths[seq]), int(ring_sizes[seq])), []).append(seq)
    in_full_rows = {seq for (_, size), seqs in twins.items()
                    for seq in seqs[:len(seqs) - len(seqs) % (ep_size // size)]}
    for seq in np.flatnonzero((ring_sizes > 1) | (lengths > capacity)).tolist():
        if seq in in_full_rows:
            continue
        length, size = int(lengths[seq]), int(ring_sizes[seq])
        while max_member_tokens(length, size) > capacity and 2 * (size + 1) <= length:
            size += 1
        sizes[seq] = size
        ratios[seq] = ring_offload_ratio(cost_model, length=length, ring_size=size, capacity=capacity)
    return sizes, ratios


def unit_options(options: Sequence[Option], *, lengths: np.ndarray, capacity: int, cost_model: CostModel,
                 pp_size: int = 1) -> tuple[list[Option], Iterator[Option]]:
    """The distinct `unit_ring_sizes` of `options` (EP: `cost_model.expert_parallel_size`), in their order,
    as (the first option's families, the alternatives' families, made one at a time as they are asked for:
    `balance` asks for none on most batches, and `options`' alternatives are themselves made lazily,
    `widening.LazyOptions`). The first option's: its rings grown,
    then, where the all-to-all costs (`ALLTOALL_SHARE`), its rings `within_capacity` as they are and grown
    (module doc, step 1: on DeepSeek-V3's EP 32, 2,048 GPUs, the rings within capacity as they are win 15
    of 16 batches, grown the 16th; the first option planned as it is too won none). `balance` tries the
    alternatives (lower targets, ever wider rings that offload) only where no family within capacity beat
    the first: where one did, an alternative won none of the DeepSeek-V3 EP 32 batches (2,048 GPUs, seeds
    0-7, both mixes), nor of the Mixtral / qwen3 EP cells of benchmarks/README.md, and they cost DeepSeek-V3
    3-4 placements of a unit family each."""
    alltoall = cost_model.expert_alltoall_seconds_per_token(pp_size=pp_size) * capacity
    capped, head = None, list(itertools.islice(options, 1))  # (not `len`: it would make every alternative)
    if head and alltoall >= ALLTOALL_SHARE * float(whole_times([capacity], cost_model=cost_model,
                                                               pp_size=pp_size)[0]):
        capped = within_capacity(lengths, head[0], capacity=capacity, cost_model=cost_model)
    seen, member_seconds = set(), {}

    def distinct(option: Option) -> list[Option]:  # the option's families not seen before, in order
        grown = unit_ring_sizes(lengths, option, ep_size=cost_model.expert_parallel_size, capacity=capacity,
                                cost_model=cost_model, pp_size=pp_size, member_seconds=member_seconds)
        new = []
        for sizes, ratios in ([option] if option is capped else []) + [grown]:
            if (key := sizes.tobytes()) not in seen:
                seen.add(key)
                new.append((sizes, ratios))
        return new

    first = [family for option in [*head, *([capped] if capped is not None else [])] for family in distinct(option)]
    rest = itertools.islice(options, 1, None)  # (`LazyOptions` makes each alternative as it is reached)
    return first, (family for option in rest for family in distinct(option))


@dataclass
class UnitLayout:
    """The rows of every unit: `lead[u]` the rows of unit u's rings of several units (at the indices
    `placement.place_rings` aligned them to), `given[u]` its other rows; `row_times[r]` row r's time;
    `widened`: the rings given more members than their ring size (`unit_rows.widen_rings`), by sequence."""

    ep_size: int
    rows: list[Row]
    lead: list[list[int]]
    given: list[list[int]]
    row_times: np.ndarray
    widened: dict[int, int]

    def schedules(self, *, lightest_first: Sequence[bool] = (False,)) -> Iterator[list[list[list[int]]]]:
        """Every rank's micro-batches (lists of sequence ids): each unit's lead rows, then its other rows
        heaviest first and/or lightest first (with PP the order changes the pipeline's bubbles). Every lane
        of a unit runs the unit's count; a lane with nothing at an index runs an empty micro-batch."""
        for flip in lightest_first:
            schedule = []
            for unit, lead in enumerate(self.lead):
                mine = sorted(self.given[unit], key=lambda r: (-self.row_times[r], r))
                if flip:
                    mine.reverse()
                for lane in range(self.ep_size):
                    schedule.append([list(self.rows[r].lanes[lane]) for r in lead + mine])
            yield schedule

    def rings(self, num_sequences: int) -> list[tuple[int, ...]]:
        """Every sequence's ring: the ranks holding it, in rank order (one rank: it is whole). Every
        (sequence, rank) pair in numpy, sorted by sequence then rank in one pass."""
        placed = [(unit, r) for unit, (lead, mine) in enumerate(zip(self.lead, self.given)) for r in lead + mine]
        lanes = [lane for _, r in placed for lane in self.rows[r].lanes]
        sizes, seqs = flat_ids(lanes)
        units = np.fromiter((unit for unit, _ in placed), dtype=np.int64, count=len(placed))
        lane_ranks = (units[:, None] * self.ep_size + np.arange(self.ep_size)).ravel()
        ranks = np.repeat(lane_ranks, sizes)
        ranks = ranks[np.lexsort((ranks, seqs))]
        counts = np.bincount(seqs, minlength=num_sequences)
        starts = np.cumsum(counts) - counts
        # a sequence on one rank (most of them) gets its 1-tuple from zip, in C; the others are sliced
        out = list(zip(np.append(ranks, -1)[starts].tolist()))
        ranks, starts = ranks.tolist(), starts.tolist()
        odd = np.flatnonzero(counts != 1)  # rings (and any sequence placed nowhere: an empty tuple)
        for seq, count in zip(odd.tolist(), counts[odd].tolist()):
            out[seq] = tuple(ranks[starts[seq]:starts[seq] + count])
        return out


def critical_rows(times: Sequence[float], free: Sequence[int], *, mean_lane: float, num_ranks: int) -> list[int]:
    """The rows of rings of several units (step 2: each of `times` seconds with `free` lanes free) that
    `place_units` also plans light (module doc, step 2): longest first, those that outlast `mean_lane` (a
    lane's mean work), while the lane-seconds their free lanes would give up fit in what the pool has to
    spare if it were perfectly level, D x (T - mean_lane) with T the longest such row (no step is
    shorter)."""
    slow = sorted((i for i, time in enumerate(times) if free[i] and time > mean_lane), key=lambda i: (-times[i], i))
    critical = []
    spare = num_ranks * (times[slow[0]] - mean_lane) if slow else 0.0
    for i in slow:
        spare -= free[i] * times[i]
        if spare < 0:
            break
        critical.append(i)
    return critical


@dataclass
class _UnitRows:
    """One batch's rows, arranged into units (`place_units`, steps 2-4 of the module doc): the arguments of
    `place_units`, the units' rows of rings of several units (`leads`: (unit, ring, lanes it takes there),
    at the indices `placement.place_rings` aligned them to, which end at `finish`), and the member seconds
    apart from routed experts that `level_rows` and `widen_rings` ask for, kept across arrangements."""

    ring_sizes: np.ndarray
    weights: np.ndarray
    tokens: np.ndarray
    span: np.ndarray
    ep_size: int
    capacity: int
    overhead: float
    full: float
    fine_work: float
    alltoall: float
    expert: float
    member_seconds: Callable[[int, int], float] | None
    leads: list[tuple[int, int, int]]
    finish: np.ndarray
    own: dict[tuple[int, int], float] = field(default_factory=dict)

    def own_seconds(self, length: int, size: int) -> float:
        """A member's seconds apart from routed experts (one lookup: `level_rows` asks ~100,000 times a plan)."""
        known = self.own.get((length, size))
        if known is None:
            known = self.own[length, size] = (self.member_seconds(length, size)
                                               - self.expert * max_member_tokens(length, size))
        return known

    def arrange(self, light: Sequence[int]) -> tuple[UnitLayout, float]:
        """Steps 2 to 4, the rows of `light` (indices into `leads`) kept light; the layout and its slowest
        unit's summed row times."""
        rows: list[Row] = []
        lead: list[list[int]] = [[] for _ in range(len(self.finish))]
        for unit, seq, taken in self.leads:
            lead[unit].append(len(rows))
            rows.append(Row([[seq] if lane < taken else [] for lane in range(self.ep_size)],
                            float(self.weights[seq]), list(range(taken, self.ep_size))))
        floating = len(rows)
        sizes, seconds_of, widened = self.lane_ring_rows(rows, floating, light)
        held = self.tokens.tolist()  # tokens each lane holds of each sequence: a ring member its fullest shard
        for seq in np.flatnonzero(sizes > 1).tolist():
            held[seq] = max_member_tokens(held[seq], int(sizes[seq]))
        held = np.asarray(held, dtype=np.float64)  # (integers: their float sums are exact)
        held_seconds = seconds_of - self.expert * held  # seconds apart from routed experts
        rows += self.whole_sequence_rows(rows, light, seconds_of=seconds_of, held=held, held_seconds=held_seconds)
        row_times, given = self.rows_to_units(rows, floating, lead, held=held, held_seconds=held_seconds)
        slowest = max((sum(row_times[r] for r in mine + theirs) for mine, theirs in zip(lead, given)), default=0.0)
        return UnitLayout(self.ep_size, rows, lead, given, row_times, widened), slowest

    def lane_ring_rows(self, rows: list[Row], floating: int,
                       light: Sequence[int]) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
        """Step 3's lane rings into `rows` (after its first `floating`, the rows of rings of several units),
        levelled and widened where `member_seconds` is given: every sequence's ring size and member
        seconds after the widening, and the rings widened."""
        sizes, seconds_of = self.ring_sizes, self.weights
        lane_ids = np.flatnonzero((sizes > 1) & (self.span == 1))
        ring_rows(rows, lane_ids[np.lexsort((lane_ids, -seconds_of[lane_ids]))].tolist(), ring_sizes=sizes,
                  weights=seconds_of, ep_size=self.ep_size, closed=set(light))
        if self.member_seconds is None:
            return sizes, seconds_of, {}
        lane_fill = self.full - self.expert * self.capacity
        rows[floating:] = level_rows(rows[floating:], lengths=self.tokens, own=self.own_seconds, fill=lane_fill)
        widened = widen_rings(rows[floating:], lengths=self.tokens, own=self.own_seconds, fill=lane_fill)
        if widened:
            sizes, seconds_of = sizes.copy(), seconds_of.astype(np.float64)
            for seq, size in widened.items():
                sizes[seq] = size
                seconds_of[seq] = self.member_seconds(int(self.tokens[seq]), size)
        return sizes, seconds_of, widened

    def whole_sequence_rows(self, rows: list[Row], light: Sequence[int], *, seconds_of: np.ndarray,
                            held: np.ndarray, held_seconds: np.ndarray) -> list[Row]:
        """Step 3's whole sequences: into the holes of `rows` (the free lanes of `light` capped at their
        fullest lane), and the rest in rows of their own, returned. The large sequences first, one of which
        leaves a lane no room for the next, and the short ones into their holes, so that those rows' lanes
        end alike; the short ones left in rows of their own."""
        tokens, whole_ids = self.tokens, np.flatnonzero(self.ring_sizes == 1)

        def fill(holed: list[Row], order: list[int], capped: Sequence[int] = ()) -> list[int]:
            totals = lane_sums(holed, [held, held_seconds], self.ep_size)  # rows timed as their lanes' own seconds
            for row, time in zip(holed, totals[1].max(axis=1, initial=-np.inf).tolist()):
                row.time = time
            return fill_holes(holed, order, weights=held_seconds, tokens=tokens, held=held, capacity=self.capacity,
                              lane_totals=totals, capped=capped)

        left = fill(rows, whole_ids[np.lexsort((whole_ids, -tokens[whole_ids], -seconds_of[whole_ids]))].tolist(),
                    capped=light)
        left = np.asarray(left, dtype=np.int64)
        is_short = tokens[left] * LARGE_PARTS < self.capacity
        short = left[is_short].tolist()
        large = whole_rows(left[~is_short].tolist(), weights=seconds_of, tokens=tokens, ep_size=self.ep_size,
                           capacity=self.capacity,
                           fine_work=self.fine_work - float(seconds_of[short].sum()))  # (less the short)
        short = fill(large, short)
        return large + whole_rows(short, weights=seconds_of, tokens=tokens, ep_size=self.ep_size,
                                  capacity=self.capacity, fine_work=self.fine_work)

    def rows_to_units(self, rows: list[Row], floating: int, lead: list[list[int]], *, held: np.ndarray,
                      held_seconds: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
        """Step 4: every row's time, and the rows after the first `floating` given to units, each after its
        `lead` rows. A row's time: every lane waits for the slowest and the fullest's all-to-all (lane
        tokens are integers, so their sums in floats are exact)."""
        lane_tokens, lane_seconds = lane_sums(rows, [held, held_seconds], self.ep_size)
        row_times = (self.overhead + lane_seconds.max(axis=1, initial=-np.inf)
                     + self.expert * lane_tokens.sum(axis=1) / self.ep_size
                     + self.alltoall * lane_tokens.max(axis=1, initial=0.0))
        base = self.finish + self.overhead * np.array([len(mine) for mine in lead], dtype=np.float64)
        later = np.arange(floating, len(rows))
        row_order = later[np.lexsort((later, -row_times[floating:]))].tolist()
        given = lpt(row_order, weights=row_times, loads=base.copy())
        return row_times, refine_local(given, weights=row_times, base=base)


def place_units(
    *,
    ring_sizes: np.ndarray,
    weights: np.ndarray,
    tokens: np.ndarray,
    num_ranks: int,
    ep_size: int,
    capacity: int,
    overhead: float,
    full: float,
    fine_work: float,
    alltoall: float = 0.0,
    expert: float = 0.0,
    member_seconds: Callable[[int, int], float] | None = None,
) -> UnitLayout:
    """Steps 2-4 of the module doc. `weights`: each sequence's member seconds at its ring size (whole:
    its time on one rank); `overhead`: a micro-batch's fixed seconds; `full`: a whole C-token document's
    seconds, the most a free lane's whole sequences take; `fine_work`: lane-seconds of the light rows;
    `alltoall`: the all-to-all's seconds per token of a row's fullest lane
    (`CostModel.expert_alltoall_seconds_per_token`), part of the row times units are balanced by;
    `expert`: the routed expert work's seconds per token (`CostModel.expert_seconds_per_token`), which
    the all-to-all spreads evenly over a row's lanes; `member_seconds`: (length, ring size) -> a member's
    seconds, for the rings `widen_rings` widens (None: every ring keeps its size)."""
    num_units = num_ranks // ep_size
    span = -(-ring_sizes // ep_size)  # units a ring touches
    wide = np.flatnonzero(span > 1)
    order = wide[np.lexsort((wide, -weights[wide], -span[wide]))].tolist()
    layout = place_rings(order, ring_sizes=span, weights=weights, num_ranks=num_units)
    leads = [(unit, seq, ep_size if unit != layout.rings[seq][-1] else  # (unit, ring, lanes it takes there)
              int(ring_sizes[seq]) - ep_size * (len(layout.rings[seq]) - 1))
             for unit in range(num_units) for seq in layout.ring_microbatches[unit]]
    batch = _UnitRows(ring_sizes=ring_sizes, weights=weights, tokens=tokens, span=span, ep_size=ep_size,
                      capacity=capacity, overhead=overhead, full=full, fine_work=fine_work, alltoall=alltoall,
                      expert=expert, member_seconds=member_seconds, leads=leads,
                      finish=np.asarray(layout.finish, dtype=np.float64))
    if not (alltoall or expert):  # a free lane's tokens lengthen its row only through these two
        return batch.arrange(())[0]
    times = [float(weights[seq]) + alltoall * max_member_tokens(int(tokens[seq]), int(ring_sizes[seq]))
             for _, seq, _ in leads]  # (module doc, step 2): with each lane's own all-to-all
    mean_lane = (float(weights @ ring_sizes) + alltoall * float(tokens.sum())) / num_ranks
    light = critical_rows(times, [ep_size - taken for _, _, taken in leads], mean_lane=mean_lane,
                          num_ranks=num_ranks)
    if light and min(times[i] for i in light) >= IDLE_POOL * mean_lane:  # the pool mostly idles beside them
        return batch.arrange(light)[0]
    placed, slowest = batch.arrange(())
    if light:
        other, other_slowest = batch.arrange(light)
        if other_slowest < slowest * (1 - 1e-9):
            placed = other
    return placed
