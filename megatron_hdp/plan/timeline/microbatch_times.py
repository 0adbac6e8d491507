"""Every micro-batch's own time and tokens under a schedule: the loop `assemble.time_plan` times a plan with.

- a micro-batch of whole sequences takes the micro-batch overhead plus each sequence's whole time (the
  cost model is additive over shards), all of them summed at once;
- a micro-batch with ring shards is `cost_model.microbatch_time` of its shards on one pipeline stage
  (documents on one ring share one ring exchange, as at run time), once per (rank, sequences) and once
  per content (`TimingCache`);
- the kind of each ring (K/V or, for multi-latent attention, latent) is decided once per ring call (the
  sequences on one ring in one micro-batch), from the sequences' lengths and ceil(s/k) tokens per member
  by `CostModel.ring_kind_for`, so every member times the call with the same kind.

None of it reads the cost model's EP size, which enters after (`assemble.time_plan`: padding, the
expert coupling, the timeline), so one loop serves every EP size a placement is timed under.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import whole_times
from megatron_hdp.plan.flat_ids import flat_ids
from megatron_hdp.plan.zigzag import zigzag_token_counts


@functools.lru_cache(maxsize=1 << 14)
def _token_counts(length: int, ring_size: int) -> list[int]:
    """`zigzag_token_counts(length, ring_size)` as a list, remembered (read only: callers index it): every
    placement's TimingCache asks again for the rings of the batch's lengths and sizes (~800 a family on
    Mixtral EP 8 at 1,024 ranks, ~10 us each in numpy)."""
    return zigzag_token_counts(length, ring_size).tolist()


@dataclass
class TimingCache:
    """What `time_plan` calls of one set of lengths and rings share, their schedules differing only in
    order or group size (`balance` tries each placement with its rings shifted and with two group sizes,
    and re-times the plan made as if EP 1 with the coupling): each sequence's whole time, each ring
    member's position, and each micro-batch holding ring shards by (rank, sequence ids): its time, tokens
    and ring kinds (a ring call's kind depends only on the sequences on it, the same at every member).
    None of these read the cost model's EP size (it enters after them, `expert_coupled_times` and the
    coupling), so calls whose cost models differ only in it may share one; `basis` (the cost model at EP 1)
    holds them to that. A schedule timed again under the same EP size (balance's EP-1 pass re-timing its
    winner with the coupling) is the plan timed before (`plans`). Pass one only to calls with the same
    lengths and rings (`positions`, `in_ring` and `whole`, each sequence's whole time, are theirs)."""

    basis: CostModel | None = None
    positions: dict[int, dict[int, int]] | None = None
    in_ring: np.ndarray | None = None
    ring_ids: dict[int, int] | None = None
    """Each ring sequence's ring, numbered by distinct ring (`ring_shapes[id]`: its size and link bandwidth)."""
    ring_shapes: list[tuple[int, float]] | None = None
    ring_tokens: dict[int, list[int]] = field(default_factory=dict)
    """Each ring sequence's tokens at every ring position (`zigzag_token_counts`), made where first needed."""
    whole: np.ndarray | None = None
    microbatches: dict[tuple[int, tuple[int, ...]], tuple[float, int, list[tuple[int, str]]]] = field(
        default_factory=dict)
    plans: dict[tuple[int, int | None, int], Any] = field(default_factory=dict)
    """`assemble.TimedPlan`s timed, by (schedule id, group size, EP size)."""
    loops: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """`microbatch_times` of each schedule timed, by (id, pp_size), with the schedule (whose identity is
    checked): the same for every EP size."""
    contents: dict = field(default_factory=dict)
    """Ring micro-batches by content, whichever rank: per piece its length, its ring's label (in order of
    first piece) and the tokens it holds, and per ring its size and link bandwidth, which is all
    `CostModel.microbatch_time` and the ring-kind decision read of a ring (the members of a ring mostly
    hold equal tokens, so they mostly share one entry). May be shared by the caches of one batch's
    placements (`balance`), whose rings differ."""


def microbatch_times(
    *,
    lengths: list[int],
    rings: Sequence[tuple[int, ...]],
    schedule: Sequence[Sequence[Sequence[int]]],
    cost_model: CostModel,
    pp_size: int,
    shared: TimingCache,
) -> tuple[list[float], list[int], list[int], list[str], dict[int, int]]:
    """`time_plan`'s micro-batch loop: every micro-batch's own time (before padding and the EP coupling) and
    the tokens it holds, rank by rank, where each rank's start (`TimedPlan.bounds`), each sequence's ring
    kind and the index of each ring sequence's micro-batch. None of these read the EP size, so `time_plan` makes them once per schedule
    (`TimingCache.loops`) and the EP-1 pass's re-timing of a placement under the coupling only re-runs the
    timeline after them.

    A micro-batch of whole sequences takes the micro-batch overhead plus each sequence's whole time (the
    cost model is additive over shards): all of them at once, summed by `np.bincount` in the order of the
    schedule from 0.0, plain float additions left to right (Python 3.11's `sum`; the same floats on
    every rank whatever its Python). Micro-batches
    with ring shards go through the cost model, rank by rank and in order (`_ring_microbatch`)."""
    if shared.positions is None:
        in_ring = np.fromiter(map(len, rings), dtype=np.int64, count=len(rings)) > 1
        shared.positions = {seq: {rank: p for p, rank in enumerate(rings[seq])}
                            for seq in np.flatnonzero(in_ring).tolist()}
        shared.whole = whole_times(lengths, cost_model=cost_model, pp_size=pp_size)
        shared.in_ring = in_ring
        distinct: dict[tuple[int, ...], int] = {}  # each ring hashed once, not at every member's micro-batch
        shared.ring_ids = {seq: distinct.setdefault(rings[seq], len(distinct)) for seq in shared.positions}
        shared.ring_shapes = [(len(ring), cost_model.ring_link_bandwidth(ring)) for ring in distinct]
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    per_rank = np.fromiter(map(len, schedule), dtype=np.int64, count=len(schedule))
    flat = list(itertools.chain.from_iterable(schedule))  # every micro-batch, rank by rank
    sizes, seqs = flat_ids(flat)
    cell = np.repeat(np.arange(len(flat)), sizes)
    times = (overhead + np.bincount(cell, weights=shared.whole[seqs], minlength=len(flat))).tolist()
    held = np.bincount(cell, weights=np.asarray(lengths, dtype=np.float64)[seqs], minlength=len(flat))
    tokens = held.astype(np.int64).tolist()  # exact: far below 2^53 tokens
    kinds = ["kv"] * len(lengths)
    ring_index: dict[int, int] = {}
    starts = np.concatenate([[0], np.cumsum(per_rank)])
    rank_of = np.repeat(np.arange(len(schedule)), per_rank)
    alike: dict[tuple[int, int], int] = {}  # a lone ring shard's micro-batch by (sequence, tokens held)
    positions, ring_tokens = shared.positions, shared.ring_tokens
    for at, rank, alone in zip(*(a.tolist() for a in _ring_cells(cell[shared.in_ring[seqs]], rank_of, sizes))):
        if alone:  # the ring's members holding as many tokens share its time: the first one's (the same floats)
            seq = flat[at][0]
            if seq not in ring_tokens:
                ring_tokens[seq] = _token_counts(lengths[seq], len(positions[seq]))
            first = alike.setdefault((seq, ring_tokens[seq][positions[seq][rank]]), at)
            if first != at:
                times[at], tokens[at] = times[first], tokens[first]
                continue
        times[at], tokens[at] = _ring_microbatch(flat[at], rank, at - int(starts[rank]), lengths=lengths, rings=rings,
                                                 kinds=kinds, ring_index=ring_index, cost_model=cost_model,
                                                 pp_size=pp_size, shared=shared)
    return times, tokens, starts.tolist(), kinds, ring_index


def _ring_cells(ring_pieces: np.ndarray, rank_of: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
    """The micro-batches (flat indices, in order: rank by rank, index by index) holding ring shards, given
    one entry per ring shard, with each one's rank and whether the shard is alone in it."""
    at = distinct_sorted(ring_pieces)
    return at, rank_of[at], sizes[at] == 1


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """`np.unique(values)` of a sorted 1-D array (micro-batch numbers taken in schedule order), without its
    sort: the first of each run. (NumPy 2's `unique` also imports `numpy.ma` on its first call, ~25 ms of
    the first plan a process makes.)"""
    keep = np.empty(len(values), dtype=bool)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _ring_microbatch(seqs: Sequence[int], rank: int, index: int, *, lengths: list[int],
                     rings: Sequence[tuple[int, ...]], kinds: list[str], ring_index: dict[int, int],
                     cost_model: CostModel, pp_size: int, shared: TimingCache) -> tuple[float, int]:
    """The time and tokens of rank `rank`'s micro-batch `index` holding ring shards (`seqs`), from the cost
    model once per (rank, sequences) and once per content (`TimingCache`); writes its rings' kinds into
    `kinds` and their index into `ring_index` where not there yet."""
    positions, ring_ids = shared.positions, shared.ring_ids
    key = (rank, tuple(seqs))
    known = shared.microbatches.get(key)
    if known is None:
        labels: dict[int, int] = {}  # the micro-batch's rings (by `ring_ids`), in order of first piece
        parts = []
        for seq in seqs:
            where = positions.get(seq)
            if where is not None and seq not in shared.ring_tokens:
                shared.ring_tokens[seq] = _token_counts(lengths[seq], len(where))
            parts.append((lengths[seq], -1, lengths[seq]) if where is None else
                         (lengths[seq], labels.setdefault(ring_ids[seq], len(labels)),
                          shared.ring_tokens[seq][where[rank]]))
        content = (pp_size, tuple(parts), tuple(shared.ring_shapes[ring] for ring in labels))
        same = shared.contents.get(content)
        if same is None:
            _decide_ring_kinds(seqs, rings=rings, lengths=lengths, kinds=kinds, cost_model=cost_model,
                               decided=ring_index)
            costs = [(length, held, rings[seq] if label >= 0 else (), kinds[seq])
                     for seq, (length, label, held) in zip(seqs, parts)]
            ring_kinds = {labels[ring_ids[seq]]: kinds[seq] for seq in seqs if seq in positions}
            same = shared.contents[content] = (cost_model.microbatch_time(costs, pp_size=pp_size),
                                               sum(c[1] for c in costs),
                                               [ring_kinds[label] for label in range(len(labels))])
        known = shared.microbatches[key] = (same[0], same[1], [(seq, same[2][labels[ring_ids[seq]]])
                                                              for seq in seqs if seq in positions])
    time, held, ring_kinds = known
    for seq, kind in ring_kinds:
        kinds[seq] = kind
        ring_index.setdefault(seq, index)
    return time, held


def _decide_ring_kinds(
    seqs: Sequence[int], *, rings: Sequence[tuple[int, ...]], lengths: Sequence[int], kinds: list[str],
    cost_model: CostModel, decided: dict[int, int],
) -> None:
    """Write into `kinds` the ring kind of every ring call of the micro-batch `seqs` not decided yet (its
    sequences not in `decided`): one per ring, from ceil(s/k) tokens per member of each of its sequences,
    so that every member of the ring, holding the same sequences in its micro-batch, decides alike (a kind
    the cost model forces, `ring_kind_for` returns without reading the call: no sums for it)."""
    calls: dict[tuple[int, ...], list[int]] = {}
    for seq in seqs:
        if len(rings[seq]) > 1 and seq not in decided:
            if cost_model.ring_kind != "auto":
                kinds[seq] = cost_model.ring_kind
            else:
                calls.setdefault(rings[seq], []).append(seq)
    for ring, members in calls.items():
        k = len(ring)
        tokens = [-(-lengths[seq] // k) for seq in members]
        attention = sum(cost_model.a1 * lengths[seq] * t for seq, t in zip(members, tokens))
        kind = cost_model.ring_kind_for(num_tokens=sum(tokens), attention=attention, ring_size=k,
                                        bandwidth=cost_model.ring_link_bandwidth(ring))
        for seq in members:
            kinds[seq] = kind
