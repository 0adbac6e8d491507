"""Measure this machine and fit the CPU cost model of the tiny GPT, in CPU seconds (`cpu_training`'s module
doc says why that currency): T(s) per layer from whole documents, ring costs from ring micro-batches, the
jitter, the gradient all-reduce, the MoE expert share and all-to-all, and the speed and ring probes that
rescale a prediction to a round's conditions. Every rank runs these together, on its `HDPTrainer`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_hdp.plan.cost.model import CostModel

from megatron_hdp.harness.cpu_spec import CpuRunSpec

if TYPE_CHECKING:
    from megatron_hdp.megatron.core_api.step import BusyTimes


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
    fastest = fastest_busy_times(_timed_runs(trainer, plan, repeats))
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
    fastest = fastest_busy_times(_timed_runs(trainer, plan, spec.timing_repeats))
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


def fastest_busy_times(runs: list) -> "BusyTimes":
    """Each phase's fewest CPU seconds over `runs` (BusyTimes of the same plan)."""
    from megatron_hdp.megatron.core_api.step import BusyTimes

    return BusyTimes(
        before=min(r.before for r in runs),
        forward=tuple(map(min, zip(*(r.forward for r in runs)))),
        backward=tuple(map(min, zip(*(r.backward for r in runs)))),
        after=min(r.after for r in runs),
    )
