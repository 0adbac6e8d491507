"""Per-rank timeline of one training step: a StepPlan run under the cost model.

What is modelled, per HDP rank r (a pipeline of `pp_size` stages, each holding num_layers / pp layers):

- A micro-batch's time on one stage follows the cost model: g per layer, linear work + attention per
  shard, ring traffic hidden under attention and only the excess exposed. Shards of one micro-batch on
  the *same* ring (static CP packs many documents on one CP ring) share one ring exchange per step, as a
  THD ring-attention call over all of them does: traffic and message latency are those of their summed
  tokens, overlapped with their summed attention; each split document adds its per-block kernel
  overhead (`ring_block_overhead`), not hidden; a latent ring (multi-latent attention) prices its own
  bytes and adds its up-projection to the attention it overlaps, by the plan's `ring_kind` of each ring:
  `CostModel.microbatch_time`, on arrays
  (test_plan_sim_agreement checks they agree). One pass per micro-batch (Megatron's hybrid CP runs one pass per sub-sample, see
  `POLICY_RULES`).
- Offload: a shard of a sequence with offload ratio r copies r * Act(t) per layer to the host and back.
  Following the cost model's overlap rule (ByteScale Eq. 3 with its windows,
  `CostModel.exposed_offload_time`), the D2H copy overlaps one layer's forward and the H2D prefetch one
  layer's backward; what exceeds either window is exposed.
- Ring coupling (`plan.timeline.timing.plan_groups`, the planner's rule): the members of a ring run ring attention
  layer by layer together, so a micro-batch that shares a ring with other ranks starts when all of them
  are ready, and releases them together when the slowest is done (its busy part is its own work; the
  rest is idle). Coupling is transitive: ranks linked through several rings at the same micro-batch
  index move as one group.
- Padding: after its own micro-batches a rank runs the runtime's empty ones (with virtual pipeline
  stages where the interleaved schedule and the ring rule need them, with EP up to its group's largest
  count; an idle rank one), each at the micro-batch overhead (`plan.timeline.timing`).
- Expert parallelism (`CostModel.expert_parallel_size`): micro-batch i of every member of an EP group is
  coupled like a ring (the MoE all-to-all of every layer), `plan.timeline.timing.expert_links`, and each member
  runs the group's mean of the routed expert work at that index, and the all-to-all's own transfers
  (`plan.cost.experts.spread_expert_work`).
- PP: every stage runs its ops in Megatron's order (`plan.timeline.interleaved.stage_order`: 1F1B with a warm-up
  of p-1-s forwards, or with `plan.vpp_size` v > 1 virtual stages the interleaved order, each op one
  model chunk's forward or backward at 1/v of the stage's time), forward = 1/3 and backward = 2/3 of the
  micro-batch time (backward does twice the forward's FLOPs and ring traffic); a forward waits for the
  previous virtual stage's forward, a backward for the next one's (`plan.timeline.interleaved.dependency`). PP
  bubbles and the stalls of unequal micro-batches come out of these dependencies. A ring couples its
  members' op of every (stage, chunk, forward/backward) of its micro-batch.
- Gradient all-reduce: once every rank is done, a ring all-reduce of the bf16 gradients of one
  (stage, TP rank) over the HDP pool: 2 (n-1)/n * bytes / bandwidth.

The event loop works on whole queues of ops (no clock): an op runs when the op before it on its stage
and its pipeline dependency are released; a coupled group runs when all its members have arrived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.timeline.interleaved import dependency, stage_order
from megatron_hdp.plan.cost.model import FORWARD_SHARE
from megatron_hdp.plan.step_plan import MicroBatch, StepPlan
from megatron_hdp.plan.timeline.timing import jitter_lead, plan_groups, plan_runtime_counts


@dataclass(frozen=True)
class PolicyRules:
    """How a policy's plans execute beyond what StepPlan says."""

    barrier_per_microbatch: bool = False
    """All ranks wait for each other after every micro-batch index (Megatron's per-group barrier)."""
    pass_per_shard: bool = False
    """Each shard is its own forward/backward pass (Megatron's hybrid CP runs one pass per sub-sample)."""


POLICY_RULES: dict[str, PolicyRules] = {
    # hybrid_cp_schedule.hybrid_context_parallel_forward_backward: one forward_step per sub-sample and a
    # torch.distributed.barrier over DP x CP after each group; our adapter maps group j -> index j.
    "megatron-hybrid-cp": PolicyRules(barrier_per_microbatch=True, pass_per_shard=True),
}


@dataclass(frozen=True)
class Op:
    """One forward ('F'), backward ('B') of a micro-batch (of one model chunk, with virtual stages) on one
    stage, as it ran."""

    kind: str
    microbatch: int
    start: float
    busy_end: float
    """Start plus this rank's own work (compute + comm + offload)."""
    comm: float
    """Seconds of exposed ring traffic inside the busy part."""
    offload: float
    """Seconds of exposed offload copies inside the busy part."""
    release: float
    """When the rank may go on: the slowest member of its coupled group is done."""
    ring: bool = False
    """Whether the micro-batch holds a shard of a split sequence (ring attention)."""
    chunk: int = 0
    """The model chunk (virtual stage) of the stage it ran, 0 without virtual stages."""
    bubble: float = 0.0
    """Seconds the stage waited before the op for its pipeline neighbour (the previous virtual stage's
    forward, the next one's backward) after its previous op was released: the PP bubble."""


@dataclass(frozen=True)
class StepTimeline:
    """The simulated step: per-rank totals (numpy arrays over HDP ranks) and the ops of every stage."""

    policy: str
    num_ranks: int
    pp_size: int
    num_tokens: int
    compute: np.ndarray
    """Seconds of compute (linear + attention + launch overhead) per rank and stage."""
    comm: np.ndarray
    """Seconds of ring traffic not hidden under attention, per rank and stage."""
    offload: np.ndarray
    """Seconds of offload copies not hidden under compute, per rank and stage."""
    finish: np.ndarray
    """When each rank's last stage op is released (the rank reaches the gradient all-reduce)."""
    allreduce_time: float
    attention_bytes: float
    """Ring-attention bytes sent per step by all ranks of one (stage, TP rank) coordinate."""
    bubble: np.ndarray
    """Seconds per rank (mean over its stages) spent waiting for pipeline neighbours (`Op.bubble`)."""
    ops: tuple[tuple[tuple[Op, ...], ...], ...] = field(repr=False)
    """ops[rank][stage]: the ops of that stage in execution order."""

    @property
    def busy(self) -> np.ndarray:
        return self.compute + self.comm + self.offload

    @property
    def compute_end(self) -> float:
        return float(self.finish.max()) if self.num_ranks else 0.0

    @property
    def step_time(self) -> float:
        return self.compute_end + self.allreduce_time

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.step_time if self.step_time > 0 else 0.0

    @property
    def balance(self) -> float:
        """max / mean of the per-rank busy time (1.0 is perfect balance)."""
        mean = float(self.busy.mean())
        return float(self.busy.max()) / mean if mean > 0 else 1.0

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-stage time before the all-reduce spent in PP bubbles (part of `idle_fraction`)."""
        total = self.compute_end * self.num_ranks
        return float(self.bubble.sum()) / total if total > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        """Share of rank-stage time before the all-reduce spent waiting (rings, bubbles, imbalance)."""
        total = self.compute_end * self.num_ranks
        return 1.0 - float(self.busy.sum()) / total if total > 0 else 0.0


def allreduce_time(*, grad_bytes: float, num_ranks: int, bandwidth: float) -> float:
    """Ring all-reduce of `grad_bytes` over `num_ranks`: 2 (n-1)/n * bytes / bandwidth."""
    if num_ranks <= 1 or grad_bytes <= 0:
        return 0.0
    return 2.0 * (num_ranks - 1) / num_ranks * grad_bytes / bandwidth


@dataclass(frozen=True)
class _Shards:
    """Every shard of a plan as flat arrays, micro-batches numbered globally rank after rank."""

    microbatch: np.ndarray
    length: np.ndarray
    tokens: np.ndarray
    ring: np.ndarray
    """Id of the shard's ring (shards of one ring share an id)."""
    ring_size: np.ndarray
    latent: np.ndarray
    """Whether the shard's sequence runs a latent ring (`SequencePlacement.ring_kind`)."""
    offload_ratio: np.ndarray
    first_microbatch: np.ndarray
    """first_microbatch[r]: global number of rank r's micro-batch 0; one more entry for the end."""
    rings: tuple[tuple[int, ...], ...]
    """The ranks of ring id i."""

    @classmethod
    def of(cls, plan: StepPlan) -> "_Shards":
        mbs = [mb for schedule in plan.ranks for mb in schedule.microbatches]
        counts = np.cumsum([0] + [len(schedule.microbatches) for schedule in plan.ranks])
        # the simulator's only per-shard Python loops: flat lists, then numpy
        shard_list = [shard for mb in mbs for shard in mb.shards]
        microbatch = np.repeat(np.arange(len(mbs)), [len(mb.shards) for mb in mbs])
        seq = np.array([shard.seq for shard in shard_list], dtype=np.int64)
        chunk_counts = [len(shard.chunks) for shard in shard_list]
        widths = np.array([end - start for shard in shard_list for start, end in shard.chunks], dtype=np.float64)
        starts = np.cumsum([0] + chunk_counts[:-1])
        tokens = np.add.reduceat(widths, starts) if len(widths) else np.zeros(len(shard_list))
        rings: dict[tuple[int, ...], int] = {}
        ring_of_seq = np.array([rings.setdefault(s.ring, len(rings)) for s in plan.sequences], dtype=np.int64)
        return cls(
            microbatch=microbatch.astype(np.int64),
            length=np.array(plan.lengths, dtype=np.float64)[seq],
            tokens=tokens,
            ring=ring_of_seq[seq],
            ring_size=np.array([len(s.ring) for s in plan.sequences], dtype=np.int64)[seq],
            latent=np.array([s.ring_kind == "latent" for s in plan.sequences], dtype=bool)[seq],
            offload_ratio=np.array([s.offload_ratio for s in plan.sequences], dtype=np.float64)[seq],
            first_microbatch=np.array(counts, dtype=np.int64),
            rings=tuple(rings),
        )


def _per_ring_size(values: np.ndarray, sizes: np.ndarray, function) -> np.ndarray:
    """function(values[sizes == k], k) for each ring size k > 1 (the cost model takes a scalar ring size)."""
    out = np.zeros_like(values)
    for k in np.unique(sizes[sizes > 1]):
        chosen = sizes == k
        out[chosen] = function(values[chosen], int(k))
    return out


def _microbatch_costs(plan: StepPlan, cost: CostModel, rules: PolicyRules, shards: _Shards) -> np.ndarray:
    """[micro-batches, 5]: compute, exposed comm, exposed offload, ring bytes and forward/backward passes
    of each micro-batch on one stage, from the cost model's own formulas evaluated on arrays of shards."""
    num_mbs = int(shards.first_microbatch[-1])
    layers = cost.num_layers / plan.pp_size
    out = np.zeros((num_mbs, 5))
    out[:, 4] = 1.0
    # a micro-batch without shards still runs one (empty) forward and backward: the runtime's overhead g
    out[:, 0] = np.where(np.bincount(shards.microbatch, minlength=num_mbs) == 0, cost.g * layers, 0.0)
    if not len(shards.tokens):
        return out
    # a pass is one forward/backward: the whole micro-batch, or (hybrid CP) each shard alone
    passes = np.arange(len(shards.tokens)) if rules.pass_per_shard else shards.microbatch
    _, first_shard, pass_of_shard = np.unique(passes, return_index=True, return_inverse=True)
    mb_of_pass = shards.microbatch[first_shard]
    num_passes = len(mb_of_pass)
    out[:, 4] = np.maximum(1, np.bincount(mb_of_pass, minlength=num_mbs))
    compute = cost.layer_compute_time(seq_len=shards.length, num_tokens=shards.tokens)
    attention = compute - cost.layer_compute_time(seq_len=0, num_tokens=shards.tokens)
    # shards of one pass on one ring share one exchange: summed tokens against summed attention
    group_keys = np.unique(pass_of_shard * len(shards.rings) + shards.ring, return_inverse=True)[1]
    group_attention = np.bincount(group_keys, weights=attention)
    group_tokens = np.bincount(group_keys, weights=shards.tokens)
    group_size = np.zeros(len(group_tokens), dtype=np.int64)
    group_size[group_keys] = shards.ring_size
    group_pass = np.zeros(len(group_tokens), dtype=np.int64)
    group_pass[group_keys] = pass_of_shard
    group_ring = np.zeros(len(group_tokens), dtype=np.int64)
    group_ring[group_keys] = shards.ring
    group_latent = np.zeros(len(group_tokens), dtype=bool)
    group_latent[group_keys] = shards.latent
    bandwidth = np.array([cost.ring_link_bandwidth(ring) for ring in shards.rings])[group_ring]

    def per_ring_group(function) -> np.ndarray:
        """function(ids, k, kind) for the ring groups `ids` of each ring size k > 1 and each ring kind."""
        out = np.zeros(len(group_tokens))
        for kind, chosen in (("kv", ~group_latent), ("latent", group_latent)):
            for k in np.unique(group_size[chosen & (group_size > 1)]):
                ids = np.flatnonzero(chosen & (group_size == k))
                out[ids] = function(ids, int(k), kind)
        return out

    traffic = per_ring_group(lambda ids, k, kind: cost.layer_ring_comm_time(
        num_tokens=group_tokens[ids], ring_size=k, bandwidth=bandwidth[ids], kind=kind))
    # the latent ring's up-projection: work of the member, beside its attention under the traffic
    up = per_ring_group(lambda ids, k, kind: cost.layer_up_projection_time(
        num_tokens=group_tokens[ids], ring_size=k, kind=kind))
    exposed = np.maximum(0.0, traffic - group_attention - up)
    # per-block kernel overhead of split documents: work of the rank itself, not hidden by the exchange
    blocks = _per_ring_size(np.bincount(group_keys).astype(np.float64), group_size,
                            lambda n, k: n * cost.layer_ring_block_time(num_documents=1, ring_size=k))
    layer_compute = cost.g + np.bincount(pass_of_shard, weights=compute, minlength=num_passes)
    layer_compute += np.bincount(group_pass, weights=blocks + up, minlength=num_passes)
    layer_comm = np.bincount(group_pass, weights=exposed, minlength=num_passes)
    copy = np.bincount(pass_of_shard, weights=shards.offload_ratio * cost.activation_bytes(shards.tokens),
                       minlength=num_passes)
    layer_offload = cost.exposed_offload_time(copy, layer_compute + layer_comm)
    for column, per_pass in enumerate((layer_compute, layer_comm, layer_offload)):
        out[:, column] += np.bincount(mb_of_pass, weights=per_pass * layers, minlength=num_mbs)
    ring_bytes = np.zeros(len(shards.tokens))
    for kind, chosen in (("kv", ~shards.latent), ("latent", shards.latent)):
        ring_bytes[chosen] = _per_ring_size(
            shards.tokens[chosen], shards.ring_size[chosen],
            lambda t, k: cost.ring_bytes(num_tokens=t, ring_size=k, pp_size=plan.pp_size, kind=kind))
    out[:, 3] = np.bincount(shards.microbatch, weights=ring_bytes, minlength=num_mbs)
    return out


def simulate_step(
    plan: StepPlan,
    cost_model: CostModel,
    *,
    grad_bytes: float = 0.0,
    allreduce_bandwidth: float = math.inf,
    rules: PolicyRules | None = None,
) -> StepTimeline:
    """Simulate one step of `plan` (see the module docstring for what is modelled).

    `grad_bytes` is the gradient size one (stage, TP rank) all-reduces over the HDP pool (`megatron-hdp
    simulate` passes the model's parameters / (TP * PP) * 2 bytes, bf16). `rules` default to how the
    policy's own framework runs its plans (`POLICY_RULES`: Megatron's hybrid CP with its barriers and one
    pass per sub-sample); pass `PolicyRules()` to predict our HDP runtime, which runs every plan alike.
    """
    if allreduce_bandwidth <= 0:
        raise ValueError(f"allreduce_bandwidth must be > 0, got {allreduce_bandwidth}")
    if rules is None:
        rules = POLICY_RULES.get(plan.policy, PolicyRules())
    n, p, v = plan.num_ranks, plan.pp_size, plan.vpp_size
    shards = _Shards.of(plan)
    if shards.latent.any() and not cost_model.latent_bytes_per_token:
        raise ValueError("the plan runs latent rings but the cost model has no latent (latent_bytes_per_token = 0): "
                         "simulate it with the multi-latent attention model's cost model")
    mb_costs = _microbatch_costs(plan, cost_model, rules, shards)
    bounds = shards.first_microbatch
    costs = [mb_costs[bounds[r]:bounds[r + 1]].tolist() for r in range(n)]  # [rank][index] -> 5 numbers
    with_ring = np.bincount(shards.microbatch, weights=shards.ring_size > 1, minlength=len(mb_costs)) > 0
    has_ring = [with_ring[bounds[r]:bounds[r + 1]].tolist() for r in range(n)]
    # the runtime's padding micro-batches (empty, at the micro-batch overhead) after each rank's own
    padding = cost_model.microbatch_time([], pp_size=p)
    extra = np.array(plan_runtime_counts(plan, ep_size=cost_model.expert_parallel_size)) - [len(c) for c in costs]
    for r in range(n):
        costs[r] += [[padding, 0.0, 0.0, 0.0, 1.0]] * int(extra[r])
        has_ring[r] += [False] * int(extra[r])
    alltoall = cost_model.expert_alltoall_seconds_per_token(pp_size=p)
    spreads = cost_model.expert_parallel_size > 1 and (cost_model.expert_share > 0 or alltoall > 0)
    if spreads:  # tokens per micro-batch, the padding ones holding none
        held = np.bincount(shards.microbatch, weights=shards.tokens, minlength=len(mb_costs))
        tokens = [held[bounds[r]:bounds[r + 1]].tolist() + [0.0] * int(extra[r]) for r in range(n)]
        spread = cost_model.expert_coupled_times([[c[0] for c in mine] for mine in costs], tokens, pp_size=p)
        costs = [[[seconds, *c[1:]] for c, seconds in zip(mine, compute)] for mine, compute in zip(costs, spread)]
    coupled = plan_groups(plan, barrier_per_microbatch=rules.barrier_per_microbatch,
                          ep_size=cost_model.expert_parallel_size)
    members: dict[int, list[int]] = {}
    for (rank, _), gid in coupled.items():
        members.setdefault(gid, []).append(rank)

    orders = [[stage_order(len(costs[r]), pp_size=p, stage=s, vpp_size=v, group_size=plan.group_size)
               for s in range(p)] for r in range(n)]
    ops: list[list[list[Op]]] = [[[] for _ in range(p)] for _ in range(n)]
    released: dict[tuple[int, int, tuple[str, int, int]], float] = {}  # (rank, stage, op) -> release time
    arrived: dict[tuple[int, int, str, int], dict[int, float]] = {}  # (gid, stage, kind, chunk) -> rank -> ready

    def op_parts(rank: int, kind: str, index: int) -> tuple[float, float, float]:
        """(compute, comm, offload) seconds of one op: its share of the micro-batch's costs (one chunk's)."""
        share = (FORWARD_SHARE if kind == "F" else 1.0 - FORWARD_SHARE) / v
        return tuple(part * share for part in costs[rank][index][:3])

    bubble: dict[tuple[int, int], float] = {}  # (rank, stage) -> its head op's wait for its pipeline neighbour

    def ready_time(rank: int, stage: int) -> float | None:
        """When the head op of (rank, stage) may start, or None while a dependency is pending."""
        op = orders[rank][stage][len(ops[rank][stage])]
        previous = ops[rank][stage][-1].release if ops[rank][stage] else 0.0
        dep = dependency(op, stage=stage, pp_size=p, vpp_size=v)
        bubble[(rank, stage)] = 0.0
        if dep is not None:
            if (rank, *dep) not in released:
                return None
            bubble[(rank, stage)] = max(0.0, released[(rank, *dep)] - previous)
            previous += bubble[(rank, stage)]
        return previous

    def run(group: dict[int, float], stage: int, op: tuple[str, int, int]) -> list[tuple[int, int]]:
        kind, chunk, index = op
        start = max(group.values())
        parts = {rank: op_parts(rank, kind, index) for rank in group}
        durations = [sum(part) for part in parts.values()]
        passes = [costs[rank][index][4] for rank in group]
        release = start + max(durations) + jitter_lead(durations, cost_model.jitter, passes)
        for rank, (compute, comm, offload) in parts.items():
            busy_end = start + compute + comm + offload
            ops[rank][stage].append(Op(kind=kind, microbatch=index, start=start, busy_end=busy_end, comm=comm,
                                       offload=offload, release=release, ring=has_ring[rank][index], chunk=chunk,
                                       bubble=bubble[(rank, stage)]))
            released[(rank, stage, op)] = release
        # the ops that may wait for this one: the same stage, its neighbours, and (virtual stages) the
        # other end of the pipeline
        return [(rank, s) for rank in group for s in {stage - 1, stage, stage + 1, 0, p - 1} if 0 <= s < p]

    pending = [(r, s) for r in range(n) for s in range(p)]
    while pending:
        rank, stage = pending.pop()
        if len(ops[rank][stage]) == len(orders[rank][stage]):
            continue
        ready = ready_time(rank, stage)
        if ready is None:
            continue
        op = orders[rank][stage][len(ops[rank][stage])]
        gid = coupled.get((rank, op[2]))
        if gid is None:
            pending += run({rank: ready}, stage, op)
            continue
        group = arrived.setdefault((gid, stage, op[0], op[1]), {})
        group[rank] = ready
        if len(group) == len(members[gid]):
            pending += run(group, stage, op)

    # Ring members share one micro-batch index and the runtime's counts keep the ring rule
    # (`plan.timeline.interleaved`), so coupled ops never wait on each other in a cycle.
    stuck = [(r, s) for r in range(n) for s in range(p) if len(ops[r][s]) < len(orders[r][s])]
    assert not stuck, f"simulation stalled at rank-stages {stuck[:4]}: the plan breaks the ring rule"
    rank_of_mb = np.repeat(np.arange(n), np.diff(bounds))
    totals = np.stack([np.bincount(rank_of_mb, weights=mb_costs[:, i], minlength=n) for i in range(4)], axis=1)
    if spreads:  # the spread moves compute between the members of a group; padding included
        totals[:, 0] = [sum(c[0] for c in mine) for mine in costs]
    else:
        totals[:, 0] += padding * extra
    finish = np.array([max((o.release for stage in ops[r] for o in stage), default=0.0) for r in range(n)])
    return StepTimeline(
        policy=plan.policy,
        num_ranks=n,
        pp_size=p,
        num_tokens=plan.num_tokens,
        compute=totals[:, 0],
        comm=totals[:, 1],
        offload=totals[:, 2],
        finish=finish,
        allreduce_time=allreduce_time(grad_bytes=grad_bytes, num_ranks=n, bandwidth=allreduce_bandwidth),
        attention_bytes=float(totals[:, 3].sum()),
        bubble=np.array([sum(o.bubble for stage in ops[r] for o in stage) / p for r in range(n)]),
        ops=tuple(tuple(tuple(stage) for stage in rank_ops) for rank_ops in ops),
    )
