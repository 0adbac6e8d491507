"""Train the tiny Llama-style GPT with HDP on gloo CPU ranks, policy against policy: the demo and the bench.

Every rank runs `train_policies` (through `megatron_hdp.comm.launch.run_gloo`): it initializes HDP,
fits the cost model of *this* model on *this* machine, then builds one model per policy from the same seed
and trains the same global batches, planned by `make_plan`, the policies taking turns step by step (in a
random order every round). Rows of statistics come back from rank 0.
Synthetic documents follow ByteScale's long-tailed "byted" mix, scaled down (`length_scale`) and clipped to
`max_length` so that a CPU can train them.

Times mean "a cluster where each rank has a core of its own", which a host with fewer cores than ranks can
only measure indirectly: a rank blocked in a gloo wait uses no CPU (checked: a 2 s wait costs < 5 ms of
process time), so each rank's *process CPU time* of each phase of a step is what that phase takes on a
dedicated core, and `megatron_hdp.sim.replay.dedicated_step_time` adds the waits the plan implies (ring
members run a ring micro-batch together; the all-reduce waits for the last rank). The cost model is
fitted in the same currency, on the runtime's own micro-batches (`fit_cost_model`: T(s) per layer from
whole documents, ring costs from ring micro-batches, each timed as a step's second micro-batch, the
jitter from the lead of ring micro-batches' slowest members), the gradient all-reduce from CPU seconds
of an all-reduce of the gradient buffer. The prediction of each step is `simulate_step(plan, cost_model,
rules=PolicyRules())` — our runtime runs balance's, static's and naive's plans with one pass per
micro-batch and no barrier between micro-batches — or, for `megatron-hybrid-cp`, which runs as Megatron
runs it (one pass per sub-sample, a barrier per group; its replay adds those barriers), Megatron's rules
(`POLICY_RULES`) on its grouped plan — plus the measured per-step work the
simulator does not model (plan check, collation, optimizer step).
The fit is timed once, before the steps, but a shared host's CPU seconds per unit of work change over a
run (other processes' load, contention, frequency): a fit timed under other conditions than the steps
mis-predicts every policy alike (the run-wide drift of issue 24). So a probe — one whole document of C
tokens per rank, timed like the fit — runs before and after the fit (their median: the fit's
conditions) and before and after each round of steps (their mean: the round's), and each step's
prediction is scaled by probe now / probe at the fit (`measure_speed_probe`); an
out-of-sample prediction divides by the probe of the run that fitted its model. Rows keep the unscaled
prediction too. A second probe times ring work (`measure_ring_probe`: the fit's block-overhead row), which
a change of the host's load slows by another factor than compute (gloo threads, kernel calls): the fit's
ring coefficients are scaled by how much more than the speed probe it moved (`_predicted_time`).
Wall time is reported too; it measures the total work of all ranks on the shared cores.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

import megatron_hdp.megatron  # noqa: F401  (registers megatron-hybrid-cp, which HYBRID_CP plans with)
from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel

logger = logging.getLogger(__name__)

HYBRID_CP = "megatron-hybrid-cp"
"""Megatron's Hybrid-CP as Megatron executes it: its scheduler's plan run one forward/backward pass per
sub-sample (<= C tokens per rank per pass), a barrier over all ranks after each group
(`megatron.comparison.per_subsample.per_subsample_plan`)."""
HYBRID_CP_GROUPED = "megatron-hybrid-cp-grouped"
"""Ours, not Megatron's: Megatron's grouping run through our runtime as one micro-batch per group and rank
(up to several times C tokens per pass, no barrier): the planner policy `megatron-hybrid-cp` as is."""


EP_UNAWARE = "balance-ep-unaware"
"""Ours, for comparison: `balance` planning every rank as if it ran alone (its cost model without expert
parallelism), run on the EP mesh, where the runtime pads each EP group to its largest count and the
group waits at every index for its slowest member. `balance` itself plans EP groups as units."""


def planner_policy(policy: str) -> str:
    """The `make_plan` policy behind a policy name of this module (`HYBRID_CP_GROUPED` is `HYBRID_CP`'s,
    `EP_UNAWARE` is `balance`)."""
    return {HYBRID_CP_GROUPED: HYBRID_CP, EP_UNAWARE: "balance"}.get(policy, policy)


def policy_cost_model(policy: str, cost_model: CostModel, *, ep_size: int) -> CostModel:
    """The cost model `policy` plans with on a mesh whose EP groups span `ep_size` HDP ranks: with them
    (what the runtime runs and the prediction times), or without for `EP_UNAWARE`."""
    return dataclasses.replace(cost_model, expert_parallel_size=1 if policy == EP_UNAWARE else ep_size)


@dataclass(frozen=True)
class CpuRunSpec:
    """What to train, on how many ranks, under which policies."""

    policies: tuple[str, ...] = ("balance", "static")
    steps: int = 3
    capacity: int = 512
    """Tokens per rank per micro-batch (C); longer documents need rings."""
    tokens_per_step: int = 8192
    mix: str = "byted"
    length_scale: int = 32
    """Synthetic lengths are divided by this (ByteScale's mix reaches 2M tokens)."""
    max_length: int = 2048
    seed: int = 0
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    fit_lengths: tuple[int, ...] = (64, 256, 512, 1024, 2048)
    """Document lengths timed to fit the cost model."""
    fit_repeats: int = 3
    warmup_steps: int = 1
    """Untimed steps per policy before the reported ones (first-call overheads)."""
    timing_repeats: int = 1
    """Runs of each reported step on its batch (the optimizer steps each time). Each phase of each rank
    keeps its fewest CPU seconds over the runs, as the cost-model fit does, so that other processes on the
    host inflate neither; loss and the other statistics are the first run's."""
    num_experts: int = 0
    """MoE experts per layer (a tiny Mixtral-style model, top-`moe_router_topk` routing); 0: dense MLPs."""
    moe_router_topk: int = 2
    ep_size: int = 1
    """Expert-parallel size: each rank holds num_experts / ep_size experts of every MoE layer, and the
    ranks of an EP group run every micro-batch together (the all-to-all)."""
    data_prefix: Optional[str] = None
    """A Megatron indexed dataset (PREFIX.bin/.idx, token ids < the model's vocabulary) to train from
    through the HDP loader: global batches of `tokens_per_step` tokens, documents cut at `max_length`.
    None: synthetic batches of the length mix above."""

    def __post_init__(self) -> None:
        if min(self.steps, self.capacity, self.tokens_per_step, self.length_scale, self.timing_repeats, self.ep_size) < 1:
            raise ValueError(f"steps, capacity, tokens_per_step, length_scale, timing_repeats, ep_size must be >= 1: {self}")
        if self.ep_size > 1 and (not self.num_experts or self.num_experts % self.ep_size):
            raise ValueError(f"ep_size {self.ep_size} needs num_experts, a multiple of it; got {self.num_experts}")


@dataclass
class StepRow:
    """One step of one policy, as the demo prints it and the bench stores it."""

    policy: str
    step: int
    loss: float
    step_time: float
    """Seconds a cluster with one core per rank would take (measured busy time + the plan's waits)."""
    wall_time: float
    """Wall seconds of the step on this host (ranks share its cores: the total work, not the slowest)."""
    max_busy_time: float
    """CPU seconds of the busiest rank (a lower bound of `step_time`: no waits)."""
    predicted_time: float
    """The simulator's step time for this plan and the fitted cost model (our runtime's rules), plus the
    measured per-step work it does not model (`measure_step_overhead`: plan check, collation, optimizer).
    With a cost model given from outside the run (e.g. fitted by another run on another mix and seed),
    that model and that run's all-reduce bandwidth and step overhead: an out-of-sample prediction."""
    predicted_time_in_run_fit: float
    """The same prediction with this run's own fit and measurements (in-sample)."""
    speed_factor: float
    """Probe seconds over this step's round / probe seconds at the fit that predicts it (this run's, or
    the earlier run's for an out-of-sample prediction): `predicted_time` is scaled by it."""
    speed_factor_in_run: float
    """The same for this run's own fit (`predicted_time_in_run_fit` is scaled by it)."""
    planner_time: float
    """The planner's own estimate (`plan.est_step_time`)."""
    balance: float
    num_rings: int
    ring_sizes: dict = field(default_factory=dict)
    attention_bytes: int = 0
    num_microbatches: list = field(default_factory=list)
    num_sequences: int = 0
    num_tokens: int = 0
    per_rank: dict = field(default_factory=dict)
    """Per HDP rank: measured CPU seconds of micro-batches ("compute"), of the phases before and after
    them, and the simulator's busy seconds ("predicted_compute"): where a prediction error comes from."""
    predicted_time_without_alltoall: Optional[float] = None
    """`predicted_time` with the predicting fit's twin that folds the MoE all-to-all into b1 and
    expert_share, as the fit did before issue 41 (`fit_cost_model`): what the all-to-all term changes
    (`predicted_time` itself where the fit has no such term: dense or EP 1). None when the predicting fit
    came without its twin (a file written before issue 41)."""


def global_batches(spec: CpuRunSpec) -> list[list[int]]:
    """Lengths of each step's global batch (the same for every policy)."""
    from megatron_hdp.plan.lengths import sample_global_batch

    batches = []
    for step in range(spec.warmup_steps + spec.steps):
        raw = sample_global_batch(spec.mix, num_tokens=spec.tokens_per_step * spec.length_scale, seed=spec.seed + step)
        batches.append([int(min(spec.max_length, max(1, -(-n // spec.length_scale)))) for n in raw])
    return batches


def planned_batches(spec: CpuRunSpec, state, config: HDPConfig, cost_model: CostModel, policy: str):
    """(plan, read_tokens) of each step: read from `spec.data_prefix` by the HDP loader (each rank only its
    shards), else the synthetic `global_batches`. The same batches for every policy (same seed)."""
    from megatron_hdp.plan.planner import make_plan

    if spec.data_prefix is None:
        from megatron_hdp.harness.exactness import token_reader

        for step, lengths in enumerate(global_batches(spec)):
            plan = make_plan(lengths, num_ranks=state.hdp_size, config=config, cost_model=cost_model,
                             policy=planner_policy(policy))
            yield plan, token_reader(spec.seed + step, plan.lengths)  # rl-static-cp plans padded sequences
        return
    from megatron_hdp.data.loader import HDPDataLoader
    from megatron_hdp.megatron.datasets.sources import IndexedDocumentSource

    loader_config = dataclasses.replace(
        config, hdp_policy=planner_policy(policy), hdp_global_batch_tokens=spec.tokens_per_step, hdp_overlong_documents="truncate"
    )
    # prefetch=0: plan and read before each step, outside its timing, as the synthetic path does (the
    # demo's ranks already use every core); check_plans=False: HDPTrainer.step checks the plan digests.
    with HDPDataLoader(IndexedDocumentSource(spec.data_prefix), rank=state.hdp_rank, num_ranks=state.hdp_size,
                       config=loader_config, cost_model=cost_model, seed=spec.seed, max_length=spec.max_length,
                       prefetch=0, check_plans=False) as loader:
        for _ in range(spec.warmup_steps + spec.steps):
            step = next(loader)
            yield step.plan, step.read_tokens


def _model_config(spec: CpuRunSpec):
    from megatron_hdp.harness.model import tiny_llama_config

    return tiny_llama_config(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_moe_experts=spec.num_experts or None,
        moe_router_topk=spec.moe_router_topk,
    )


def _build(spec: CpuRunSpec, state):
    from megatron_hdp.harness.exactness import VOCAB_SIZE
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer

    torch.manual_seed(spec.seed)
    model = build_gpt(_model_config(spec), vocab_size=VOCAB_SIZE, max_sequence_length=spec.max_length)
    ddp, optimizer = wrap_for_training(model)
    return HDPTrainer(model=ddp, optimizer=optimizer, state=state)


LEAD_TOKENS = 16
"""Tokens of the whole document each rank runs as micro-batch 0 of a timed hand plan, before the one timed
(`_microbatch_seconds`): a step's first micro-batch costs more than the others (on this CPU 0.7-1.2 ms
at 16-64 tokens, 8-11 ms in all; within the noise at 256-1,024 tokens), which g, read mostly from the
fit's shortest rows, charged to every micro-batch of a step; that excess is a per-step cost
(`measure_step_overhead`)."""


def _microbatch_seconds(trainer, lengths: list[int], rings: list[tuple[int, ...]], *, capacity: int,
                        repeats: int) -> float:
    """Fewest CPU seconds (forward + backward) of this rank's micro-batch of the hand plan (`lengths` on
    `rings`) over `repeats` HDP steps, after one untimed step: the runtime's own path (collation,
    Megatron's schedule, DDP hooks), as the measured steps take it. The plan runs as micro-batch 1,
    after a `LEAD_TOKENS` document per rank: what every micro-batch but a step's first costs."""
    return _interleaved_microbatch_seconds(trainer, [(lengths, rings, capacity)], repeats)[0]


def _interleaved_microbatch_seconds(trainer, cases: list[tuple[list[int], list[tuple[int, ...]], int]],
                                    repeats: int) -> list[float]:
    """`_microbatch_seconds` of several hand plans ((lengths, rings, capacity) each), timed in turns: one
    untimed step of each, then `repeats` rounds that run every plan once. A slowdown of the host then
    touches every plan alike instead of whichever was timed during it, so differences between the plans
    (what a fit reads its slopes from) keep their size."""
    from megatron_hdp.harness.exactness import token_reader
    from megatron_hdp.plan.hand_plan import plan_from_rings

    world = trainer.state.hdp_size
    plans = [plan_from_rings([LEAD_TOKENS] * world + list(lengths), [(r,) for r in range(world)] + list(rings),
                             [0] * world + [1] * len(lengths), num_ranks=world, capacity=max(capacity, LEAD_TOKENS))
             for lengths, rings, capacity in cases]
    fewest = [float("inf")] * len(plans)
    for repeat in range(repeats + 1):
        for i, plan in enumerate(plans):
            trainer.step(plan, token_reader(0, plan.lengths))
            if repeat:
                run = trainer.last_busy  # a rank outside every ring of the plan runs micro-batch 0 only
                fewest[i] = min(fewest[i], run.forward[1] + run.backward[1] if len(run.forward) > 1 else 0.0)
    return fewest


def _timed_runs(trainer, plan, repeats: int) -> list:
    """BusyTimes of `repeats` HDP steps of the hand plan `plan` (tokens from `token_reader`), after one
    untimed step."""
    from megatron_hdp.harness.exactness import token_reader

    runs = []
    for repeat in range(repeats + 1):
        trainer.step(plan, token_reader(0, plan.lengths))
        if repeat:
            runs.append(trainer.last_busy)
    return runs


def _over_ranks(value: float, ranks: Optional[list[int]] = None) -> np.ndarray:
    """`value` of every rank (of `ranks`, default all), in rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return np.array([gathered[r] for r in (ranks if ranks is not None else range(len(gathered)))], dtype=np.float64)


def _median_over_ranks(value: float, ranks: Optional[list[int]] = None) -> float:
    return float(np.median(_over_ranks(value, ranks)))


def _ring_link(num_bytes: int = 1 << 20, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s, latency s) of one gloo exchange, ranks 0 and 1 alone (the others blocked in a barrier use
    no CPU): wall seconds, as on a dedicated link."""
    rank = dist.get_rank()
    results = []
    for size in (4, num_bytes):
        send = torch.zeros(size // 4, dtype=torch.float32)
        recv = torch.empty_like(send)
        best = float("inf")
        for _ in range(repeats):
            if rank < 2:
                start = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, 1 - rank), dist.P2POp(dist.irecv, recv, 1 - rank)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                best = min(best, time.perf_counter() - start)
        dist.barrier()
        results.append(best)
    times = torch.tensor(results, dtype=torch.float64)
    dist.broadcast(times, src=0)
    latency, big = times.tolist()
    return num_bytes / max(big - latency, 1e-9), latency


def grad_buffer_bytes(trainer) -> int:
    """Bytes of the gradients the step all-reduces (Megatron DDP's buffers)."""
    return sum(p.numel() * p.main_grad.element_size() for p in trainer.model.parameters() if p.requires_grad)


def measure_allreduce_bandwidth(num_bytes: int, *, repeats: int = 5) -> float:
    """Bytes/s that `sim.simulator.allreduce_time` needs to give the measured all-reduce of `num_bytes`:
    2 (n-1)/n * bytes / (the busiest rank's fewest CPU seconds of one gloo all-reduce)."""
    world = dist.get_world_size()
    buffer = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.process_time()
        dist.all_reduce(buffer)
        best = min(best, time.process_time() - start)
    seconds = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return 2.0 * (world - 1) / world * num_bytes / max(float(seconds), 1e-9)


def measure_step_overhead(trainer, *, grad_bytes: int, allreduce_bandwidth: float, repeats: int = 3) -> float:
    """CPU seconds of a step outside its micro-batches' own work and its gradient all-reduce — plan check,
    collation, optimizer step, and what a step's first micro-batch costs more than the others
    (`LEAD_TOKENS`) — which `simulate_step` does not model: fewest over `repeats` steps of two
    micro-batches of one short whole document per rank, median over ranks, less the all-reduce the
    simulator charges."""
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.sim.simulator import allreduce_time

    world = trainer.state.hdp_size
    plan = plan_from_rings([LEAD_TOKENS] * 2 * world, [(r,) for r in range(world)] * 2, [0] * world + [1] * world,
                           num_ranks=world, capacity=LEAD_TOKENS)
    fastest = _fastest(_timed_runs(trainer, plan, repeats))
    first_excess = fastest.forward[0] + fastest.backward[0] - fastest.forward[1] - fastest.backward[1]
    best = fastest.before + fastest.after + first_excess
    charged = allreduce_time(grad_bytes=grad_bytes, num_ranks=world, bandwidth=allreduce_bandwidth)
    return max(0.0, _median_over_ranks(best) - charged)


def measure_speed_probe(trainer, spec: CpuRunSpec, *, repeats: int = 3) -> float:
    """CPU seconds of one whole document of C tokens per rank (median over ranks, fewest over `repeats`
    runs, as the fit and the steps keep their fewest): the median of the probes before the fit, after it
    and after the measurements that follow it is the fit's conditions, the mean of those before and after
    a round of steps the round's; their ratio is how much slower the host runs the same work (module doc)."""
    world = trainer.state.hdp_size
    mine = _microbatch_seconds(trainer, [spec.capacity] * world, [(r,) for r in range(world)],
                               capacity=spec.capacity, repeats=repeats)
    return _median_over_ranks(mine)


RING_PROBE_DOCUMENTS = 8
"""Documents per ring micro-batch of the block-overhead row of `fit_cost_model` and of the ring probe."""


def _ring_sizes(world: int) -> list[int]:
    """The ring sizes the fit and the ring probe time: 2, 4, 8, as far as `world` ranks hold them."""
    return [k for k in (2, 4, 8) if k <= world]


def _median_over_ring_members(trainer, seconds: float, k: int) -> float:
    """Median of `seconds` over the ranks that rings of `k` tiling the ranks (`_ring_case`) cover."""
    members = list(range(trainer.state.hdp_size - trainer.state.hdp_size % k))
    return _median_over_ranks(seconds if trainer.state.hdp_rank in members else 0.0, members)


def _ring_case(world: int, k: int, num_documents: int, tokens: int) -> tuple[list[int], list[tuple[int, ...]], int]:
    """A hand plan's (lengths, rings, capacity): rings of `k` tiling the ranks, each carrying `num_documents`
    documents of k `tokens` / n tokens, so every member holds `tokens`."""
    rings = [tuple(range(i, i + k)) for i in range(0, world - k + 1, k)]
    lengths = [k * tokens // num_documents] * (num_documents * len(rings))
    return lengths, [ring for ring in rings for _ in range(num_documents)], tokens + num_documents


def measure_ring_probe(trainer, spec: CpuRunSpec, *, repeats: int = 3) -> Optional[float]:
    """CPU seconds of one ring micro-batch, `RING_PROBE_DOCUMENTS` documents on the widest ring (median over its members,
    fewest over `repeats`): `measure_speed_probe`'s twin for ring work. A ring's cost on this host is
    mostly software per message and per block (gloo threads, kernel calls), which a change of load slows
    by another factor than a whole document's compute: the ratio of the two probes between the fit and a
    round rescales the fit's ring coefficients (`_predicted_time`). None with fewer than 2 ranks."""
    world = trainer.state.hdp_size
    if world < 2:
        return None
    k = _ring_sizes(world)[-1]
    lengths, rings, capacity = _ring_case(world, k, RING_PROBE_DOCUMENTS, spec.capacity)
    return _median_over_ring_members(trainer, _microbatch_seconds(trainer, lengths, rings, capacity=capacity,
                                                                  repeats=repeats), k)


def measure_probes(trainer, spec: CpuRunSpec) -> dict:
    """{"speed_probe": whole-document probe, "ring_probe": ring probe} of the host now (module doc)."""
    return {"speed_probe": measure_speed_probe(trainer, spec), "ring_probe": measure_ring_probe(trainer, spec)}


def measure_jitter(trainer, spec: CpuRunSpec, *, microbatches_per_size: int = 2) -> float:
    """`CostModel.jitter`, measured where the simulator charges it: `timing.jitter_lead` adds jitter x mean
    x E[max of k normals] to every coupled phase, and on a CPU run the coupled phases are ring
    micro-batches. Every rank runs `microbatches_per_size` ring micro-batches of each ring size of the fit
    (rings tiling the ranks, one document of k C tokens each), `spec.timing_repeats` times after an untimed
    step, each phase keeping its fewest CPU seconds as the steps do, and the jitter is fitted to the lead
    of each ring's slowest member in each phase (`plan.cost.fit.fit_jitter`).

    Before issue 24's fix the jitter was the median rank-to-rank standard deviation of whole documents,
    which are never coupled: rings' slowest members lead their mean by more than a normal spread of that
    deviation gives (CPU, rings of 8: 10-16 % of the mean against 1.42 x 6-8 %), and static, coupled in
    every phase, was predicted 0.02 s short in every pair."""
    from megatron_hdp.plan.cost.fit import fit_jitter
    from megatron_hdp.plan.hand_plan import plan_from_rings

    world = trainer.state.hdp_size
    sizes = [k for k in _ring_sizes(world) for _ in range(microbatches_per_size)]
    if not sizes:
        return 0.0
    lengths, rings, slots = [], [], []
    for index, k in enumerate(sizes):
        ring_lengths, ring_of_each, capacity = _ring_case(world, k, 1, spec.capacity)  # one document per ring
        lengths += ring_lengths
        rings += ring_of_each
        slots += [index] * len(ring_lengths)
    plan = plan_from_rings(lengths, rings, slots, num_ranks=world, capacity=capacity)
    fastest = _fastest(_timed_runs(trainer, plan, spec.timing_repeats))
    coupled = []
    for phase in (fastest.forward, fastest.backward):
        for index in range(len(sizes)):
            seconds = _over_ranks(phase[index] if index < len(phase) else 0.0)
            coupled += [seconds[list(ring)] for ring, slot in zip(rings, slots) if slot == index]
    return fit_jitter(coupled)


EXPERT_SHARE_DOCUMENT = 256
"""Tokens of each document the lead member of an EP group holds in `measure_expert_share_slopes` (short,
so that attention is a small known part of its work)."""
EXPERT_SHARE_DOCUMENTS = (2, 8)
"""Documents the lead member holds in `measure_expert_share_slopes`'s two cases."""
ALLTOALL_TOKENS = (64, 256, 1024)
"""Tokens per member of the all-to-alls `measure_alltoall` times (a micro-batch holds up to C tokens)."""


def routed_bytes_per_token(spec: CpuRunSpec) -> float:
    """`CostModel.expert_alltoall_bytes_per_token` of the tiny model: its fp32 hidden state times the routed
    copies per token of its shape (`ModelShape.routed_copies_per_token`; TP 1; 0 for a dense model)."""
    from megatron_hdp.harness.exactness import VOCAB_SIZE
    from megatron_hdp.plan.cost.presets import ModelShape

    shape = ModelShape(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                       num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
                       ffn_hidden_size=spec.ffn_hidden_size, vocab_size=VOCAB_SIZE, num_experts=spec.num_experts,
                       moe_router_topk=spec.moe_router_topk)
    return 4.0 * spec.hidden_size * shape.routed_copies_per_token()


def measure_alltoall(trainer, spec: CpuRunSpec) -> tuple[Optional[float], float]:
    """(bytes/s, seconds per call) of the MoE all-to-all on this EP mesh, in the fit's currency (CPU
    seconds): every member of each EP group sends t tokens' routed copies (`routed_bytes_per_token` x t)
    split evenly over its group, as balance's matched lanes run it, with what Megatron's alltoall dispatcher
    calls (`all_to_all_single` on the group), alone. Each t of `ALLTOALL_TOKENS` is timed in turns over
    2 x `spec.fit_repeats` rounds, fewest CPU seconds, median over ranks, and `plan.cost.fit.fit_alltoall_rate`
    fits the crossing bytes ((e - 1) / e of them) and a per-call latency. The latency is not a term of the
    cost model: four calls per layer and micro-batch are a constant in g, which the whole-document rows
    measure with them."""
    from megatron_hdp.plan.cost.fit import fit_alltoall_rate

    state, e = trainer.state, spec.ep_size
    mine = None
    for first in range(0, state.hdp_size, e):  # every rank creates every group, in the same order
        group = dist.new_group([state.hdp_global_ranks[r] for r in range(first, first + e)])
        mine = group if first <= state.hdp_rank < first + e else mine
    values = int(routed_bytes_per_token(spec) // 4)
    fewest = [float("inf")] * len(ALLTOALL_TOKENS)
    for repeat in range(2 * spec.fit_repeats + 1):
        for i, tokens in enumerate(ALLTOALL_TOKENS):
            send = torch.ones(tokens * values, dtype=torch.float32)
            received = torch.empty_like(send)
            dist.barrier(group=mine)
            start = time.process_time()
            dist.all_to_all_single(received, send, group=mine)
            if repeat:  # the first round is untimed (first calls)
                fewest[i] = min(fewest[i], time.process_time() - start)
    seconds = [_median_over_ranks(t) for t in fewest]
    crossing = [(e - 1) / e * tokens * values * 4 for tokens in ALLTOALL_TOKENS]
    return fit_alltoall_rate(crossing, seconds)


def measure_expert_share_slopes(trainer, spec: CpuRunSpec, *, a1: float) -> list[tuple[float, float]]:
    """Per EP group, (dv, dlinear) of `expert_share`'s fit: in each EP group of e ranks the first member
    holds n documents of D = `EXPERT_SHARE_DOCUMENT` tokens (s = n D) and the others none, so they run
    the runtime's padding micro-batch and, through the all-to-all, the expert work of the tokens routed to
    them. Per layer and token of s between the two sizes (timed in turns): dv, the others' mean slope, and
    dlinear, the group's total slope less the lead's attention a1 D. `expert_share` reads x from them."""
    world, e = trainer.state.hdp_size, spec.ep_size
    leads = list(range(0, world, e))
    cases = []
    for n in EXPERT_SHARE_DOCUMENTS:
        lengths = [EXPERT_SHARE_DOCUMENT] * (n * len(leads))
        cases.append((lengths, [(lead,) for lead in leads for _ in range(n)], n * EXPERT_SHARE_DOCUMENT))
    seconds = [_over_ranks(mine) / spec.num_layers
               for mine in _interleaved_microbatch_seconds(trainer, cases, 2 * spec.fit_repeats)]
    ds = (EXPERT_SHARE_DOCUMENTS[1] - EXPERT_SHARE_DOCUMENTS[0]) * EXPERT_SHARE_DOCUMENT
    slopes = []
    for lead in leads:
        others = [seconds[i][lead + 1:lead + e].mean() for i in range(2)]
        totals = [seconds[i][lead:lead + e].sum() for i in range(2)]
        slopes.append(((others[1] - others[0]) / ds, (totals[1] - totals[0]) / ds - a1 * EXPERT_SHARE_DOCUMENT))
    return slopes


def expert_share(slopes: list[tuple[float, float]], *, ep_size: int, alltoall: float = 0.0) -> float:
    """`CostModel.expert_share` x from `measure_expert_share_slopes`, under the cost model's rules: per
    layer the others' mean is v(s) = g + x b1 s / e + A s and the group's total e g + a1 D s + b1 s + e A s
    (every member waits A per token of the fullest member for the all-to-all,
    `CostModel.expert_alltoall_seconds_per_token` per layer), so x = e (dv - A) / (dlinear - e A). With
    A = 0 the all-to-all is folded into x (as before issue 41). Clipped to [0, 1]; median over the groups."""
    e = ep_size
    shares = [e * (dv - alltoall) / (dlinear - e * alltoall) if dlinear - e * alltoall > 0 else 0.0
              for dv, dlinear in slopes]
    return float(np.clip(np.median(shares), 0.0, 1.0))


def fit_cost_model(trainer, spec: CpuRunSpec) -> tuple[CostModel, CostModel]:
    """The cost model of this model on this CPU, in CPU seconds of the runtime's own micro-batches (median
    over ranks, which run them at once), and its twin without the all-to-all term (below):

    - per layer T(s) = a1 s^2 + b1 s + g: `plan.cost.fit.fit_compute` (non-negative least squares, relative
      error) over whole documents of `spec.fit_lengths`, one per rank;
    - `jitter` from `measure_jitter`;
    - with expert parallelism, the all-to-all's rate from `measure_alltoall` (`expert_alltoall_bandwidth`,
      `expert_alltoall_bytes_per_token` from `routed_bytes_per_token`): A per token per layer, which the
      whole-document rows (every member holding s tokens) measured inside b1, so b1 - A is the model's
      b1; `expert_share` from `measure_expert_share_slopes` with A charged (`expert_share`). The twin
      folds the all-to-all into b1 and x as the fit did before issue 41 (bytes 0): what the benchmark
      compares the term against on the same steps;
    - ring link: bandwidth from `_ring_link`; the rest from ring micro-batches, each member holding C
      tokens, timed in turns (`_interleaved_microbatch_seconds`, 2 x `spec.fit_repeats` rounds):
      `ring_block_overhead` from n = 8 documents of k C / n tokens against one of k C on the widest ring
      k (the extra 2 (k-1) (n-1) kernel calls; ring transfers are the same), then `ring_latency` from one
      document of k C on rings of k = 2, 4, 8: the per-message cost that makes the simulator's exposed
      ring time (3k-2 messages, hidden under attention) match the measured excess over T, median over k.
      On a CPU both are mostly software cost per ring step (message posting, one kernel call per block,
      the merge), which is why they are fitted, not taken from the ping-pong. The block overhead is a
      difference of two timings; timed one after the other (as before issue 24's fix), a change of the
      host's speed between them moved it 20x from run to run.
    """
    from megatron_hdp.plan.cost.fit import fit_compute, fitted_cost_model

    world = trainer.state.hdp_size
    alone = [(r,) for r in range(world)]
    measured = np.array([
        _median_over_ranks(_microbatch_seconds(trainer, [s] * world, alone, capacity=s, repeats=spec.fit_repeats))
        for s in spec.fit_lengths
    ])
    a1, b1, g = fit_compute(spec.fit_lengths, measured / spec.num_layers)
    bandwidth, link_latency = _ring_link()
    kv_channels = spec.hidden_size // spec.num_attention_heads * spec.num_query_groups
    kv_bytes = 4 * 2 * kv_channels
    tokens = spec.capacity
    ring_sizes = _ring_sizes(world)
    rows = [(k, 1) for k in ring_sizes] + ([(ring_sizes[-1], RING_PROBE_DOCUMENTS)] if ring_sizes else [])
    mine = _interleaved_microbatch_seconds(trainer, [_ring_case(world, k, n, tokens) for k, n in rows],
                                           2 * spec.fit_repeats)
    per_layer = {(k, n): _median_over_ring_members(trainer, seconds, k) / spec.num_layers
                 for (k, n), seconds in zip(rows, mine)}
    block_overhead = 0.0
    if ring_sizes:
        k, n = rows[-1]
        block_overhead = max(0.0, (per_layer[k, n] - per_layer[k, 1]) / (2 * (k - 1) * (n - 1)))
    latencies = []
    for k in ring_sizes:
        attention = a1 * k * tokens * tokens
        exposed = per_layer[k, 1] - (g + b1 * tokens + attention + 2 * (k - 1) * block_overhead)
        # fp32: each of the 3k-2 messages (CostModel.ring_messages) carries one member's K/V or dK/dV
        latencies.append((exposed + attention) / CostModel.ring_messages(k) - kv_bytes * tokens / bandwidth)
    latency = max(float(np.median(latencies)), link_latency) if latencies else link_latency
    folded = fitted_cost_model(
        (a1, b1, g), (4 * (6 * spec.hidden_size + 2 * kv_channels + 4 * spec.ffn_hidden_size), 0.0),
        kv_bytes_per_token=float(kv_bytes), activation_dtype_bytes=4, num_layers=spec.num_layers,
        ring_bandwidth=float(bandwidth), ring_latency=latency, ring_block_overhead=block_overhead,
        jitter=measure_jitter(trainer, spec), expert_parallel_size=spec.ep_size,
    )
    if spec.ep_size == 1:
        return folded, folded
    rate, _ = measure_alltoall(trainer, spec)
    slopes = measure_expert_share_slopes(trainer, spec, a1=a1)
    folded = dataclasses.replace(folded, expert_share=expert_share(slopes, ep_size=spec.ep_size))
    if rate is None:  # no time per byte: nothing to charge
        return folded, folded
    model = dataclasses.replace(folded, expert_alltoall_bytes_per_token=routed_bytes_per_token(spec),
                                expert_alltoall_bandwidth=rate)
    alltoall = model.expert_alltoall_seconds_per_token() / spec.num_layers
    model = dataclasses.replace(model, b1=max(0.0, b1 - alltoall),
                                expert_share=expert_share(slopes, ep_size=spec.ep_size, alltoall=alltoall))
    return model, folded


def silence_megatron_warnings() -> None:
    """Ignore the warnings Megatron-Core raises from its own modules on a CPU gloo run (missing Transformer
    Engine / Apex / NVTX, deprecations); warnings from our code and from torch still show."""
    warnings.filterwarnings("ignore", module=r"megatron\.core(\.|$)")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _predicted_time(policy: str, plan, model: CostModel, *, grad_bytes: int, allreduce_bandwidth: float,
                    step_overhead: float, speed_probe: float, ring_probe: Optional[float], now: dict):
    """The simulator's timeline of `plan` (our runtime's rules for every plan it runs as planned; Megatron's
    for the one it runs per sub-sample), the predicted step time (+ the per-step work it does not model)
    scaled by the speed factor now["speed_probe"] / `speed_probe` (module doc), and that factor. The fit's
    ring coefficients are first scaled by how much more (or less) the ring probe moved than the speed
    probe since the fit (none without a ring probe on both sides)."""
    from megatron_hdp.sim.simulator import POLICY_RULES, PolicyRules, simulate_step

    speed = now["speed_probe"] / speed_probe
    if ring_probe and now.get("ring_probe"):
        ring = now["ring_probe"] / ring_probe / speed
        model = dataclasses.replace(model, ring_latency=model.ring_latency * ring,
                                    ring_block_overhead=model.ring_block_overhead * ring)
    rules = POLICY_RULES[HYBRID_CP] if policy == HYBRID_CP else PolicyRules()
    timeline = simulate_step(plan, model, grad_bytes=grad_bytes, allreduce_bandwidth=allreduce_bandwidth,
                             rules=rules)
    return timeline, (timeline.step_time + step_overhead) * speed, speed


def _measured_row(policy: str, step: int, plan, stats, busy_by_rank, grad_bytes: int, predict: dict,
                  in_run: dict, now: dict, run_plan=None, barriers=(), ep_size: int = 1) -> StepRow:
    """`plan` is the policy's plan; `run_plan` what ran (default: `plan`), with group `barriers`. Empty
    micro-batches of a `run_plan` are slots Megatron does not run: their measured times count as zero.
    `predict` and `in_run`: {"model", "allreduce_bandwidth", "step_overhead", "speed_probe", "ring_probe",
    "model_without_alltoall" (`fit_cost_model`'s twin, or None)} to predict with (the same dict unless a
    cost model came from outside the run); `now`: the probes of this step's round (`measure_probes`)."""
    from megatron_hdp.sim.replay import dedicated_step_time

    run_plan = run_plan or plan
    if run_plan is not plan:
        busy_by_rank = [
            dataclasses.replace(b, **{
                phase: tuple(0.0 if i < len(mbs) and not mbs[i].shards else t for i, t in enumerate(getattr(b, phase)))
                for phase in ("forward", "backward")
            })
            for b, mbs in zip(busy_by_rank, (r.microbatches for r in run_plan.ranks))
        ]
    dedicated = dedicated_step_time(
        run_plan,
        before=[b.before for b in busy_by_rank],
        forward=[b.forward for b in busy_by_rank],
        backward=[b.backward for b in busy_by_rank],
        after=[b.after for b in busy_by_rank],
        barriers_after=barriers,
        ep_size=ep_size,
    )
    busy = [b.before + sum(b.forward) + sum(b.backward) + b.after for b in busy_by_rank]
    twin = predict.get("model_without_alltoall")
    predict, in_run = ({k: v for k, v in timing.items() if k != "model_without_alltoall"}
                       for timing in (predict, in_run))
    timeline, predicted, speed = _predicted_time(policy, plan, grad_bytes=grad_bytes, now=now, **predict)
    _, predicted_in_run, speed_in_run = _predicted_time(policy, plan, grad_bytes=grad_bytes, now=now, **in_run)
    without_alltoall = None if twin is None else _predicted_time(policy, plan, grad_bytes=grad_bytes, now=now,
                                                                 **{**predict, "model": twin})[1]
    compute = [sum(b.forward) + sum(b.backward) for b in busy_by_rank]
    per_rank = {
        "compute": compute, "before": [b.before for b in busy_by_rank], "after": [b.after for b in busy_by_rank],
        "predicted_compute": (timeline.busy * speed).tolist(),
    }
    return StepRow(
        policy=policy, step=step, loss=stats.loss, step_time=dedicated, wall_time=stats.step_time,
        max_busy_time=max(busy), predicted_time=predicted, predicted_time_in_run_fit=predicted_in_run,
        speed_factor=speed, speed_factor_in_run=speed_in_run,
        planner_time=plan.est_step_time,
        balance=max(compute) / statistics.mean(compute), num_rings=stats.num_rings,
        ring_sizes=plan.summary().ring_sizes, attention_bytes=stats.attention_bytes,
        num_microbatches=stats.num_microbatches, num_sequences=len(plan.lengths), num_tokens=sum(plan.lengths),
        per_rank=per_rank, predicted_time_without_alltoall=without_alltoall,
    )


def _fastest(runs: list) -> "BusyTimes":
    """Each phase's fewest CPU seconds over `runs` (BusyTimes of the same plan)."""
    from megatron_hdp.megatron.core_api.step import BusyTimes

    return BusyTimes(
        before=min(r.before for r in runs),
        forward=tuple(map(min, zip(*(r.forward for r in runs)))),
        backward=tuple(map(min, zip(*(r.backward for r in runs)))),
        after=min(r.after for r in runs),
    )


def train_policies(rank: int, world_size: int, spec: CpuRunSpec, cost_model: Optional[dict] = None,
                   measured: Optional[dict] = None) -> dict:
    """Per rank: fit the cost model, then train `spec.steps` steps under each policy, the policies taking
    turns step by step.

    `cost_model` (a CostModel dict), when given, plans and predicts instead of the fit, with the
    "allreduce_bandwidth" and "step_overhead" of `measured` where given (another run's; its
    "cost_model_without_alltoall", the twin of `fit_cost_model`, predicts `predicted_time_without_alltoall`):
    predictions out of sample; every row also carries the in-run fit's prediction. Returns {"planned_with":
    timing, "in_run_fit": timing, "grad_bytes": int, "rows": [StepRow as dict]} (rows filled on rank 0 only),
    a timing being {"cost_model": dict, "allreduce_bandwidth": float, "step_overhead": float, "speed_probe":
    float, "ring_probe", "cost_model_without_alltoall": dict or None}: what planned
    and predicted, and what this run measured (the same when nothing came from outside).
    """
    silence_megatron_warnings()
    from megatron_hdp.megatron.comparison.per_subsample import per_subsample_plan
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp

    state = initialize_hdp(seed=spec.seed, expert_model_parallel_size=spec.ep_size)
    config = HDPConfig(hdp=True, hdp_capacity=spec.capacity, hdp_offload=False)
    first = _build(spec, state)
    probes = [measure_probes(first, spec)]  # around the fit, so that their medians are the fit's conditions
    fitted, folded = fit_cost_model(first, spec)
    probes.append(measure_probes(first, spec))
    # the mesh's EP groups, coupled as the runtime couples them
    fitted, folded = map(first.planning_cost_model, (fitted, folded))
    model = first.planning_cost_model(CostModel.from_dict(cost_model)) if cost_model else fitted
    twin = (measured or {}).get("cost_model_without_alltoall") if cost_model else folded.to_dict()
    grad_bytes = grad_buffer_bytes(first)
    allreduce_bandwidth = measure_allreduce_bandwidth(grad_bytes)
    step_overhead = measure_step_overhead(first, grad_bytes=grad_bytes, allreduce_bandwidth=allreduce_bandwidth)
    probes.append(measure_probes(first, spec))
    in_run = {"model": fitted, "allreduce_bandwidth": allreduce_bandwidth, "step_overhead": step_overhead,
              "model_without_alltoall": folded,
              **{key: _median_or_none([p[key] for p in probes]) for key in probes[0]}}
    predict = {**in_run, "model": model, **{k: v for k, v in (measured or {}).items() if k in in_run},
               "model_without_alltoall": first.planning_cost_model(CostModel.from_dict(twin)) if twin else None}
    if measured and "ring_probe" not in measured:
        predict["ring_probe"] = None  # another run's fit without its ring probe: no ring rescaling
    rows = []
    # The policies take turns step by step (each its own model, built from the same seed), so that a
    # change of load on a shared host between the start and the end of the run weighs on every policy alike.
    # A step's timing repeats take turns too (A B A B, not A A B B): the host's speed drifts over seconds (two
    # policies running the same plan one after the other measured 0.88-1.17x apart), and each policy's fewest
    # CPU seconds then come from the same stretch of time as the others'. Each round runs the policies in a
    # fresh random order: a fixed cyclic order, even rotated, always runs each policy after the same one
    # (balance after static); identical plans then measured 0.97x (EP 4, 10 steps) and 1.04x (EP 2, 5 steps)
    # apart in the median, and no order should be a policy's alone.
    trainers = [_build(spec, state) for _ in spec.policies]
    batches = [planned_batches(spec, state, config, policy_cost_model(policy, model, ep_size=state.ep_size), policy)
               for policy in spec.policies]
    order = random.Random(spec.seed)
    for step, planned in enumerate(zip(*batches)):
        probe_before = measure_probes(first, spec)  # the host's speed over this round (module doc)
        turns = list(zip(spec.policies, trainers, planned))
        executed = {policy: per_subsample_plan(plan) if policy == HYBRID_CP else (plan, ())
                    for policy, _, (plan, _) in turns}  # (what runs, its group barriers)
        runs, stats = {policy: [] for policy in executed}, {}
        for _ in range(spec.timing_repeats if step >= spec.warmup_steps else 1):
            order.shuffle(turns)  # the same on every rank: one generator, seeded alike
            for policy, trainer, (_, read_tokens) in turns:
                done = trainer.step(executed[policy][0], read_tokens)
                runs[policy].append(trainer.last_busy)
                fastest = min(done.step_time, stats[policy].step_time) if policy in stats else done.step_time
                stats[policy] = dataclasses.replace(stats.get(policy, done), step_time=fastest)  # the first run's loss
        measured_round = []
        for policy, _, (plan, _) in turns:
            busy_by_rank = [None] * world_size
            dist.all_gather_object(busy_by_rank, _fastest(runs[policy]))
            measured_round.append((policy, plan, stats[policy], busy_by_rank, *executed[policy]))
        probe_after = measure_probes(first, spec)
        now = {key: _mean_or_none([probe_before[key], probe_after[key]]) for key in probe_before}
        if step >= spec.warmup_steps and rank == 0:
            for policy, plan, stats, busy_by_rank, run_plan, barriers in measured_round:
                row = _measured_row(policy, step - spec.warmup_steps, plan, stats, busy_by_rank, grad_bytes,
                                    predict, in_run, now, run_plan, barriers, ep_size=state.ep_size)
                rows.append(asdict(row))
    for generator in batches:
        generator.close()  # leaves the HDP loaders' contexts
    return {"planned_with": _timing_record(predict), "in_run_fit": _timing_record(in_run), "grad_bytes": grad_bytes,
            "rows": rows}


def _timing_record(timing: dict) -> dict:
    """A {"model": CostModel, "allreduce_bandwidth", "step_overhead", probes, "model_without_alltoall"} set as
    JSON-ready values."""
    twin = timing["model_without_alltoall"]
    return {"cost_model": timing["model"].to_dict(), "allreduce_bandwidth": timing["allreduce_bandwidth"],
            "step_overhead": timing["step_overhead"], "speed_probe": timing["speed_probe"],
            "ring_probe": timing["ring_probe"], "cost_model_without_alltoall": twin.to_dict() if twin else None}


def _median_or_none(values: list) -> Optional[float]:
    return None if None in values else statistics.median(values)


def _mean_or_none(values: list) -> Optional[float]:
    return None if None in values else statistics.mean(values)
