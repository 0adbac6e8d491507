"""`megatron-hdp report RUN_DIR`: did HDP pay off on this cluster? One PNG dashboard and a Markdown summary.

    megatron-hdp report runs/llama-128k          # reads runs/llama-128k/**/events.out.tfevents.* and
                                                 # runs/llama-128k/**/iter_*.json (--hdp-save-plans)

Reads the measured telemetry the run logged to TensorBoard (`megatron_hdp.comm.telemetry`) and the
plan's predictions next to it, plus the saved plans for the ring sizes, and writes `dashboard.png`
(per-step predicted vs measured step time, predicted vs measured balance, where each step's time went,
ring-size histogram, ring and cross-node bytes, per-rank compute) and `summary.md`.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Optional

from megatron_hdp.run_logs import per_rank_series, read_plans, read_scalars

BREAKDOWN = {
    "compute": "hdp/measured/compute-s-mean",
    "ring wait": "hdp/measured/ring-wait-s-mean",
    "offload exposed": "hdp/measured/offload-exposed-s-mean",
    "idle before all-reduce": "hdp/measured/idle-before-allreduce-s-mean",
    "all-reduce": "hdp/measured/allreduce-s",
}
"""Where a step's time went (mean over ranks), in the order the step runs, and the tag of each."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the report subcommand."""
    parser.add_argument("run_dir", help="directory of the run (TensorBoard event files and saved plans below it)")
    parser.add_argument("--tensorboard-dir", default=None, help="event files (default: searched under RUN_DIR)")
    parser.add_argument("--plans-dir", default=None, help="--hdp-save-plans directory (default: searched under RUN_DIR)")
    parser.add_argument("--output-dir", default=None, help="where dashboard.png and summary.md go (default: RUN_DIR)")


@dataclass
class RunReport:
    """Per-step series of a run and what the summary says about them."""

    steps: list[int]
    measured_step: list[float]
    predicted_step: list[Optional[float]]
    measured_balance: list[float]
    predicted_balance: list[Optional[float]]
    breakdown: dict[str, list[float]]
    ring_gb: list[float]
    cross_node_gb: list[float]
    ring_sizes: Counter
    """Sequences per ring size over the saved plans (1: whole on one rank)."""
    rank_compute: dict[int, float]
    """Mean measured compute seconds of each rank over the steps."""


def build_report(scalars: dict[str, dict[int, float]], plans: dict[int, dict]) -> RunReport:
    """Line up the measured and predicted series of every step the telemetry logged."""
    measured = scalars.get("hdp/measured/step-s")
    if not measured:
        raise ValueError("the run logged no HDP telemetry (hdp/measured/*): was it trained with --hdp?")
    steps = sorted(measured)

    def series(tag: str) -> list[float]:
        return [scalars[tag][s] for s in steps]

    def maybe(tag: str) -> list[Optional[float]]:
        return [scalars.get(tag, {}).get(s) for s in steps]

    ring_sizes: Counter = Counter(len(seq["ring"]) for plan in plans.values() for seq in plan["sequences"])
    return RunReport(
        steps=steps,
        measured_step=series("hdp/measured/step-s"),
        predicted_step=maybe("hdp/est-step-time-s"),
        measured_balance=series("hdp/measured/balance"),
        predicted_balance=maybe("hdp/balance"),
        breakdown={name: series(tag) for name, tag in BREAKDOWN.items()},
        ring_gb=series("hdp/measured/ring-GB"),
        cross_node_gb=series("hdp/measured/cross-node-GB"),
        ring_sizes=ring_sizes,
        rank_compute={r: fmean(v[s] for s in steps if s in v) for r, v in sorted(per_rank_series(scalars, "hdp/rank/compute-s").items())},
    )


def _mean(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return fmean(known) if known else None


def summary_markdown(report: RunReport, *, run_dir: str) -> str:
    """The short Markdown summary: means over the logged steps."""
    step = fmean(report.measured_step)
    predicted = _mean(report.predicted_step)
    idle = fmean(report.breakdown["idle before all-reduce"])
    lines = [
        f"# HDP run report: {run_dir}",
        "",
        f"{len(report.steps)} steps with telemetry ({report.steps[0]}..{report.steps[-1]}); means over steps.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| measured step time | {step * 1e3:.3f} ms |",
        f"| predicted step time | {predicted * 1e3:.3f} ms |" if predicted is not None else "| predicted step time | - |",
        f"| measured balance (max/mean compute) | {fmean(report.measured_balance):.4f} |",
    ]
    predicted_balance = _mean(report.predicted_balance)
    if predicted_balance is not None:
        lines.append(f"| predicted balance | {predicted_balance:.4f} |")
    for name, values in report.breakdown.items():
        lines.append(f"| {name} (mean over ranks) | {fmean(values) * 1e3:.3f} ms ({fmean(values) / step:.1%} of step) |")
    lines += [
        f"| ring bytes per step | {fmean(report.ring_gb):.6g} GB |",
        f"| cross-node bytes per step | {fmean(report.cross_node_gb):.6g} GB |",
        "",
    ]
    if report.ring_sizes:
        total = sum(report.ring_sizes.values())
        sizes = ", ".join(f"{k}: {n}" for k, n in sorted(report.ring_sizes.items()))
        whole = report.ring_sizes.get(1, 0) / total
        lines.append(f"Ring sizes over {total} sequences of the saved plans (size: count): {sizes}; {whole:.0%} stayed whole.")
    else:
        lines.append("No saved plans found (train with --hdp-save-plans DIR for the ring-size histogram).")
    lines += [
        "",
        f"Ranks sat idle before the gradient all-reduce for {idle / step:.1%} of the step on average "
        "(a well-balanced HDP run keeps this near zero).",
        "",
    ]
    return "\n".join(lines)


def plot_dashboard(report: RunReport, path: Path) -> None:
    """The one-picture dashboard (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    steps = report.steps
    ax = axes[0, 0]
    ax.plot(steps, [t * 1e3 for t in report.measured_step], "o-", label="measured")
    if any(t is not None for t in report.predicted_step):
        ax.plot(steps, [t * 1e3 if t is not None else float("nan") for t in report.predicted_step], "s--", label="predicted")
    ax.set(title="step time", xlabel="iteration", ylabel="ms", yscale="log")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(steps, report.measured_balance, "o-", label="measured (max/mean compute)")
    if any(b is not None for b in report.predicted_balance):
        ax.plot(steps, [b if b is not None else float("nan") for b in report.predicted_balance], "s--", label="predicted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(title="balance", xlabel="iteration")
    ax.legend()
    ax = axes[0, 2]
    bottom = [0.0] * len(steps)
    for name, values in report.breakdown.items():
        ax.bar(steps, [v * 1e3 for v in values], bottom=bottom, label=name)
        bottom = [b + v * 1e3 for b, v in zip(bottom, values)]
    ax.set(title="where the time went (mean over ranks)", xlabel="iteration", ylabel="ms")
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    if report.ring_sizes:
        sizes = sorted(report.ring_sizes)
        ax.bar(sizes, [report.ring_sizes[k] for k in sizes])
        ax.set_xticks(sizes)
    ax.set(title="ring sizes (sequences; 1 = whole)", xlabel="ranks holding a sequence", ylabel="sequences")
    ax = axes[1, 1]
    ax.plot(steps, report.ring_gb, "o-", label="ring bytes")
    ax.plot(steps, report.cross_node_gb, "s--", label="crossed nodes")
    ax.set(title="ring-attention traffic", xlabel="iteration", ylabel="GB")
    ax.legend()
    ax = axes[1, 2]
    ax.bar(list(report.rank_compute), [v * 1e3 for v in report.rank_compute.values()])
    ax.set(title="mean compute per rank", xlabel="HDP rank", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Read the run, write dashboard.png and summary.md, print the summary."""
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    scalars = read_scalars(args.tensorboard_dir or run_dir)
    plans = read_plans(args.plans_dir or run_dir)
    report = build_report(scalars, plans)
    output = Path(args.output_dir or run_dir)
    output.mkdir(parents=True, exist_ok=True)
    summary = summary_markdown(report, run_dir=str(run_dir))
    (output / "summary.md").write_text(summary)
    plot_dashboard(report, output / "dashboard.png")
    print(summary)
    print(f"wrote {output / 'dashboard.png'} and {output / 'summary.md'}")
    return 0
