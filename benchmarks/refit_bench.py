"""refit_bench: does the online cost-model refit recover a run that starts from a wrong cost model? (CPU)

Three runs plan the same global batches (8 HDP ranks, long-tailed document lengths) with the balance
policy; each rank's compute is the sum of its documents' forward + backward through a real Llama-style
layer, measured on this CPU (`DocumentTimer`), so each step has a measured per-rank compute time and a
measured balance (max / mean):

- calibrated: the cost model fitted to this machine beforehand (`plan.cost.fit.fit_compute`, the fit
  `megatron-hdp calibrate` makes, on documents of 32..2048 tokens timed by the same clock), never changed;
- wrong: the calibrated model with a1 x3, b1 / 3, g x3, never changed. (Every coefficient x3 would
  change no plan: the planner only compares times. A wrong mix of attention and linear cost does.)
- refit: the wrong model, refitted online from each step's measured per-rank compute
  (`plan.cost.online_refit.OnlineRefit`, the refit `--hdp-online-refit` runs) after 2 warm-up steps.

Goal: the refit run's measured balance is within 5% of the calibrated run's in <= 20 steps, i.e. from
some step <= 20 on, the mean balance over every window of 4 steps is at most 5% above the calibrated
run's on the same steps (a refit that balances better than the calibration counts as converged). Writes benchmarks/results/refit_bench.json and refit_bench.png and prints a table.

    PYTHONPATH=. python benchmarks/refit_bench.py [--steps 30] [--repeats 3] [--repeat 5]

`--repeat N` makes N whole runs, each timing its documents afresh (so each has its own calibration and
its own measured balances), and reports the quoted figures as median and range over the runs
(`repeats.py`); the JSON keeps every run, the picture shows the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatron_hdp.config import HDPConfig
from megatron_hdp.offload.reference_model import ReferenceLayer, rope_tables
from megatron_hdp.plan.cost.fit import fit_compute, fitted_cost_model
from megatron_hdp.plan.cost.online_refit import OnlineRefit, RefitSettings, compute_features
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import ModelShape, analytic_cost_model
from output import write_result
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement

RESULTS = Path(__file__).parent / "results"
SHAPE = ModelShape(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=4,
                   ffn_hidden_size=256, vocab_size=1024)
NUM_RANKS = 8
CAPACITY = 2048
WINDOW = 4
TOLERANCE = 0.05


def global_batches(steps: int, *, docs: int, sigma: float, seed: int) -> list[list[int]]:
    """Long-tailed document lengths (16..2048 tokens, multiples of 16): many short documents, a few long."""
    rng = np.random.default_rng(seed)
    return [(np.clip(rng.lognormal(5.2, sigma, size=docs), 16, CAPACITY) // 16 * 16).astype(int).tolist()
            for _ in range(steps)]


class DocumentTimer:
    """Forward + backward of one ReferenceLayer on one document, measured on this CPU once per length
    (the fastest of `repeats`, in process time: what this thread computed, so other work on a shared
    host adds little). A rank's step is the sum over its documents: measured, and the same every time
    the same documents come back, so the three runs differ only by their plans."""

    def __init__(self, repeats: int) -> None:
        torch.manual_seed(0)
        self.layer = ReferenceLayer(SHAPE, dtype=torch.float32)
        self.repeats = repeats
        self._seconds: dict[int, float] = {}

    def document_seconds(self, length: int) -> float:
        if length not in self._seconds:
            x = torch.randn(1, length, SHAPE.hidden_size, requires_grad=True)
            cos, sin = rope_tables(length, self.layer.head_dim, device=torch.device("cpu"), dtype=torch.float32)
            grad = torch.randn_like(x)
            self.layer(x, cos, sin).backward(grad)  # warm-up
            best = float("inf")
            for _ in range(self.repeats):
                start = time.process_time()
                self.layer(x, cos, sin).backward(grad)
                best = min(best, time.process_time() - start)
            self._seconds[length] = best
        return self._seconds[length]

    def rank_seconds(self, documents: list[list[int]]) -> float:
        """A rank's compute: its micro-batches' documents, one after the other."""
        return sum(self.document_seconds(length) for microbatch in documents for length in microbatch)


def rank_documents(plan) -> list[list[list[int]]]:
    """Per rank, per micro-batch, the lengths of its documents (every document is whole here)."""
    lengths = {s.id: s.length for s in plan.sequences}
    assert all(len(s.ring) == 1 for s in plan.sequences), "the bench keeps every document on one rank"
    return [[[lengths[sh.seq] for sh in mb.shards] for mb in plan.microbatches(r)] for r in range(plan.num_ranks)]


def run(batches, model, timer: DocumentTimer, *, refit: bool) -> dict:
    """Plan and execute every batch; return per-step measured balance, the model's coefficients and its
    prediction error (mean over ranks of |predicted - measured| / measured compute)."""
    config = HDPConfig(hdp=True, hdp_capacity=CAPACITY, hdp_offload=False)
    learner = OnlineRefit(model, RefitSettings(warmup_steps=2)) if refit else None
    balances, coefficients, errors = [], [], []
    for lengths in batches:
        current = learner.model if learner else model
        plan = make_plan(lengths, num_ranks=NUM_RANKS, config=config, cost_model=current)
        seconds = [timer.rank_seconds(docs) for docs in rank_documents(plan)]
        balances.append(max(seconds) / float(np.mean(seconds)))
        coefficients.append({"a1": current.a1, "b1": current.b1, "g": current.g})
        predicted = compute_features(plan, num_layers=current.num_layers) @ [current.a1, current.b1, current.g]
        errors.append(float(np.mean(np.abs(predicted - seconds) / seconds)))
        if learner:
            learner.observe(plan, seconds)
    return {"balance": balances, "coefficients": coefficients, "prediction_error": errors}


def converged_step(refit: list[float], calibrated: list[float]) -> int | None:
    """First step (1-based) from which every window of WINDOW steps has a mean balance at most TOLERANCE
    above the calibrated run's on the same steps."""
    n = len(refit)
    ok = [
        np.mean(refit[i:i + WINDOW]) <= (1 + TOLERANCE) * np.mean(calibrated[i:i + WINDOW])
        for i in range(n - WINDOW + 1)
    ]
    for start in range(len(ok)):
        if all(ok[start:]):
            return start + 1
    return None


def measure(args: argparse.Namespace) -> dict:
    """One run: time the documents afresh, calibrate, and plan every batch under the three cost models."""
    timer = DocumentTimer(args.repeats)
    # calibrated = `fit_compute` (what `megatron-hdp calibrate` fits) on documents timed by the same clock
    lengths = (32, 128, 256, 512, 1024, 2048)
    a1, b1, g = fit_compute(lengths, [timer.document_seconds(s) for s in lengths])
    calibrated = fitted_cost_model((a1, b1, g), base=analytic_cost_model(SHAPE, "h100"))
    fa1, fb1, fg = (float(x) for x in args.wrong.split(","))
    wrong = dataclasses.replace(calibrated, a1=a1 * fa1, b1=b1 * fb1, g=g * fg)
    batches = global_batches(args.steps, docs=args.docs, sigma=args.sigma, seed=args.seed)
    models = {
        "calibrated": run(batches, calibrated, timer, refit=False),
        "wrong": run(batches, wrong, timer, refit=False),
        "refit": run(batches, wrong, timer, refit=True),
    }
    step = converged_step(models["refit"]["balance"], models["calibrated"]["balance"])
    return {"calibrated_coefficients": {"a1": a1, "b1": b1, "g": g}, "models": models,
            "figures": figures(models, a1, b1), "converged_step": step,
            "goal_met": step is not None and step <= 20}


def figures(models: dict, a1: float, b1: float) -> dict:
    """What the README quotes of one run: per cost model the mean measured balance of the last 10 steps,
    the worst step's balance, the range of its prediction error over the last 10 steps; the refit
    coefficients' range relative to the calibration from step 10 on."""
    late = models["refit"]["coefficients"][9:]
    return {
        "mean_balance_last_10": {name: float(np.mean(r["balance"][-10:])) for name, r in models.items()},
        "worst_balance": {name: max(r["balance"]) for name, r in models.items()},
        "error_last_10_min": {name: min(r["prediction_error"][-10:]) for name, r in models.items()},
        "error_last_10_max": {name: max(r["prediction_error"][-10:]) for name, r in models.items()},
        "refit_a1_over_calibrated_from_step_10": [min(c["a1"] for c in late) / a1, max(c["a1"] for c in late) / a1],
        "refit_b1_over_calibrated_from_step_10": [min(c["b1"] for c in late) / b1, max(c["b1"] for c in late) / b1],
    }


def print_run(result: dict) -> None:
    """One run's steps: measured balance and prediction error per cost model, the refit coefficients."""
    models, a1, b1 = result["models"], result["calibrated_coefficients"]["a1"], result["calibrated_coefficients"]["b1"]
    print(f"{'':>4} {'measured balance':^28} {'prediction error':^28} {'refit / calibrated':^20}")
    print(f"{'step':>4} {'calibrated':>10} {'wrong':>8} {'refit':>8} {'calibrated':>10} {'wrong':>8} {'refit':>8} "
          f"{'a1':>9} {'b1':>9}")
    for i, c in enumerate(models["refit"]["coefficients"]):
        balance = [models[name]["balance"][i] for name in ("calibrated", "wrong", "refit")]
        error = [models[name]["prediction_error"][i] for name in ("calibrated", "wrong", "refit")]
        print(f"{i + 1:>4} {balance[0]:>10.3f} {balance[1]:>8.3f} {balance[2]:>8.3f} {error[0]:>10.1%} "
              f"{error[1]:>8.1%} {error[2]:>8.1%} {c['a1'] / a1:>9.3f} {c['b1'] / b1:>9.3f}")
    print_figures(result["figures"])
    step = result["converged_step"]
    print(f"refit at most {TOLERANCE:.0%} above calibrated (window {WINDOW}) from step {step}; goal (<= 20) "
          f"{'met' if result['goal_met'] else 'NOT met'}")


def print_figures(quoted: dict) -> None:
    """The quoted figures of one run, or of `repeats.over_runs`'s spread (median [min, max])."""
    for key, value in quoted.items():
        if isinstance(value, dict):  # per cost model
            value = ", ".join(f"{name} {format_spread(v, '{:.3f}')}" for name, v in value.items())
        else:  # a range [low, high] of one run
            value = " to ".join(format_spread(v, "{:.3f}") for v in value)
        print(f"  {key}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--docs", type=int, default=96, help="documents per global batch")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timings of each document length, the fastest kept (--repeat: whole runs)")
    add_repeat_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wrong", default="3,0.333333,3", help="factors applied to the calibrated a1,b1,g")
    parser.add_argument("--sigma", type=float, default=1.0, help="spread (lognormal sigma) of document lengths")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error(f"--steps must be >= 10 (the figures read the last 10 steps), got {args.steps}")
    torch.set_num_threads(1)

    runs = repeat_measurement(lambda: measure(args), args.repeat, report=lambda _, result: print_run(result))
    combined = over_runs(runs)
    if args.repeat > 1:
        print(f"\nover {args.repeat} runs (each timing its documents afresh): median [min, max]")
        print_figures(combined["spread"]["figures"])
        print(f"  converged from step, run by run: {[run['converged_step'] for run in runs]}")
    result = {
        "command": "python benchmarks/refit_bench.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "shape": dataclasses.asdict(SHAPE), "num_ranks": NUM_RANKS, "capacity": CAPACITY, "steps": args.steps,
        "docs_per_step": args.docs, "sigma": args.sigma, "wrong_factors": [float(x) for x in args.wrong.split(",")],
        "repeats": args.repeats, "window": WINDOW, "tolerance": TOLERANCE,
        **combined,
    }
    write_result(RESULTS / "refit_bench.json", result)
    plot(runs[0]["models"], runs[0]["converged_step"], RESULTS / "refit_bench.png")
    print(f"plotted run 1 of {args.repeat}: {RESULTS / 'refit_bench.png'}")


def plot(runs: dict, step: int | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.2))
    for name, style in (("calibrated", "-"), ("wrong", ":"), ("refit", "o-")):
        balance = runs[name]["balance"]
        left.plot(range(1, len(balance) + 1), balance, style, label=name, ms=3)
    if step is not None:
        left.axvline(step, color="grey", lw=0.8, ls="--", label=f"within 5% from step {step}")
    left.set(title="measured balance (max / mean rank compute)", xlabel="step")
    left.legend()
    for name, style in (("calibrated", "-"), ("wrong", ":"), ("refit", "o-")):
        error = runs[name]["prediction_error"]
        middle.plot(range(1, len(error) + 1), [100 * e for e in error], style, label=name, ms=3)
    middle.set(title="cost model's error on the measured rank times", xlabel="step", ylabel="%", yscale="log")
    middle.legend()
    a1 = runs["calibrated"]["coefficients"][0]["a1"]
    b1 = runs["calibrated"]["coefficients"][0]["b1"]
    coefficients = runs["refit"]["coefficients"]
    steps = range(1, len(coefficients) + 1)
    right.plot(steps, [c["a1"] / a1 for c in coefficients], "o-", ms=3, label="a1 / calibrated")
    right.plot(steps, [c["b1"] / b1 for c in coefficients], "s-", ms=3, label="b1 / calibrated")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(title="refit coefficients", xlabel="step", yscale="log")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
