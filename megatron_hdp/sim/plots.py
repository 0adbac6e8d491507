"""Pictures of plans and simulated steps (matplotlib, Agg backend: files only, no display).

- `plot_plans`: each policy's plan as ranks x micro-batches, every ring in its own colour, whole
  sequences in grey, and each rank's predicted time beside it (`megatron-hdp plan --plot`). Every rank
  is drawn: up to `BAR_RANKS` ranks each cell is split among its shards; above, as a grid image
  (one pixel row per rank at most, each cell coloured by its largest ring shard, or grey by how full it is).
- `plot_gantt`: per-rank timelines of one simulated step per policy, side by side on one time axis
  (ByteScale's timeline figure): compute, exposed ring traffic and offload, waiting, gradient all-reduce.
  Up to `BAR_RANKS` ranks all of them; above, the busiest, the idlest and evenly spaced ones between
  (`ranks_to_draw`), as its title says.
- `plot_throughput`: tokens/s against context length per policy (ByteScale's end-to-end figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from megatron_hdp.plan.step_plan import StepPlan  # noqa: E402
from megatron_hdp.sim.cluster import format_tokens  # noqa: E402
from megatron_hdp.sim.simulator import StepTimeline  # noqa: E402

BAR_RANKS = 64
"""Most ranks drawn one bar row each; larger pools are drawn as a grid image (plans) or a choice of
ranks (Gantt)."""

COLORS = {
    "compute": "#4c72b0",
    "ring": "#dd8452",
    "comm": "#c44e52",
    "offload": "#8172b3",
    "idle": "#eeeeee",
    "allreduce": "#55a868",
    "whole": "#b0b0b0",
}


RING_PALETTE = tuple(c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (14, 15))
"""Ring colours: tab20 without its two greys (grey is for whole sequences)."""


def _ring_color(seq: int):
    return RING_PALETTE[seq % len(RING_PALETTE)]


@dataclass(frozen=True)
class PlanGrid:
    """What `plot_plans` draws of one plan, every rank and micro-batch: arrays [num_ranks, most micro-batches]."""

    ring_seq: np.ndarray
    """The sequence of the cell's largest ring shard; -1 where it holds only whole sequences or nothing."""
    fill: np.ndarray
    """Tokens / capacity of each micro-batch; NaN where the rank runs fewer micro-batches."""
    rank_time: np.ndarray
    """Each rank's predicted time (est_time), seconds."""

    @property
    def num_ranks(self) -> int:
        return len(self.rank_time)

    def describe(self) -> str:
        """Which ranks the picture shows (for its title): all of them, the busiest and the idlest named."""
        busiest, idlest = int(np.argmax(self.rank_time)), int(np.argmin(self.rank_time))
        return f"all {self.num_ranks} ranks (busiest {busiest}, idlest {idlest})"


def plan_grid(plan: StepPlan) -> PlanGrid:
    """The grid of `plan` that `plot_plans` draws (see `PlanGrid`)."""
    depth = max((len(r.microbatches) for r in plan.ranks), default=0)
    ring_seq = np.full((plan.num_ranks, max(depth, 1)), -1, dtype=np.int64)
    fill = np.full((plan.num_ranks, max(depth, 1)), np.nan)
    ring_sizes = [len(seq.ring) for seq in plan.sequences]
    for schedule in plan.ranks:
        for index, mb in enumerate(schedule.microbatches):
            fill[schedule.rank, index] = mb.num_tokens / max(mb.capacity, 1)
            rings = [(shard.num_tokens, shard.seq) for shard in mb.shards if ring_sizes[shard.seq] > 1]
            if rings:
                ring_seq[schedule.rank, index] = max(rings)[1]
    return PlanGrid(ring_seq, fill, np.array([r.est_time for r in plan.ranks], dtype=float))


def _draw_bars(ax, plan: StepPlan) -> None:
    """Every rank a row of micro-batch cells, each split among its shards in proportion to their tokens
    (one collection of rectangles: a static plan has a shard per rank per sequence)."""
    boxes, colors, frames = [], [], []
    for schedule in plan.ranks:
        top, bottom = schedule.rank - 0.4, schedule.rank + 0.4
        for index, mb in enumerate(schedule.microbatches):
            left = float(index)
            for shard in mb.shards:
                width = 0.9 * shard.num_tokens / max(mb.capacity, mb.num_tokens, 1)
                ring = len(plan.sequences[shard.seq].ring) > 1
                boxes.append(((left, top), (left + width, top), (left + width, bottom), (left, bottom)))
                colors.append(_ring_color(shard.seq) if ring else COLORS["whole"])
                left += width
            frames.append(((index, top), (index + 0.9, top), (index + 0.9, bottom), (index, bottom)))
    ax.add_collection(PolyCollection(boxes, facecolors=colors, edgecolors="white", linewidths=0.3))
    ax.add_collection(PolyCollection(frames, facecolors="none", edgecolors="#606060", linewidths=0.4))
    ax.set_xlim(-0.1, max((len(r.microbatches) for r in plan.ranks), default=1))
    ax.set_ylim(plan.num_ranks - 0.5, -0.5)


def _draw_grid(ax, grid: PlanGrid) -> None:
    """Every rank a pixel row (or less): ring cells in their ring's colour, other cells grey by fill."""
    image = np.ones(grid.ring_seq.shape + (3,))
    filled = ~np.isnan(grid.fill)
    grey = np.array(to_rgb(COLORS["whole"]))
    shade = np.clip(np.nan_to_num(grid.fill), 0.0, 1.0)[..., None]
    image[filled] = (1.0 - shade[filled] * (1.0 - grey))
    ring = grid.ring_seq >= 0
    if ring.any():
        palette = np.array([to_rgb(c) for c in RING_PALETTE])
        image[ring] = palette[grid.ring_seq[ring] % len(palette)]
    # each micro-batch 16 pixel columns wide, the last 2 white: the smoothing that keeps thousands of rank
    # rows readable then blurs only within a cell, not across micro-batches
    columns = np.repeat(image, 16, axis=1)
    columns[:, 14::16] = 1.0
    columns[:, 15::16] = 1.0
    ax.imshow(columns, aspect="auto", interpolation="antialiased",
              extent=(0.0, grid.fill.shape[1], grid.num_ranks - 0.5, -0.5))


def plot_plans(plans: Mapping[str, StepPlan], path: str) -> None:
    """Each plan as a grid: rank on y, micro-batch index on x, every rank drawn (see the module
    docstring); beside it each rank's predicted time, so the busiest and idlest ranks stand out."""
    if not plans:
        raise ValueError("plot_plans needs at least one plan")
    most = max(p.num_ranks for p in plans.values())
    height = 1.8 + 0.14 * most if most <= BAR_RANKS else 7.5
    fig, axes = plt.subplots(1, 2 * len(plans), figsize=(6.5 * len(plans), height), squeeze=False,
                             gridspec_kw={"width_ratios": [5, 1] * len(plans)})
    for index, (name, plan) in enumerate(plans.items()):
        ax, load = axes[0][2 * index], axes[0][2 * index + 1]
        grid = plan_grid(plan)
        if plan.num_ranks <= BAR_RANKS:
            _draw_bars(ax, plan)
        else:
            _draw_grid(ax, grid)
        summary = plan.summary()
        ax.set_title(f"{name}: {grid.describe()},\n{summary.num_rings} rings, micro-batches "
                     f"{summary.min_microbatches}-{summary.max_microbatches}", fontsize=9)
        ax.set_xlabel("micro-batch (cell width = tokens / capacity)" if plan.num_ranks <= BAR_RANKS
                      else "micro-batch (grey: fill; colour: ring)")
        ax.set_ylabel("HDP rank")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        edges = np.repeat(np.arange(plan.num_ranks + 1) - 0.5, 2)[1:-1]  # one polygon, whatever the rank count
        load.fill_betweenx(edges, 0.0, np.repeat(grid.rank_time, 2), color=COLORS["compute"], lw=0)
        load.set_xlim(left=0.0)
        load.set_ylim(plan.num_ranks - 0.5, -0.5)
        load.set_yticks([])
        load.set_xlabel("predicted s", fontsize=8)
        load.tick_params(axis="x", labelsize=7)
    fig.legend(handles=[Patch(color=COLORS["whole"], label="whole sequence"),
                        Patch(color=_ring_color(1), label="ring shard (one colour per sequence)"),
                        Patch(color=COLORS["compute"], label="rank's predicted time")],
               loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ranks_to_draw(busy: np.ndarray, *, limit: int = BAR_RANKS) -> tuple[list[int], str]:
    """The ranks a Gantt chart draws and how to say so: all of them up to `limit`; above, the `limit` / 4
    busiest, the `limit` / 4 idlest and evenly spaced ones between, in rank order."""
    num_ranks = len(busy)
    if num_ranks <= limit:
        return list(range(num_ranks)), f"all {num_ranks} ranks"
    extremes = limit // 4
    order = np.argsort(busy, kind="stable")
    chosen = set(order[-extremes:].tolist()) | set(order[:extremes].tolist())
    for rank in np.linspace(0, num_ranks - 1, limit).round().astype(int).tolist():
        if len(chosen) >= limit:
            break
        chosen.add(rank)
    return sorted(chosen), f"{len(chosen)} of {num_ranks} ranks: {extremes} busiest, {extremes} idlest, rest evenly spaced"


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
    shown = max(min(t.num_ranks, BAR_RANKS) for t in timelines.values())
    fig, axes = plt.subplots(1, len(timelines), figsize=(5.5 * len(timelines), 2.0 + 0.14 * shown), squeeze=False)
    horizon = max(t.step_time for t in timelines.values())
    for ax, (name, timeline) in zip(axes[0], timelines.items()):
        ranks, which = ranks_to_draw(timeline.busy[:, 0] if timeline.busy.ndim > 1 else timeline.busy)
        for row, rank in enumerate(ranks):
            ax.barh(row, timeline.compute_end, color=COLORS["idle"], height=0.8)
            for left, width, kind in _op_pieces(timeline, rank):
                ax.barh(row, width, left=left, color=COLORS[kind], height=0.8)
            ax.barh(row, timeline.allreduce_time, left=timeline.compute_end, color=COLORS["allreduce"], height=0.8)
        if len(ranks) < timeline.num_ranks:
            ax.set_yticks(range(len(ranks))[:: max(1, len(ranks) // 16)],
                          [str(r) for r in ranks][:: max(1, len(ranks) // 16)], fontsize=7)
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{name}: step {timeline.step_time:.2f} s, idle {timeline.idle_fraction:.0%}\n{which}",
                     fontsize=9)
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
