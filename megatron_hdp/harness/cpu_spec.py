"""`CpuRunSpec`: what a CPU training run (`cpu_training`) trains, on how many ranks, under which policies;
shared by the run and by the measurements that fit its cost model (`cpu_fit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
