"""The `optimal` policy: a plan of least predicted step time for a small pool, by a MILP (SciPy's HiGHS).

The measuring stick for `balance` (benchmarks/optimal_gap.py): it shares no planning logic with it.
Its formulation is built here from the cost model's public terms (`CostModel.microbatch_time` of whole
documents and of zigzag ring members, `timing.jitter_lead`, the memory rule `sharding.fits`) and the
StepPlan contract; the plan it picks is then timed by the one timing path (`assemble.assemble_plan`),
which must agree with the solver's objective (a solver's "optimal" is checked, not trusted: scipy
issue #22812).

The plan space, the one every policy's plans for a pool without pipelines or expert parallelism lie in:

- every document is whole on one rank or split over a ring of k >= 2 ranks (k <= its length / 2, so
  zigzag chunks are non-empty) whose fullest member fits the capacity C, with offloading where the
  configuration allows it (`sharding.fits`: Eq. 3's hidden copies and the host memory); a document of
  at most C tokens stays whole (balance's rule; splitting one can shorten a step that one short
  document sets, but left to the solver it made 5-document cases unprovable in a minute);
- a rank runs micro-batch slots 0, 1, ... in order; a slot holds either whole documents of at most C
  tokens together (a whole document longer than C, offloading, alone) or the shards of one ring, at the
  same slot on every member (the ring rule); a slot before a rank's last used one that holds nothing
  is an empty micro-batch, and a rank without documents runs one (the runtime's padding);
- times: a slot of whole documents takes the micro-batch overhead plus each document's whole time (the
  cost model is additive over whole shards); a ring slot starts when its last member is ready and ends
  for all members when the slowest is done (`timing`'s coupling, plus the jitter lead); the step ends
  when the last rank does.

MILP (n documents, D ranks, n slots per rank): binaries w[s,k] (document s on a ring of k; k = 1:
whole), x[s,r,i] (s whole on rank r at slot i), a[s,r,i] (rank r a member of s's ring at slot i),
q[s,i] (s's ring at slot i), u[r,i] (slot i of rank r runs); continuous F[r,i] (when rank r ends slot
i), S[s] (when s's ring starts) and Z (the step). Rows: one ring size per document; a whole document on
one (rank, slot); k members all at the one slot q picks; tokens of a slot <= C u[r,i], a ring member
counting C so that a ring slot holds nothing else; u non-increasing in i with u[r,0] = 1;
F[r,i] >= F[r,i-1] + overhead u[r,i] + whole times; S[s] >= F[r,i-1] and F[r,i] >= S[s] + T(s, k) for
every member (big-M on a[s,r,i]); Z >= F[r,last]. Every choice's true finish times satisfy the rows and
any feasible F is at least them, so min Z is the optimum. Cuts that do not change it: Z >= total busy
time / D and Z >= each rank's busy time; ranks and equal-length documents in one canonical order
(`_break_symmetries`); ring sizes no plan within the upper bound needs left out (`prune_ring_sizes`),
and every time below that bound (the big M: balance's plan or a greedy one, whichever is faster);
Z >= (summed times of the rings wider than D / (p + 1)) / p for p = 1 .. D - 1 (p + 1 such rings need
more than D ranks, so at most p run at once, and two on one rank run in different slots); Z >= the
optimum of a smaller MILP without slots (`optimal_bound.assignment_bound`: each rank's own time and the
rings that block each other, in any order), so that a plan at that bound is proven at once (the issue's
10-document case: unproven in 120 s before, ~2 s with it); and Z >= the least makespan of the rings as
rigid tasks that hold their k ranks at once, beside the whole documents' work spread over the idle time
(`optimal_rigid`), which the slot-free bound does not see (optimal_gap's seed 73: 10% below the best plan
after 600 s without it, 1.5% with it). The solve runs in stages (`optimal_stages`):
first with the slot-free optimum's ring sizes and ranks fixed, then its sizes, then free, so that HiGHS
need not search for a plan at the bound in the free model (the same case under the H100 mesh model:
unproven in 120 s before, ~2.5 s with the stages and the slot-free bound's chain rows). Times are in
milliseconds in the model (`MILLISECONDS`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import numpy as np
from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.timeline.assemble import assemble_plan
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.zigzag import zigzag_num_tokens
from megatron_hdp.plan.cost.sharding import fits, needed_offload_ratio
from megatron_hdp.plan.policies.balance import plan_balance
from megatron_hdp.plan.policies.milp import Milp
from megatron_hdp.plan.policies.optimal_bound import assignment_bound
from megatron_hdp.plan.policies.optimal_rigid import rigid_ring_bound
from megatron_hdp.plan.policies.optimal_stages import solve_in_stages
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.timing import jitter_lead

MAX_DOCUMENTS = 12
"""Most documents `plan_optimal` takes (the MILP grows as documents^2 x ranks)."""
MAX_RANKS = 8
"""Most HDP ranks `plan_optimal` takes."""
INTEGRALITY_TOLERANCE = 1e-5
"""HiGHS takes a binary within 1e-6 of 0 or 1 as integral, which lets a big-M row slip by that much of the
big M (the step time of a simple plan); the solver's objective and its plan's timing agree within ten times that."""
UPPER_MARGIN = 1e-3
"""Relative room above the upper bound (the big M): HiGHS declared a model infeasible whose optimum sat
1e-5 below it (optimal_gap case 11, balance's plan optimal); a solve still infeasible is retried under
the greedy plan's step."""
MILLISECONDS = 1e3
"""The MILP's unit of time per second: HiGHS lets a row slip by 1e-6 in the model's units (its MIP
feasibility tolerance, which SciPy does not expose), 1 ns in milliseconds, a microsecond in seconds."""
BOUND_SHARE = 0.25
"""Share of the time limit the slot-free lower bound (`optimal_bound`) may take; it returns the solver's
dual bound when that runs out."""
BOUND_SLACK = 1e-5
"""Milliseconds the step's row sits below the slot-free bound: HiGHS's feasibility tolerance (1e-6 in the
model's units) must not make a plan at the bound infeasible."""
TIME_LIMIT = 120.0
"""Seconds the solver may take before `plan_optimal` gives up (it returns only proven optima)."""


class UnprovenOptimum(ValueError):
    """`plan_optimal` ran out of time: no proven optimum, but `dual` (seconds), a step no plan of the space
    beats, and `best`, the step of the best plan found (None when none was), which bracket the optimum."""

    def __init__(self, message: str, *, dual: float, best: float | None):
        super().__init__(message)
        self.dual = dual
        self.best = best


@dataclasses.dataclass(frozen=True)
class RingOption:
    """One way to hold a document: on a ring of `size` ranks (1: whole), `time` seconds for the ring's
    slot (overhead included; the slowest member plus the jitter lead), `offload_ratio` to fit."""

    size: int
    time: float
    offload_ratio: float


def ring_options(length: int, *, num_ranks: int, capacity: int, cost_model: CostModel,
                 max_offload_ratio: float) -> list[RingOption]:
    """Every ring size a document of `length` tokens may run on (memory allowing), with its slot time."""
    options = []
    for k in range(1, 2 if length <= capacity else min(num_ranks, max(1, length // 2)) + 1):
        held = [zigzag_num_tokens(length, k, p) if k > 1 else length for p in range(k)]
        if not fits(cost_model, seq_len=length, ring_size=k, num_tokens=max(held), capacity=capacity,
                    max_offload_ratio=max_offload_ratio):
            continue
        ring = tuple(range(k))
        if k == 1:
            time = cost_model.microbatch_time([(length, length, ring)])
        else:  # the kind every member times the call with: decided from ceil(s/k) tokens (StepPlan's rings)
            share = -(-length // k)
            kind = cost_model.ring_kind_for(num_tokens=share, attention=cost_model.a1 * length * share,
                                            ring_size=k, bandwidth=cost_model.ring_link_bandwidth(ring))
            members = [cost_model.microbatch_time([(length, t, ring, kind)]) for t in held]
            time = max(members) + jitter_lead(members, cost_model.jitter)
        options.append(RingOption(k, time, needed_offload_ratio(cost_model, num_tokens=max(held), capacity=capacity)))
    if not options:
        raise ValueError(f"a document of length {length} fits no ring of at most {num_ranks} ranks of capacity "
                         f"{capacity}; raise --capacity or the ranks, or allow offloading")
    return options


def _refuse(lengths: Sequence[int], *, num_ranks: int, cost_model: CostModel, pp_size: int) -> None:
    """ValueError, in one line, for what the exact planner does not plan."""
    if len(lengths) > MAX_DOCUMENTS:
        raise ValueError(f"policy optimal plans at most {MAX_DOCUMENTS} documents, got {len(lengths)}; "
                         "use balance for larger batches")
    if num_ranks > MAX_RANKS:
        raise ValueError(f"policy optimal plans at most {MAX_RANKS} ranks, got {num_ranks}; use balance")
    if pp_size > 1:
        raise ValueError(f"policy optimal plans without pipeline parallelism, got pp_size {pp_size}; use balance")
    if cost_model.expert_parallel_size > 1:
        raise ValueError(f"policy optimal plans without expert parallelism, got expert_parallel_size "
                         f"{cost_model.expert_parallel_size}; use balance")
    per_node = cost_model.ranks_per_node
    if per_node is not None and cost_model.intra_node_bandwidth is not None and per_node < num_ranks:
        raise ValueError(f"policy optimal plans a pool inside one node, got {num_ranks} ranks at {per_node} per "
                         "node; use balance or --ranks-per-node >= --ranks")


def _greedy_step(lengths: Sequence[int], options: list[list[RingOption]], *, num_ranks: int) -> float:
    """The step time of one plan of the module doc's space, an upper bound on the optimum (the MILP's big-M
    and the bound of its times): documents longest first, each whole in its own slot on the rank that
    ends first, or on its smallest ring over the ranks that end first (ready together at the latest)."""
    clock = np.zeros(num_ranks)
    for s in sorted(range(len(lengths)), key=lambda s: -lengths[s]):
        option = options[s][0]
        ranks = np.argsort(clock, kind="stable")[: option.size]
        clock[ranks] = clock[ranks].max() + option.time
    return float(clock.max())


def plan_optimal(
    lengths: list[int],
    *,
    num_ranks: int,
    config: HDPConfig,
    cost_model: CostModel,
    pp_size: int = 1,
    time_limit: float = TIME_LIMIT,
    upper_bound: float | None = None,
) -> StepPlan:
    """The plan of least predicted step time (module doc) of at most `MAX_DOCUMENTS` documents on at most
    `MAX_RANKS` ranks; ValueError above that size, with PP, EP or a pool over several nodes, and
    `UnprovenOptimum` (a ValueError) when the solver proves no optimum within `time_limit` seconds.

    `upper_bound` (seconds): the step time of a plan known to lie in the module doc's space (default: the
    `balance` policy's plan of the batch), used only to cut the search (module doc: big-M, pruned ring
    sizes); a value below the optimum makes that solve infeasible, and the solver runs again under a
    greedy plan's step.
    """
    _refuse(lengths, num_ranks=num_ranks, cost_model=cost_model, pp_size=pp_size)
    capacity = config.hdp_capacity
    options = [ring_options(s, num_ranks=num_ranks, capacity=capacity, cost_model=cost_model,
                            max_offload_ratio=config.max_offload_ratio) for s in lengths]
    overhead = cost_model.microbatch_time([])
    if upper_bound is None:
        upper_bound = plan_balance(list(lengths), num_ranks=num_ranks, config=config,
                                   cost_model=cost_model).est_step_time
    greedy = _greedy_step(lengths, options, num_ranks=num_ranks)
    deadline = time.perf_counter() + time_limit
    for step in sorted({min(upper_bound, greedy), greedy}):
        big = step * (1 + UPPER_MARGIN)
        kept = prune_ring_sizes(options, num_ranks=num_ranks, overhead=overhead, step=big)
        in_ms = [[dataclasses.replace(o, time=o.time * MILLISECONDS) for o in opts] for opts in kept]
        slot_free = assignment_bound(lengths, [{o.size: o.time for o in opts} for opts in in_ms],
                                     num_ranks=num_ranks, capacity=capacity, overhead=overhead * MILLISECONDS,
                                     big=big * MILLISECONDS,
                                     time_limit=BOUND_SHARE * max(0.0, deadline - time.perf_counter()))
        rigid = rigid_ring_bound(lengths, [{o.size: o.time for o in opts} for opts in in_ms], capacity=capacity,
                                 overhead=overhead * MILLISECONDS, num_ranks=num_ranks, upper=big * MILLISECONDS)
        if rigid is not None and slot_free.bound < rigid.bound < big * MILLISECONDS:
            slot_free = rigid  # the rings run together (`optimal_rigid`): a higher bound, and its sizes
        build = functools.partial(_formulation, lengths, in_ms, num_ranks=num_ranks, capacity=capacity,
                                  overhead=overhead * MILLISECONDS)
        staged = solve_in_stages(build, slot_free, big=big * MILLISECONDS, slack=BOUND_SLACK, num_ranks=num_ranks,
                                 time_limit=max(0.0, deadline - time.perf_counter()), margin=UPPER_MARGIN)
        result = staged.result
        if result.status != 2:  # 2: infeasible; under the greedy plan's step it is not, so try that next
            break
    if not staged.proven:
        best = None if result.x is None else float(result.fun) / MILLISECONDS
        found = "" if best is None else f"its best plan takes {best:.4g} s, "
        raise UnprovenOptimum(f"policy optimal found no proven optimum within {time_limit:g} s ({staged.message}): "
                              f"{found}no plan is faster than {staged.dual / MILLISECONDS:.4g} s; use balance, or "
                              "fewer documents or ranks", dual=staged.dual / MILLISECONDS, best=best)
    return _plan(result.x, lengths=lengths, options=kept, **staged.columns, num_ranks=num_ranks,
                 capacity=capacity, cost_model=cost_model, objective=float(result.fun) / MILLISECONDS,
                 tolerance=1e-9 * big + INTEGRALITY_TOLERANCE * big)


def prune_ring_sizes(options: list[list[RingOption]], *, num_ranks: int, overhead: float,
                     step: float) -> list[list[RingOption]]:
    """`options` less the ring sizes no plan of step time <= `step` needs: a ring whose slot alone takes
    longer than `step`; one no faster than a smaller ring of the same document (the smaller ring, on a
    subset of its members at the same slot, starts no later and ends no later; the members left out run
    an empty micro-batch, at most the ring's time); one whose work (size x (time - overhead)) with the
    least work of every other document and one micro-batch overhead per rank exceeds num_ranks x `step`
    (some rank would be busy longer than `step`)."""
    def work(o: RingOption) -> float:
        return o.size * (o.time - overhead)

    least = [min(work(o) for o in opts) for opts in options]
    room = num_ranks * (step - overhead) - sum(least)
    kept = []
    for s, opts in enumerate(options):
        fastest = float("inf")
        mine = []
        for o in sorted(opts, key=lambda o: o.size):
            if o.time <= step and o.time < fastest and work(o) - least[s] <= room:
                mine.append(o)
            fastest = min(fastest, o.time)
        kept.append(mine or [min(opts, key=lambda o: o.time)])  # none fits: the solve proves the bound wrong
    return kept


def _formulation(lengths: Sequence[int], options: list[list[RingOption]], *, num_ranks: int, capacity: int,
                 overhead: float, big: float, symmetric: bool = True) -> tuple[Milp, dict]:
    """The MILP of the module doc for ring options `options`, every time below `big` seconds, with the
    symmetry rows unless `symmetric` is False; returns the model and the columns `_plan` reads (w, x, a,
    q) and the step's (z)."""
    n = slots = len(lengths)
    m = Milp()
    w = [{o.size: m.add(integer=True) for o in opts} for opts in options]
    whole = [1 in w[s] for s in range(n)]
    split = [any(k > 1 for k in w[s]) for s in range(n)]
    x = {(s, r, i): m.add(integer=True) for s in range(n) if whole[s] for r in range(num_ranks) for i in range(slots)}
    a = {(s, r, i): m.add(integer=True) for s in range(n) if split[s] for r in range(num_ranks) for i in range(slots)}
    q = {(s, i): m.add(integer=True) for s in range(n) if split[s] for i in range(slots)}
    u = {(r, i): m.add(integer=True) for r in range(num_ranks) for i in range(slots)}
    f = {(r, i): m.add(integer=False, upper=big) for r in range(num_ranks) for i in range(slots)}
    start = {s: m.add(integer=False, upper=big) for s in range(n) if split[s]}
    z = m.add(integer=False, upper=big)
    m.cost[z] = 1.0
    whole_time = {s: next(o.time for o in options[s] if o.size == 1) - overhead for s in range(n) if whole[s]}
    ring_time = [{w[s][o.size]: o.time for o in options[s] if o.size > 1} for s in range(n)]
    busy: dict[int, float] = {}  # sum over ranks of busy time, as a linear expression
    for s in range(n):
        m.row({w[s][k]: 1.0 for k in w[s]}, 1.0, 1.0)
        if whole[s]:
            m.row({**{x[s, r, i]: 1.0 for r in range(num_ranks) for i in range(slots)}, w[s][1]: -1.0}, 0.0, 0.0)
            busy[w[s][1]] = whole_time[s]
        if split[s]:
            sizes = {w[s][k]: -float(k) for k in w[s] if k > 1}
            m.row({**{a[s, r, i]: 1.0 for r in range(num_ranks) for i in range(slots)}, **sizes}, 0.0, 0.0)
            m.row({**{q[s, i]: 1.0 for i in range(slots)}, **{c: -1.0 for c in sizes}}, 0.0, 0.0)
            for i in range(slots):
                for r in range(num_ranks):
                    m.row({a[s, r, i]: 1.0, q[s, i]: -1.0}, upper=0.0)
            for col, seconds in ring_time[s].items():
                size = next(k for k, c in w[s].items() if c == col)
                busy[col] = size * (seconds - overhead)
    for r in range(num_ranks):
        for i in range(slots):
            tokens = {x[s, r, i]: float(min(lengths[s], capacity)) for s in range(n) if whole[s]}
            tokens.update({a[s, r, i]: float(capacity) for s in range(n) if split[s]})
            m.row({**tokens, u[r, i]: -float(capacity)}, upper=0.0)
            if i + 1 < slots:
                m.row({u[r, i]: 1.0, u[r, i + 1]: -1.0}, lower=0.0)
            step = {f[r, i]: 1.0, u[r, i]: -overhead, **{x[s, r, i]: -whole_time[s] for s in range(n) if whole[s]}}
            if i:
                step[f[r, i - 1]] = -1.0
            m.row(step, lower=0.0)
            for s in range(n):
                if not split[s]:
                    continue
                if i:  # the ring starts when its last member is ready
                    m.row({start[s]: 1.0, f[r, i - 1]: -1.0, a[s, r, i]: -big}, lower=-big)
                ends = {f[r, i]: 1.0, start[s]: -1.0, a[s, r, i]: -big}
                for col, seconds in ring_time[s].items():
                    ends[col] = -seconds
                m.row(ends, lower=-big)
        m.lower[u[r, 0]] = 1.0
        m.row({z: 1.0, f[r, slots - 1]: -1.0}, lower=0.0)
    m.row({z: float(num_ranks), **{col: -t for col, t in busy.items()}, **{c: -overhead for c in u.values()}},
          lower=0.0)
    # each rank's own busy time (member r of s's ring of size k: y[s,k,r]) bounds the step from below
    y = {(s, k, r): m.add(integer=True) for s in range(n) for k in w[s] if k > 1 for r in range(num_ranks)}
    for s in range(n):
        for k in (k for k in w[s] if k > 1):
            m.row({**{y[s, k, r]: 1.0 for r in range(num_ranks)}, w[s][k]: -float(k)}, 0.0, 0.0)
        for r in range(num_ranks) if split[s] else ():
            m.row({**{y[s, k, r]: 1.0 for k in w[s] if k > 1}, **{a[s, r, i]: -1.0 for i in range(slots)}}, 0.0, 0.0)
    for r in range(num_ranks):
        own = {z: 1.0, **{u[r, i]: -overhead for i in range(slots)}}
        own.update({x[s, r, i]: -whole_time[s] for s in range(n) if whole[s] for i in range(slots)})
        for s in range(n):
            for k in (k for k in w[s] if k > 1):
                own[y[s, k, r]] = -(ring_time[s][w[s][k]] - overhead)
        m.row(own, lower=0.0)
    for most in range(1, num_ranks):  # at most `most` rings wider than num_ranks / (most + 1) run at once
        wide = {w[s][k]: -ring_time[s][w[s][k]] for s in range(n) for k in w[s] if k * (most + 1) > num_ranks}
        if wide:
            m.row({z: float(most), **wide}, lower=0.0)
    if symmetric:
        _break_symmetries(m, lengths, w=w, x=x, a=a, q=q, num_ranks=num_ranks)
    return m, {"w": w, "x": x, "a": a, "q": q, "z": z}


def _break_symmetries(m: Milp, lengths: Sequence[int], *, w, x, a, q, num_ranks: int) -> None:
    """Rows that keep one plan of each class of equivalent ones (module doc: neither changes the optimum).

    Ranks are interchangeable (one node, no topology): with documents taken longest first, rank r + 1
    holds no document earlier than every one rank r holds (g[r, j]: rank r holds one of the first j + 1;
    an empty rank comes last). Documents of one length are interchangeable: the earlier one (by index)
    has the smaller (ring size, slot) pair, read as size x (slots + 1) + slot. Any plan becomes one that
    meets both by first renumbering equal documents, then sorting ranks (which keeps sizes and slots).
    """
    n = slots = len(lengths)
    order = sorted(range(n), key=lambda s: -lengths[s])
    def holds(s: int, r: int) -> dict[int, float]:
        return {v: 1.0 for v in ([x[s, r, i] for i in range(slots) if (s, r, i) in x]
                                  + [a[s, r, i] for i in range(slots) if (s, r, i) in a])}
    g = {(r, j): m.add(integer=True) for r in range(num_ranks) for j in range(n)}
    for r in range(num_ranks):
        for j, s in enumerate(order):
            m.row({g[r, j]: 1.0, **{v: -1.0 for v in holds(s, r)}}, lower=0.0)
            previous = {g[r, j - 1]: -1.0} if j else {}
            if j:
                m.row({g[r, j]: 1.0, g[r, j - 1]: -1.0}, lower=0.0)
            m.row({g[r, j]: 1.0, **previous, **{v: -1.0 for v in holds(s, r)}}, upper=0.0)
            if r:
                m.row({g[r - 1, j]: 1.0, g[r, j]: -1.0}, lower=0.0)
    for earlier, later in zip(order, order[1:]):
        if lengths[earlier] != lengths[later]:
            continue
        def key(s: int, sign: float) -> dict[int, float]:
            terms = {w[s][k]: sign * k * (slots + 1) for k in w[s]}
            terms.update({x[s, r, i]: sign * i for r in range(num_ranks) for i in range(slots) if (s, r, i) in x})
            terms.update({q[s, i]: sign * i for i in range(slots) if (s, i) in q})
            return terms
        first, second = sorted((earlier, later))
        m.row({**key(first, 1.0), **key(second, -1.0)}, upper=0.0)


def _plan(values: np.ndarray, *, lengths: list[int], options: list[list[RingOption]], w, x, a, q, z, num_ranks: int,
          capacity: int, cost_model: CostModel, objective: float, tolerance: float) -> StepPlan:
    """The StepPlan of the solver's choice, timed by `assemble_plan`; its predicted step time must equal
    the solver's objective within `tolerance` seconds (a solver answer that breaks a row would show here).
    Empty slots after a rank's last ring slot are dropped: they pad no ring, and the solver leaves them
    where they cost nothing on the critical path (the issue's case had up to 10 micro-batches a rank);
    without them that rank's later slots only start earlier and no ring waits for it, so the step holds."""
    on = lambda col: values[col] > 0.5  # noqa: E731
    slots = len(lengths)
    schedule: list[list[list[int]]] = [[[] for _ in range(slots)] for _ in range(num_ranks)]
    rings, ratios = [], []
    for s, opts in enumerate(options):
        chosen = next(o for o in opts if on(w[s][o.size]))
        ratios.append(chosen.offload_ratio)
        if chosen.size == 1:
            (r, i), = [(r, i) for r in range(num_ranks) for i in range(slots) if on(x[s, r, i])]
            members = (r,)
        else:
            i, = [i for i in range(slots) if on(q[s, i])]
            members = tuple(r for r in range(num_ranks) if on(a[s, r, i]))
            assert len(members) == chosen.size, (s, members, chosen)
        rings.append(members)
        for r in members:
            schedule[r][i].append(s)
    for r in range(num_ranks):  # empty slots after a rank's last ring slot align nothing: they do not run
        last_ring = max((i for i, held in enumerate(schedule[r]) if any(len(rings[s]) > 1 for s in held)), default=-1)
        schedule[r] = schedule[r][:last_ring + 1] + [held for held in schedule[r][last_ring + 1:] if held]
    plan = assemble_plan(policy="optimal", lengths=lengths, rings=rings, offload_ratios=ratios, schedule=schedule,
                         capacity=capacity, cost_model=cost_model)
    if abs(plan.est_step_time - objective) > tolerance:
        raise RuntimeError(f"the solver's optimum {objective!r} s disagrees with its plan's timing "
                           f"{plan.est_step_time!r} s: a MILP row is wrong or the solver broke one")
    return plan
