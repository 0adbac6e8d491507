"""Pictures of plans and simulated steps (matplotlib, Agg backend: files only, no display).

- `plot_plans`: each policy's plan as ranks x micro-batches, every ring in its own colour, whole
  sequences in grey (`megatron-hdp plan --plot`).
- `plot_gantt`: per-rank timelines of one simulated step per policy, side by side on one time axis
  (ByteScale's timeline figure): compute, exposed ring traffic and offload, waiting, gradient all-reduce.
- `plot_throughput`: tokens/s against context length per policy (ByteScale's end-to-end figure).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.patches import Patch  # noqa: E402

from megatron_hdp.plan.step_plan import StepPlan  # noqa: E402
from megatron_hdp.sim.cluster import format_tokens  # noqa: E402
from megatron_hdp.sim.simulator import StepTimeline  # noqa: E402

MAX_RANKS_SHOWN = 32
"""Rows drawn per panel; larger pools show their first ranks (rings sit on contiguous ranks)."""

COLORS = {
    "compute": "#4c72b0",
    "ring": "#dd8452",
    "comm": "#c44e52",
    "offload": "#8172b3",
    "idle": "#eeeeee",
    "allreduce": "#55a868",
    "whole": "#b0b0b0",
}


def _ranks_shown(num_ranks: int) -> int:
    return min(num_ranks, MAX_RANKS_SHOWN)


def _ring_color(seq: int):
    return plt.get_cmap("tab20")(seq % 20)


def _panels(count: int, *, height: float):
    fig, axes = plt.subplots(1, count, figsize=(5.5 * count, height), squeeze=False)
    return fig, axes[0]


def plot_plans(plans: Mapping[str, StepPlan], path: str) -> None:
    """Each plan as a grid: rank on y, micro-batch index on x; a cell is split among its shards in
    proportion to their tokens, ring shards coloured by sequence, whole sequences grey."""
    if not plans:
        raise ValueError("plot_plans needs at least one plan")
    shown = max(_ranks_shown(p.num_ranks) for p in plans.values())
    fig, axes = _panels(len(plans), height=1.5 + 0.22 * shown)
    for ax, (name, plan) in zip(axes, plans.items()):
        for schedule in plan.ranks[: _ranks_shown(plan.num_ranks)]:
            for index, mb in enumerate(schedule.microbatches):
                left = float(index)
                for shard in mb.shards:
                    width = 0.9 * shard.num_tokens / max(mb.capacity, mb.num_tokens, 1)
                    ring = len(plan.sequences[shard.seq].ring) > 1
                    color = _ring_color(shard.seq) if ring else COLORS["whole"]
                    ax.barh(schedule.rank, width, left=left, height=0.8, color=color, edgecolor="white", lw=0.3)
                    left += width
                ax.barh(schedule.rank, 0.9, left=float(index), height=0.8, fill=False, edgecolor="#606060", lw=0.4)
        summary = plan.summary()
        ax.set_title(f"{name}: {summary.num_rings} rings, micro-batches {summary.min_microbatches}-"
                     f"{summary.max_microbatches}", fontsize=9)
        ax.set_xlabel("micro-batch (cell width = tokens / capacity)")
        ax.set_ylabel("HDP rank")
        ax.invert_yaxis()
    fig.legend(handles=[Patch(color=COLORS["whole"], label="whole sequence"),
                        Patch(color=_ring_color(1), label="ring shard (one colour per sequence)")],
               loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _op_pieces(timeline: StepTimeline, rank: int):
    """(start, width, kind) pieces of stage 0 of `rank`: each op's compute, exposed comm and offload."""
    for op in timeline.ops[rank][0]:
        compute = op.busy_end - op.start - op.comm - op.offload
        left = op.start
        for kind, width in (("ring" if op.ring else "compute", compute), ("comm", op.comm), ("offload", op.offload)):
            if width > 0:
                yield left, width, kind
                left += width


def plot_gantt(timelines: Mapping[str, StepTimeline], path: str) -> None:
    """One step per policy, side by side on a shared time axis (stage 0 of each rank when PP > 1)."""
    if not timelines:
        raise ValueError("plot_gantt needs at least one timeline")
    shown = max(_ranks_shown(t.num_ranks) for t in timelines.values())
    fig, axes = _panels(len(timelines), height=1.8 + 0.22 * shown)
    horizon = max(t.step_time for t in timelines.values())
    for ax, (name, timeline) in zip(axes, timelines.items()):
        for rank in range(_ranks_shown(timeline.num_ranks)):
            ax.barh(rank, timeline.compute_end, color=COLORS["idle"], height=0.8)
            for left, width, kind in _op_pieces(timeline, rank):
                ax.barh(rank, width, left=left, color=COLORS[kind], height=0.8)
            ax.barh(rank, timeline.allreduce_time, left=timeline.compute_end, color=COLORS["allreduce"], height=0.8)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{name}: step {timeline.step_time:.2f} s, idle {timeline.idle_fraction:.0%}", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("HDP rank")
        ax.invert_yaxis()
    legend = [Patch(color=COLORS[k], label=label) for k, label in (
        ("compute", "compute (whole sequences)"), ("ring", "compute (with ring attention)"), ("comm", "exposed ring traffic"),
        ("offload", "exposed offload"), ("idle", "waiting"), ("allreduce", "gradient all-reduce"))]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(contexts: Sequence[int], throughput: Mapping[str, Sequence[float]], path: str,
                    *, title: str = "") -> None:
    """Tokens/s against context length, one line per policy (missing points as NaN are skipped)."""
    if not contexts or not throughput:
        raise ValueError("plot_throughput needs contexts and at least one policy")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, values in throughput.items():
        ax.plot(range(len(contexts)), values, marker="o", label=name)
    ax.set_xticks(range(len(contexts)), [format_tokens(c) for c in contexts])
    ax.set_xlabel("context length")
    ax.set_ylabel("tokens / s (whole cluster)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
