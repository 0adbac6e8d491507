"""A lower bound on the step of every EP-unit plan of a batch: what EP groups of e coupled lanes cost
beyond the work floor, proved per batch by a configuration LP over the rows its long documents force
(issue 41: DeepSeek-V3 at EP 32, where balance plans 3-4% above the work floor).

The plans it bounds (`in_bound_class`): the cost model's timeline without PP, EP size e > 1, every ring of
at most e ranks inside one EP group and every longer ring on whole groups but one (the plans of
`expert_units`, balance's EP plans), and micro-batches of at most C tokens unless they hold one piece
(a ring member's shard, or a whole document) of more than C tokens, offloaded, and nothing else (the
memory rule balance plans by: `unit_rows.fill_holes` fills up to C, `whole_rows` gives a document
longer than C an empty bin). The contract holds every ring's members at one micro-batch index. Not
covered: rings of at most e ranks across two groups, which the contract allows (members of alike rings
could then tile rows across groups); nor PP.

Why it is a bound. In each EP group the micro-batch indices are *rows* of e lanes; `ep_floor` (steps 1-3)
gives a group's time as at least the sum over its rows of overhead + O + spt x (mean tokens) + a2a x T, O
the largest lane's own seconds (apart from its routed experts), T the largest lane's tokens, and the step
is at least the mean group. The work floor F holds each document's whole seconds and each token's own
all-to-all. So, with own(d) a whole document's seconds apart from its routed experts:

    D (step - F) >= sum over rows r of [ e O_r + e a2a T_r - sum over documents d in r of (own(d) + a2a s_d) ].

In a row: (i) O_r >= the largest piece's own; (ii) e O_r >= the sum of its lanes' own >= its documents'
own + their rings' inflation (each member's own less its share of own(d)); (iii) every lane holds at
most T_r tokens, at most C without a piece over C. Documents of at most C tokens (*light*) have at most
rho = max over light documents of own(s) / s own seconds a token beyond their rings' inflation, which
is dropped (>= 0). So a row holding the heavy pieces H costs at least

    max(e O - own(H) - rho F, inflation(H)) + a2a (e T - tokens of H's pieces over C - (e - n_big) C),

F = (e - n_big) C - tokens of H's pieces of at most C (the most light tokens its lanes hold; light
documents lower the term per token, so they fill it), n_big H's pieces over C (one a lane), O the
largest own of H's pieces and T >= max(C, their largest tokens). The least sum over a batch's rows of
such terms, every heavy document (over C) in one row, is at least the value of a configuration LP
(Gilmore-Gomory): a column is a row's heavy rings (*items*), its cost the term above. Column generation
(`_candidate_rows`, knapsacks per leader, and `_price_exact`, a MILP per group of leaders whose solver's
dual bound bounds every column's reduced cost) improves the LP's duals pi; then `_feasible_scale` scales
them down until no column has a negative reduced cost (Farley's bound), and sum_s n_s x (scaled pi_s),
less the number of heavy documents times the least reduced cost left (>= `FEASIBLE`), is at most the
LP's value (weak duality: every row holds a heavy document, so there are at most that many such rows).

Items, per heavy length s: each ring size k whose members hold more than C tokens (k = 1: whole, offloaded)
exactly; the sizes up to e whose members all hold at most C as one item (its own less rho times its
tokens does not depend on k; its least largest own and least inflation over those sizes); rings of more
than e members as one item (their full rows cost at least their inflation, which it counts; the partial
row holds at most e - 1 members of at most ceil(s / (e + 1)) tokens, as light work of s's own density).
A member's own lower bound: linear work plus the larger of attention (with a latent ring's
up-projection) and the ring's bytes over the fastest link without the messages' latency, plus its block
overheads, under the kind of least time. A ring call of several documents (packed) pays max(sum of work,
sum of traffic + one latency): at least its members' bounds where every piece of at most C on that ring
size is traffic-bound under that kind (checked per size and kind; pieces over C share no micro-batch),
else that size and kind counts the work alone.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_matrix

from megatron_hdp.plan.cost.model import RING_KINDS, CostModel
from megatron_hdp.plan.cost.sharding import max_member_tokens, whole_times
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.zigzag import zigzag_token_counts

QUANTA = 8
"""Capacity units per lane in the pricing knapsack: a piece of at most C tokens uses its tokens / C of a lane,
rounded down to 1 / QUANTA (a relaxation: the bound can only fall)."""

MAX_ROUNDS = 12
"""Column-generation rounds at most: the bound holds after any round (`_feasible_scale`), tighter after more.
On DeepSeek-V3's batches the LP's value settles in 2-10 rounds of ~30 s and then tails off."""

COLUMNS_PER_ROUND = 200
"""New columns added to the master LP per round, least reduced cost first."""

FEASIBLE = -1e-6
"""`_feasible_scale` stops once every row's reduced cost is at least this (lane-seconds)."""

DINKELBACH_STEPS = 8
"""`_feasible_scale`'s iterations at most (it converges in 2-4 on DeepSeek-V3's batches)."""

LEADER_GROUPS = 8
"""The exact pricing runs once per group of leaders (by own): a row of least reduced cost from each, and
the least of their dual bounds as r*."""


@dataclasses.dataclass(frozen=True)
class EPUnitBound:
    """`ep_unit_bound`'s answer: `seconds` the bound on the step, `work_floor` the work floor it starts from,
    `lp` the last master LP's value and `least_reduced` r* (lane-seconds), `rounds` of column generation."""

    seconds: float
    work_floor: float
    lp: float
    least_reduced: float
    rounds: int


@dataclasses.dataclass
class _Items:
    """The heavy rings a row may hold, one entry each (module doc): `kind` the heavy length's index, `units`
    capacity in 1 / QUANTA lanes, `top` its largest member own (seconds), `tokens` its largest member's
    tokens (0: none over C), `own_part` P, `inflation` Q, `alltoall` B (lane-seconds), `copies` at most."""

    kind: np.ndarray
    units: np.ndarray
    top: np.ndarray
    tokens: np.ndarray
    own_part: np.ndarray
    inflation: np.ndarray
    alltoall: np.ndarray
    copies: np.ndarray


def _fastest_bandwidth(cost_model: CostModel) -> float:
    """The fastest link any ring can run over (inside a node where a node holds several HDP ranks)."""
    links = [cost_model.ring_bandwidth]
    if cost_model.intra_node_bandwidth is not None and (cost_model.ranks_per_node or 1) > 1:
        links.append(cost_model.intra_node_bandwidth)
    return max(links)


def _kinds(cost_model: CostModel) -> list[str]:
    """The ring kinds a call may run: the forced one, or both where the model has a latent to send."""
    if cost_model.ring_kind != "auto":
        return [cost_model.ring_kind]
    return list(RING_KINDS) if cost_model.latent_bytes_per_token else ["kv"]


def _member_own(cost_model: CostModel, length: int, tokens: np.ndarray, ring_size: int, *, traffic: dict,
                spt: float) -> np.ndarray:
    """Each member's own seconds lower bound (module doc), whole model, without its routed expert work;
    `traffic[kind]`: whether this ring size's traffic may count under that kind."""
    t = tokens.astype(np.float64)
    linear = cost_model.b1 * t
    if ring_size == 1:
        per_layer = linear + cost_model.a1 * length * t
    else:
        bandwidth = _fastest_bandwidth(cost_model)
        best = None
        for kind in _kinds(cost_model):
            work = cost_model.a1 * length * t + cost_model.layer_up_projection_time(num_tokens=t, ring_size=ring_size,
                                                                                     kind=kind)
            sent = cost_model.layer_ring_bytes(num_tokens=t, ring_size=ring_size, kind=kind) / bandwidth
            time = np.maximum(work, sent) if traffic[kind] else work
            best = time if best is None else np.minimum(best, time)
        per_layer = linear + best + 2 * (ring_size - 1) * cost_model.ring_block_overhead
    return per_layer * cost_model.num_layers - spt * t


def _traffic_counts(cost_model: CostModel, lengths: Sequence[int], ring_size: int, capacity: int) -> dict:
    """Per kind: whether every piece of at most C tokens on rings of `ring_size` (of `lengths`, those that
    can have such members) is traffic-bound, so that packed calls pay at least their members' bounds."""
    bandwidth = _fastest_bandwidth(cost_model)
    out = {}
    for kind in _kinds(cost_model):
        sent = cost_model.layer_ring_bytes(num_tokens=1, ring_size=ring_size, kind=kind) / bandwidth
        up = cost_model.layer_up_projection_time(num_tokens=1, ring_size=ring_size, kind=kind)
        out[kind] = all(sent >= cost_model.a1 * s + up for s in lengths if -(-s // ring_size) <= capacity + 1)
    return out


def _build_items(heavy: np.ndarray, counts: np.ndarray, light_max: int, *, cost_model: CostModel, capacity: int,
                 rho: float) -> _Items:
    """The items of every heavy length (module doc, "Items"), `counts[i]` documents of length `heavy[i]`."""
    e = cost_model.expert_parallel_size
    traffic = {k: _traffic_counts(cost_model, [*heavy.tolist(), light_max], k, capacity) for k in range(2, e + 2)}
    rows = [row for kind, (length, count) in enumerate(zip(heavy.tolist(), counts.tolist()))
            for row in _items_of(length, kind, count, cost_model=cost_model, capacity=capacity, rho=rho,
                                 traffic=traffic)]
    columns = list(zip(*rows))
    return _Items(*(np.asarray(c, dtype=np.float64) if i in (2, 3, 4, 5, 6) else np.asarray(c, dtype=np.int64)
                    for i, c in enumerate(columns)))


def _items_of(length: int, kind: int, count: int, *, cost_model: CostModel, capacity: int, rho: float,
              traffic: dict) -> list[tuple]:
    """One heavy length's items, as `_Items` rows: (kind, units, top, tokens, P, Q, B, copies)."""
    e = cost_model.expert_parallel_size
    spt, a2a = cost_model.expert_seconds_per_token(), cost_model.expert_alltoall_seconds_per_token()
    own = float(whole_times([length], cost_model=cost_model)[0]) - spt * length

    def ring(k: int) -> tuple[np.ndarray, np.ndarray]:  # each member's tokens and own lower bound
        t = np.array([length]) if k == 1 else np.asarray(zigzag_token_counts(length, k), dtype=np.int64)
        return t, _member_own(cost_model, length, t, k, traffic=traffic.get(k, {}), spt=spt)

    rows = []
    sizes = range(1, min(e, length // 2) + 1)
    small = [k for k in sizes if max_member_tokens(length, k) <= capacity]
    for k in sizes[:small[0] - 1] if small else sizes:
        t, o = ring(k)  # members over C: exactly
        big = t > capacity
        units = int(big.sum()) * QUANTA + int(np.floor(t[~big].sum() * QUANTA / capacity))
        rows.append((kind, units, float(o.max()), float(t.max()), -own + rho * float(np.minimum(t, capacity).sum()),
                     max(0.0, float(o.sum()) - own), a2a * float(np.minimum(0, capacity - t).sum()), count))
    if small:  # the sizes whose members hold at most C: their least largest own, their least inflation
        members = [ring(k)[1] for k in small]
        rows.append((kind, int(np.floor(length * QUANTA / capacity)), min(float(o.max()) for o in members), 0.0,
                     -own + rho * length, max(0.0, min(float(o.sum()) for o in members) - own), 0.0, count))
    if 2 * (e + 1) <= length:  # rings of more than e members: the partial row's members as dense light work
        t, o = ring(e + 1)
        partial = (e - 1) * float(t.max())
        rows.append((kind, 0, 0.0, 0.0, -max(0.0, own / length - rho) * partial, max(0.0, float(o.sum()) - own),
                     0.0, count))
    return rows


def _column_cost(items: _Items, chosen: Sequence[int], *, e: int, capacity: int, rho: float, a2a: float) -> float:
    """A row's term (module doc) for the items `chosen` (with repeats)."""
    idx = np.asarray(chosen, dtype=np.int64)
    top = float(items.top[idx].max())
    tall = max(float(capacity), float(items.tokens[idx].max()))
    first = e * top - rho * e * capacity + float(items.own_part[idx].sum())
    inflation, alltoall = float(items.inflation[idx].sum()), float(items.alltoall[idx].sum())
    return max(first, inflation) + a2a * e * (tall - capacity) + alltoall


def _add(dp: np.ndarray, trail: list, j: int, units: int, value: float, copies: int) -> None:
    """Item j into the 0/1 knapsack `dp` (least value at each capacity used), each of its copies in turn;
    `trail` records the cells each copy improved, to rebuild the choice."""
    cap = len(dp) - 1
    if value >= 0:  # (a minimum never takes it)
        return
    for _ in range(copies):
        if units > cap:
            return
        cand = dp[: cap + 1 - units] + value
        better = np.flatnonzero(cand < dp[units:])
        if not len(better):
            return
        trail.append((j, units, set((better + units).tolist())))
        dp[units:][better] = cand[better]


def _rebuild(trail: list, at: int, leader: int) -> list[int]:
    """The items of the knapsack cell `at` (walking the trail back), with the leader that started it."""
    chosen = [leader]
    for j, units, cells in reversed(trail):
        if at in cells:
            chosen.append(j)
            at -= units
    return chosen


WEIGHTS = (0.0, 0.5, 1.0)
"""`_candidate_rows` minimises w P + (1 - w) Q + B - pi, separable, for each of these weights w in place
of the row's max(P, Q) + B - pi: candidates for the master LP (the proof is `_price_exact`'s)."""


def _candidate_rows(items: _Items, pi: np.ndarray, *, e: int, capacity: int, rho: float, a2a: float) -> list:
    """Rows of low reduced cost under the duals `pi`, cheaply: for each leader (the row's item of largest
    own) and weight of `WEIGHTS`, a knapsack over the items of no larger own, those no taller than the
    leader (tall: max(C, tokens)) first with the leader the row's tallest, then each taller one in
    ascending order as the row's tallest with those before it."""
    cap = e * QUANTA
    dual = pi[items.kind]
    tall = np.maximum(items.tokens, float(capacity))
    found = []
    for leader in range(len(items.kind)):
        if items.units[leader] > cap:
            continue
        allowed = np.flatnonzero(items.top <= items.top[leader])
        allowed = allowed[np.argsort(tall[allowed], kind="stable")]
        order = [*allowed[tall[allowed] <= tall[leader]].tolist(), None,
                 *allowed[tall[allowed] > tall[leader]].tolist()]
        copies = items.copies.copy()
        copies[leader] -= 1
        for weight in WEIGHTS:
            values = weight * items.own_part + (1 - weight) * items.inflation + items.alltoall - dual
            constant = weight * (e * float(items.top[leader]) - rho * e * capacity)
            dp = np.full(cap + 1, np.inf)
            dp[int(items.units[leader])] = values[leader]
            trail: list = []
            best = None
            for j in order:
                if j is None:  # the leader the tallest
                    at = int(np.argmin(dp))
                    best = (constant + a2a * e * (tall[leader] - capacity) + dp[at], list(trail), at)
                    continue
                w = int(items.units[j])
                if tall[j] > tall[leader] and w <= cap and values[j] < 0:  # j the tallest
                    at = int(np.argmin(dp[: cap + 1 - w]))
                    value = constant + a2a * e * (tall[j] - capacity) + dp[at] + values[j]
                    if value < best[0]:
                        best = (value, trail + [(j, w, {at + w})], at + w)
                _add(dp, trail, j, w, float(values[j]), int(copies[j]))
            if best[0] < -1e-9:
                found.append(_rebuild(best[1], best[2], leader))
    return found


def _price_exact(items: _Items, pi: np.ndarray, leaders: np.ndarray, *, e: int, capacity: int, rho: float,
                 a2a: float) -> tuple[float, list[int] | None]:
    """(r*, row): a proven lower bound on every row's reduced cost under the duals `pi` (the MILP solver's
    dual bound), and the row of least reduced cost it found (None: none). A row's reduced cost is
    sum_i (Q_i + B_i - pi_i) + max(0, e O - rho e C - sum_i d_i) + a2a e (T - C), d_i = Q_i - P_i, O the
    leader's (z) largest own and T the tallest's (y) tokens, at least C. The leader is one of `leaders`
    (a boolean mask): rows led by the others are priced by other calls."""
    n = len(items.kind)
    tall = np.maximum(items.tokens, float(capacity))
    d = items.inflation - items.own_part
    # variables: x (copies), z (leader), y (tallest over C), idle, then the chains: top_at[g] = sum of z over
    # the items of own >= level g (descending), tall_at[h] likewise for y (so that each item's bound on its
    # copies reads one variable, not every leader above it)
    tops, top_level = np.unique(-items.top, return_inverse=True)
    talls, tall_level = np.unique(-tall, return_inverse=True)
    x, z, y, idle = np.arange(n), n + np.arange(n), 2 * n + np.arange(n), 3 * n
    top_at = 3 * n + 1 + np.arange(len(tops))
    tall_at = top_at[-1] + 1 + np.arange(len(talls))
    size = int(tall_at[-1]) + 1
    rows, cols, vals, lo, hi = [], [], [], [], []

    def constraint(entries: list[tuple], low: float, high: float) -> None:
        r = len(lo)
        for at, coef in entries:
            at = np.atleast_1d(at)
            rows.extend([r] * len(at))
            cols.extend(at.tolist())
            vals.extend(np.broadcast_to(coef, at.shape).tolist())
        lo.append(low)
        hi.append(high)

    constraint([(x, items.units / QUANTA)], -np.inf, e)  # lanes
    constraint([(z, 1.0)], 1.0, 1.0)  # one leader
    constraint([(y, 1.0)], 0.0, 1.0)  # at most one tallest over C
    for g in range(len(tops)):  # top_at[g] = top_at[g - 1] + the leaders at level g
        here = z[top_level == g]
        constraint([(top_at[g], 1.0), (here, -1.0)] + ([(top_at[g - 1], -1.0)] if g else []), 0.0, 0.0)
    for h in range(len(talls)):
        here = y[tall_level == h]
        constraint([(tall_at[h], 1.0), (here, -1.0)] + ([(tall_at[h - 1], -1.0)] if h else []), 0.0, 0.0)
    for j in range(n):
        constraint([(np.array([z[j], x[j]]), np.array([1.0, -1.0]))], -np.inf, 0.0)  # the leader is in the row
        constraint([(np.array([y[j], x[j]]), np.array([1.0, -1.0]))], -np.inf, 0.0)
        constraint([(x[j], 1.0), (top_at[top_level[j]], -float(items.copies[j]))], -np.inf, 0.0)  # own <= O
        if tall[j] > capacity:  # tokens <= T
            constraint([(x[j], 1.0), (tall_at[tall_level[j]], -float(items.copies[j]))], -np.inf, 0.0)
    constraint([(idle, 1.0), (x, d), (z, -e * items.top)], -rho * e * capacity, np.inf)
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lo), size)).tocsr()
    objective = np.concatenate([items.inflation + items.alltoall - pi[items.kind], np.zeros(n),
                                a2a * e * (tall - capacity), [1.0], np.zeros(size - 3 * n - 1)])
    upper = np.concatenate([items.copies.astype(np.float64), leaders.astype(np.float64), np.ones(n), [np.inf],
                            np.ones(size - 3 * n - 1)])
    integrality = np.concatenate([np.ones(3 * n), np.zeros(size - 3 * n)])
    result = milp(objective, constraints=LinearConstraint(matrix, lo, hi), integrality=integrality,
                  bounds=Bounds(np.zeros(size), upper), options={"mip_rel_gap": 0.0})
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        bound = result.fun if result.success else -np.inf
    if result.x is None:
        return float(bound), None
    counts = np.rint(result.x[:n]).astype(np.int64)
    return float(bound), [j for j in np.flatnonzero(counts).tolist() for _ in range(counts[j])]


def _price_groups(items: _Items, pi: np.ndarray, groups: list[np.ndarray], **cost) -> tuple[float, list]:
    """`_price_exact` over every group of leaders: the least dual bound, and each group's row."""
    least, rows = np.inf, []
    for group in groups:
        bound, row = _price_exact(items, pi, group, **cost)
        least = min(least, bound)
        rows += [row] if row else []
    return least, rows


def _feasible_scale(items: _Items, pi: np.ndarray, groups: list[np.ndarray], priced: tuple[float, list],
                    **cost) -> tuple[float, float]:
    """(s, r*): the duals s x pi, s in [0, 1], that `_price_groups` proves (nearly) feasible, by
    Dinkelbach's iteration (each row's reduced cost falls with s: its cost is >= 0 and its duals' sum
    grows); r* the least reduced cost at s x pi (>= FEASIBLE, counted in the bound as R x r*). `priced`:
    `_price_groups` at pi itself, which column generation has just made. Farley's
    observation: column generation's last duals, scaled down until no row has a negative reduced cost,
    bound the LP without waiting for its tail."""
    scale, (least, rows) = 1.0, priced
    for step in range(DINKELBACH_STEPS):
        if step:
            least, rows = _price_groups(items, scale * pi, groups, **cost)
        if least >= FEASIBLE or not rows:
            return scale, least
        ratios = [_column_cost(items, row, **cost) / float(pi[items.kind[row]].sum()) for row in rows
                  if float(pi[items.kind[row]].sum()) > 0]
        scale = max(0.0, min([scale, *ratios]))
    return scale, _price_groups(items, scale * pi, groups, **cost)[0]


def in_bound_class(plan: StepPlan, *, ep_size: int) -> bool:
    """Whether `plan` is one of the plans `ep_unit_bound` holds for (module doc): no PP, every micro-batch
    within the plan's capacity C but for one that holds a single piece, every ring of at most `ep_size`
    ranks inside one EP group, and every longer ring on whole groups but one."""
    if plan.pp_size != 1:
        return False
    for rank in plan.ranks:
        if any(mb.num_tokens > plan.capacity and len(mb.shards) > 1 for mb in rank.microbatches):
            return False
    for seq in plan.sequences:
        groups = np.bincount(np.asarray(seq.ring) // ep_size)
        groups = groups[groups > 0]
        if len(seq.ring) <= ep_size and len(groups) > 1:
            return False
        if len(seq.ring) > ep_size and (groups < ep_size).sum() > 1:
            return False
    return True


def ep_unit_bound(lengths: Sequence[int], cost_model: CostModel, *, num_ranks: int, capacity: int,
                  max_rounds: int = MAX_ROUNDS,
                  progress: Callable[[int, float, float, float], None] | None = None) -> EPUnitBound:
    """The bound of the module doc on the predicted step of every plan of `lengths` on `num_ranks` ranks
    with `cost_model`'s EP size e > 1 that `in_bound_class` admits (capacity C), at least the work floor.
    `max_rounds` of column generation at most; `progress(round, LP value, r*, floor + LP / D)` after each,
    the last an upper limit of what the proof can reach."""
    e = cost_model.expert_parallel_size
    if e <= 1 or num_ranks % e:
        raise ValueError(f"ep_unit_bound needs an EP size > 1 dividing the ranks, got EP {e} on {num_ranks}")
    spt, a2a = cost_model.expert_seconds_per_token(), cost_model.expert_alltoall_seconds_per_token()
    tokens = np.asarray(lengths, dtype=np.int64)
    own = whole_times(tokens, cost_model=cost_model)
    floor = float((own + a2a * tokens).sum()) / num_ranks
    light = tokens <= capacity
    rho = float(((own[light] - spt * tokens[light]) / tokens[light]).max()) if light.any() else 0.0
    heavy, counts = np.unique(tokens[~light], return_counts=True)
    if not len(heavy):
        return EPUnitBound(floor, floor, 0.0, 0.0, 0)
    items = _build_items(heavy, counts, int(tokens[light].max()) if light.any() else 1, cost_model=cost_model,
                         capacity=capacity, rho=rho)
    cost = dict(e=e, capacity=capacity, rho=rho, a2a=a2a)
    columns = [[j] for j in range(len(items.kind)) if items.units[j] <= e * QUANTA]
    seen = {tuple(c) for c in columns}
    by_top = np.argsort(items.top, kind="stable")
    leader_groups = [np.isin(np.arange(len(by_top)), part) for part in np.array_split(by_top, LEADER_GROUPS)]
    lp, rounds, duals, priced = 0.0, 0, np.zeros(len(heavy)), (0.0, [])
    for rounds in range(1, max_rounds + 1):
        matrix = np.zeros((len(heavy), len(columns)))
        for c, chosen in enumerate(columns):
            np.add.at(matrix[:, c], items.kind[chosen], 1.0)
        costs = [_column_cost(items, chosen, **cost) for chosen in columns]
        result = linprog(costs, A_ub=-matrix, b_ub=-counts.astype(np.float64), bounds=(0, None), method="highs")
        lp, duals = float(result.fun), np.maximum(0.0, -result.ineqlin.marginals)
        priced = least, exact_rows = _price_groups(items, duals, leader_groups, **cost)
        if progress is not None:
            progress(rounds, lp, least, floor + lp / num_ranks)
        if least >= -1e-9:  # the LP is solved: no column prices negative
            break
        found = _candidate_rows(items, duals, **cost)
        new = []
        for chosen in found + exact_rows:
            key = tuple(sorted(chosen))
            reduced = _column_cost(items, list(key), **cost) - float(duals[items.kind[list(key)]].sum())
            if key not in seen and reduced < -1e-9:
                new.append((reduced, list(key)))
        new = [c for _, c in sorted(new)][:COLUMNS_PER_ROUND]
        if not new:
            break
        seen.update(tuple(c) for c in new)
        columns += new
    scale, least = _feasible_scale(items, duals, leader_groups, priced, **cost)
    proved = scale * float(counts @ duals) + float(counts.sum()) * min(0.0, least)
    return EPUnitBound(floor + max(0.0, proved) / num_ranks, floor, lp, least, rounds)
