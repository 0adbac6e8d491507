"""Measured per-step telemetry of an HDP run: where each rank's time went (no Megatron import; the
Megatron-LM driver, `megatron.pretrain.install`, runs it and writes it through Megatron's writers).

The plan predicts a step; this module measures it. For every training step and every rank of the HDP
domain it records

- compute: the forward-backward of the rank's micro-batches, without the waits below;
- ring wait: time spent waiting for ring-attention messages (every `Pending.wait` of `comm.p2p`);
- offload exposed: time compute stood still for activation copies (the offloader's own measure);
- finalize: Megatron's `finalize_model_grads` (the gradient all-reduce over the HDP domain). A rank
  that arrives early waits there for the last one, so over the domain the shortest finalize is the
  all-reduce itself and each rank's excess over it is its idle time before the all-reduce;
- ring bytes it sent, and the part sent to a rank on another node: the node the plan priced (the cost
  model's ranks per node, i.e. the NVLink domain: 72 GPUs on a GB200 NVL72 rack, whose trays each hold 4
  of torchrun's local ranks), else torchrun's `LOCAL_WORLD_SIZE` ranks, else the whole job.

Clocks: on CUDA, events recorded on the current stream (no host sync inside the step) and read when
the step's telemetry is logged, one step late, when they are long complete. On CPU, compute is process
time (what the rank's own threads did: a rank blocked in a gloo wait uses none, and ranks sharing cores
do not inflate each other) and the waits and finalize are wall time.

`gather_rows` gathers the ranks' records over the data-parallel group (outside the step, at Megatron's
`training_log`: `megatron.pretrain.runtime.log_telemetry`); `summarize` makes per step the max / mean /
min over ranks, the measured balance (max / mean compute, next to the plan's `hdp/balance`) and each
rank's compute and idle, which `write_stats` writes through Megatron's TensorBoard and W&B writers and
`console_line` prints. `plan_seqlen_stats` gives Megatron's FLOPs
count the real tokens and sum of squared document lengths of an HDP step.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_hdp.comm.p2p import observe_p2p

PER_RANK_FIELDS = ("compute", "ring_wait", "offload_exposed", "finalize", "step", "ring_bytes", "cross_node_bytes")
"""What each rank measures per step (seconds, bytes), in the order they are gathered."""


class _HostClock:
    """Wall time from the host (CPU runs)."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class _CudaClock:
    """CUDA events on the current stream: recording costs no host sync; reading waits for them."""

    @staticmethod
    def mark() -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3


@dataclass
class _StepMarks:
    """One step's clock marks and counters on this rank, until they are read."""

    iteration: int
    start: Any
    finalize_start: Any = None
    finalize_end: Any = None
    busy_seconds: Optional[float] = None
    """CPU: process seconds from the step's start to its finalize (None on CUDA)."""
    waits: list = field(default_factory=list)
    ring_bytes: int = 0
    cross_node_bytes: int = 0
    offload_exposed: float = 0.0


class _StepObserver:
    """The `P2PObserver` of one step: counts bytes per destination node and clocks every wait."""

    def __init__(self, marks: _StepMarks, clock: Any, *, rank: int, ranks_per_node: int) -> None:
        self.marks, self.clock, self.rank, self.ranks_per_node = marks, clock, rank, ranks_per_node

    def sent(self, *, peer: int, num_bytes: int) -> None:
        self.marks.ring_bytes += num_bytes
        if peer // self.ranks_per_node != self.rank // self.ranks_per_node:
            self.marks.cross_node_bytes += num_bytes

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        start = self.clock.mark()
        yield
        self.marks.waits.append((start, self.clock.mark()))


def _launcher_ranks_per_node() -> int:
    """Ranks per host of this job: torchrun's LOCAL_WORLD_SIZE, else the whole world is one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


class StepTelemetry:
    """Measures this rank's training steps; `read` hands back the finished ones as per-rank rows."""

    def __init__(self, *, use_cuda: Optional[bool] = None, ranks_per_node: Optional[int] = None) -> None:
        """`ranks_per_node`: global ranks of one node (NVLink domain) for the cross-node byte count, the
        same node the plan priced (`HDPRuntime` passes the cost model's HDP ranks per node x TP); None:
        the launcher's host (module docstring)."""
        self.ranks_per_node = ranks_per_node
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.clock = _CudaClock() if self.use_cuda else _HostClock()
        self._pending: list[_StepMarks] = []

    @contextlib.contextmanager
    def measure(self, iteration: int, *, model_config: Any) -> Iterator[_StepMarks]:
        """Measure the enclosed forward-backward (schedule call) of training step `iteration`.

        `model_config` is the chunk's TransformerConfig: its `finalize_model_grads_func` is timed for
        the duration of the block. Set `offload_exposed` on the yielded marks when the step's offload
        statistics are known.
        """
        marks = _StepMarks(iteration=iteration, start=self.clock.mark())
        busy_start = time.process_time()
        finalize = model_config.finalize_model_grads_func

        def timed_finalize(*args: Any, **kwargs: Any) -> Any:
            if not self.use_cuda:
                marks.busy_seconds = time.process_time() - busy_start
            marks.finalize_start = self.clock.mark()
            result = finalize(*args, **kwargs)
            marks.finalize_end = self.clock.mark()
            return result

        model_config.finalize_model_grads_func = timed_finalize
        observer = _StepObserver(marks, self.clock, rank=dist.get_rank(), ranks_per_node=self.ranks_per_node or _launcher_ranks_per_node())
        try:
            with observe_p2p(observer):
                yield marks
        finally:
            model_config.finalize_model_grads_func = finalize
        if marks.finalize_start is None:  # no finalize function configured: the step ends here
            marks.finalize_start = marks.finalize_end = self.clock.mark()
            if not self.use_cuda:
                marks.busy_seconds = time.process_time() - busy_start
        self._pending.append(marks)

    def read(self, up_to_iteration: int) -> list[tuple[int, list[float]]]:
        """(iteration, row of PER_RANK_FIELDS) for every measured step up to `up_to_iteration`, in order."""
        ready = [m for m in self._pending if m.iteration <= up_to_iteration]
        self._pending = [m for m in self._pending if m.iteration > up_to_iteration]
        return [(m.iteration, self._row(m)) for m in ready]

    def _row(self, m: _StepMarks) -> list[float]:
        seconds = self.clock.seconds
        ring_wait = sum(seconds(a, b) for a, b in m.waits)
        if m.busy_seconds is not None:
            compute = m.busy_seconds - m.offload_exposed
        else:
            compute = seconds(m.start, m.finalize_start) - ring_wait - m.offload_exposed
        finalize = seconds(m.finalize_start, m.finalize_end)
        step = seconds(m.start, m.finalize_end)
        return [max(compute, 0.0), ring_wait, m.offload_exposed, finalize, step, m.ring_bytes, m.cross_node_bytes]


def summarize(table: torch.Tensor) -> dict[str, float]:
    """Per-step statistics from the gathered [ranks, PER_RANK_FIELDS] table of one step."""
    column = {name: table[:, i].double() for i, name in enumerate(PER_RANK_FIELDS)}
    allreduce = column["finalize"].min()
    idle = column["finalize"] - allreduce
    stats: dict[str, float] = {}
    for name, values in (
        ("compute-s", column["compute"]),
        ("ring-wait-s", column["ring_wait"]),
        ("offload-exposed-s", column["offload_exposed"]),
        ("idle-before-allreduce-s", idle),
    ):
        stats[f"hdp/measured/{name}-max"] = float(values.max())
        stats[f"hdp/measured/{name}-mean"] = float(values.mean())
        stats[f"hdp/measured/{name}-min"] = float(values.min())
    mean_compute = float(column["compute"].mean())
    stats["hdp/measured/allreduce-s"] = float(allreduce)
    stats["hdp/measured/step-s"] = float(column["step"].max())
    stats["hdp/measured/balance"] = float(column["compute"].max()) / mean_compute if mean_compute > 0 else 1.0
    stats["hdp/measured/ring-GB"] = float(column["ring_bytes"].sum()) / 1e9
    stats["hdp/measured/cross-node-GB"] = float(column["cross_node_bytes"].sum()) / 1e9
    for rank in range(table.shape[0]):
        stats[f"hdp/rank/compute-s/{rank}"] = float(column["compute"][rank])
        stats[f"hdp/rank/idle-s/{rank}"] = float(idle[rank])
    return stats


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor for a collective over `group` must live: the host when the group's backends take
    CPU tensors (gloo, or a "cpu:gloo,cuda:nccl" pair), else the current CUDA device (NCCL, however its
    backend string is spelled, e.g. "nccl" or "cuda:nccl")."""
    group = group if group is not None else dist.group.WORLD
    if torch.device("cpu") in group._device_types:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def gather_rows(rows: list[tuple[int, list[float]]], *, group: Any = None) -> list[tuple[int, torch.Tensor]]:
    """All ranks' rows of the same steps: (iteration, [ranks, PER_RANK_FIELDS]) per step. A collective
    over `group`: every rank calls it with rows of the same iterations."""
    if not rows:
        return []
    mine = torch.tensor([row for _, row in rows], dtype=torch.float64, device=collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered, dim=1).cpu()  # [steps, ranks, fields]
    return [(iteration, table[i]) for i, (iteration, _) in enumerate(rows)]


def console_line(iteration: int, stats: dict[str, float]) -> str:
    """The measured half of the HDP log line: compute, waits, idle and the all-reduce, max/mean/min."""

    def spread(name: str) -> str:
        return "/".join(f"{stats[f'hdp/measured/{name}-{k}'] * 1e3:.1f}" for k in ("max", "mean", "min"))

    return (
        f" [HDP measured] iteration {iteration:8d} | step {stats['hdp/measured/step-s'] * 1e3:.1f} ms | "
        f"balance {stats['hdp/measured/balance']:.3f} | compute ms max/mean/min {spread('compute-s')} | "
        f"ring wait {spread('ring-wait-s')} | offload exposed {spread('offload-exposed-s')} | "
        f"idle before all-reduce {spread('idle-before-allreduce-s')} | "
        f"all-reduce {stats['hdp/measured/allreduce-s'] * 1e3:.1f} ms | ring {stats['hdp/measured/ring-GB']:.4g} GB "
        f"({stats['hdp/measured/cross-node-GB']:.4g} GB across nodes)"
    )


def write_stats(iteration: int, stats: dict[str, float], *, writer: Any, wandb_writer: Any) -> None:
    """Write `stats` of step `iteration` through Megatron's TensorBoard and W&B writers (None: skipped)."""
    if writer is not None:
        for name, value in stats.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(stats, iteration)


def plan_seqlen_stats(plan: Any) -> tuple[float, float]:
    """(real tokens, sum of squared document lengths) of a step's global batch, as Megatron's
    `num_floating_point_operations` takes them: attention FLOPs of a document grow with its length
    squared wherever its tokens are, so a document split over a ring counts as one document."""
    lengths = [float(seq.length) for seq in plan.sequences]
    return sum(lengths), sum(n * n for n in lengths)
