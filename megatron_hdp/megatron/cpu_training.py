"""Train the tiny Llama-style GPT with HDP on gloo CPU ranks, policy against policy: the demo and the bench.

Every rank runs `train_policies` (through `megatron_hdp.comm.launch.run_gloo`): it initializes HDP,
fits the cost model of *this* model on *this* machine (a quick sweep of whole documents timed on all
ranks at once, so the fit sees the same CPU sharing as the steps; ring bandwidth from a timed exchange),
then for each policy builds the model from the same seed and trains the same global batches, planned by
`make_plan`. Rows of statistics come back from rank 0. Synthetic documents follow ByteScale's long-tailed
"byted" mix, scaled down (`length_scale`) and clipped to `max_length` so that a CPU can train them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost_model import CostModel

logger = logging.getLogger(__name__)


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
    data_prefix: Optional[str] = None
    """A Megatron indexed dataset (PREFIX.bin/.idx, token ids < the model's vocabulary) to train from
    through the HDP loader: global batches of `tokens_per_step` tokens, documents cut at `max_length`.
    None: synthetic batches of the length mix above."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.capacity < 1 or self.tokens_per_step < 1 or self.length_scale < 1:
            raise ValueError(f"steps, capacity, tokens_per_step, length_scale must be >= 1: {self}")


@dataclass
class StepRow:
    """One step of one policy, as the demo prints it and the bench stores it."""

    policy: str
    step: int
    loss: float
    step_time: float
    max_compute_time: float
    predicted_time: float
    balance: float
    num_rings: int
    ring_sizes: dict = field(default_factory=dict)
    attention_bytes: int = 0
    num_microbatches: list = field(default_factory=list)
    num_sequences: int = 0
    num_tokens: int = 0


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
        from megatron_hdp.megatron.exactness import token_reader

        for step, lengths in enumerate(global_batches(spec)):
            plan = make_plan(lengths, num_ranks=state.hdp_size, config=config, cost_model=cost_model, policy=policy)
            yield plan, token_reader(spec.seed + step, lengths)
        return
    from megatron_hdp.data.loader import HDPDataLoader
    from megatron_hdp.megatron.datasets import IndexedDocumentSource

    loader_config = dataclasses.replace(
        config, hdp_policy=policy, hdp_global_batch_tokens=spec.tokens_per_step, hdp_overlong_documents="truncate"
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
    from megatron_hdp.megatron.model import tiny_llama_config

    return tiny_llama_config(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
    )


def _build(spec: CpuRunSpec, state):
    from megatron_hdp.megatron.exactness import VOCAB_SIZE
    from megatron_hdp.megatron.model import build_gpt, wrap_for_training
    from megatron_hdp.megatron.step import HDPTrainer

    torch.manual_seed(spec.seed)
    model = build_gpt(_model_config(spec), vocab_size=VOCAB_SIZE, max_sequence_length=spec.max_length)
    ddp, optimizer = wrap_for_training(model)
    return HDPTrainer(model=ddp, optimizer=optimizer, state=state)


def _time_whole_document(trainer, length: int, repeats: int) -> float:
    """Fastest forward + backward seconds of one whole document of `length` tokens on this rank."""
    from megatron_hdp.data.collate import collate_microbatch
    from megatron_hdp.megatron.exactness import token_reader
    from megatron_hdp.megatron.forward_step import make_forward_step
    from megatron_hdp.megatron.hand_plan import plan_from_rings

    rank = trainer.state.hdp_rank
    plan = plan_from_rings([length], [(rank,)], [0], num_ranks=trainer.state.hdp_size, capacity=length)
    batch = collate_microbatch(plan, plan.microbatches(rank)[0], token_reader(0, [length]), rank=rank)
    forward_step = make_forward_step(hdp_global_ranks=trainer.state.hdp_global_ranks)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        output, loss_func = forward_step(iter([batch]), trainer.model)
        loss_func(output)[0].backward()
        best = min(best, time.perf_counter() - start)
    trainer.model.zero_grad_buffer()
    return best


def _ring_bandwidth(num_bytes: int = 8 << 20) -> tuple[float, float]:
    """(bytes/s, latency s) of a gloo exchange between rank pairs (2i, 2i + 1), the ring's link."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    results = []
    for size in (4, num_bytes):
        send = torch.zeros(size // 4, dtype=torch.float32)
        recv = torch.empty_like(send)
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            if peer < world:
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            best = min(best, time.perf_counter() - start)
        results.append(best)
    latency, big = results
    times = torch.tensor([latency, big], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    latency, big = times.tolist()
    return num_bytes / max(big - latency, 1e-9), latency


def fit_cost_model(trainer, spec: CpuRunSpec) -> CostModel:
    """Per-layer T(s) = a1 s^2 + b1 s + g fitted (non-negative least squares, relative error) to whole
    documents of `spec.fit_lengths` timed on every rank at once; same coefficients on every rank."""
    from scipy.optimize import nnls

    seconds = []
    for length in spec.fit_lengths:
        dist.barrier()
        seconds.append(_time_whole_document(trainer, length, spec.fit_repeats))
    measured = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # the slowest rank's time: what a step waits for
    s = np.asarray(spec.fit_lengths, dtype=np.float64)
    t = measured.numpy() / spec.num_layers
    design = np.stack([s**2, s, np.ones_like(s)], axis=1) / t[:, None]
    (a1, b1, g), _ = nnls(design, np.ones_like(s))
    bandwidth, latency = _ring_bandwidth()
    kv_channels = spec.hidden_size // spec.num_attention_heads * spec.num_query_groups
    return CostModel(
        a1=float(a1), b1=float(b1), g=float(g),
        a2=float(4 * (6 * spec.hidden_size + 2 * kv_channels + 4 * spec.ffn_hidden_size)), b2=0.0,
        kv_bytes_per_token=float(4 * 2 * kv_channels), num_layers=spec.num_layers,
        ring_bandwidth=float(bandwidth), ring_latency=float(latency),
    )


def train_policies(rank: int, world_size: int, spec: CpuRunSpec, cost_model: Optional[dict] = None) -> dict:
    """Per rank: fit (or take) the cost model, then train `spec.steps` steps under each policy.

    Returns {"cost_model": dict, "rows": [StepRow as dict]} (rows filled on rank 0 only).
    """
    from megatron_hdp.megatron.initialize import initialize_hdp

    logging.getLogger("megatron").setLevel(logging.ERROR)
    state = initialize_hdp(seed=spec.seed)
    config = HDPConfig(hdp=True, hdp_capacity=spec.capacity, hdp_offload=False)
    model = CostModel.from_dict(cost_model) if cost_model else fit_cost_model(_build(spec, state), spec)
    rows = []
    for policy in spec.policies:
        trainer = _build(spec, state)
        for step, (plan, read_tokens) in enumerate(planned_batches(spec, state, config, model, policy)):
            lengths = plan.lengths
            stats = trainer.step(plan, read_tokens)
            if step < spec.warmup_steps:
                continue
            summary = plan.summary()
            rows.append(
                asdict(
                    StepRow(
                        policy=policy, step=step - spec.warmup_steps, loss=stats.loss, step_time=stats.step_time,
                        max_compute_time=max(stats.compute_times), predicted_time=plan.est_step_time,
                        balance=stats.balance, num_rings=stats.num_rings, ring_sizes=summary.ring_sizes,
                        attention_bytes=stats.attention_bytes, num_microbatches=stats.num_microbatches,
                        num_sequences=len(lengths), num_tokens=sum(lengths),
                    )
                )
            )
    return {"cost_model": model.to_dict(), "rows": rows if rank == 0 else []}
