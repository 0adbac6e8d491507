"""HDP loader on a 1M-document Megatron indexed dataset: index open, sampling and planning latency per
step, read + collate throughput, and how much of it a simulated training step hides.

    python benchmarks/loader_bench.py                       # 1M documents, 64 ranks, 1M-token batches
    python benchmarks/loader_bench.py --num-docs 100000 --steps 5

The corpus (`megatron_hdp.harness.build_dataset`, long-tailed: lognormal median 128 tokens plus 0.1% of
documents of 16K-64K) is written once with megatron-core's IndexedDatasetBuilder under --data-dir and
reused. Planning uses `make_plan` (policy --policy) for --num-ranks HDP ranks of --capacity tokens with
the analytic Llama-7B cost model. Loading is measured for every rank of the pool, one after the other
in this process (read only its shards' token ranges from the mmap'd .bin, collate THD micro-batches);
the .bin was just written, so reads hit the page cache — a cold read is bound by the disk instead.
Overlap: rank 0's loader produces ahead — in a background thread, or in a DataLoader worker process —
while the main thread runs a simulated step (1-thread matmuls for --step-seconds, which release the GIL
like GPU work, plus --python-ops tiny tensor ops, which hold it like the Python that launches kernels);
reported: the step's time next to its time alone (what the loader costs the step) and what `next` still
waited for (the loader time the step did not hide). Results go to benchmarks/results/loader_bench.json
with the command and the date. `--repeat N` runs all of it (the corpus written once) N times and reports
median and range over the runs (`repeats.py`); the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader
from megatron_hdp.harness.build_dataset import synthetic_documents, synthetic_lengths
from megatron_hdp.megatron.datasets.sources import IndexedDocumentSource, write_indexed_dataset
from megatron_hdp.plan.cost.presets import analytic_cost_model
from output import write_result
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement

RESULTS = Path(__file__).resolve().parent / "results" / "loader_bench.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-docs", type=int, default=1_000_000)
    parser.add_argument("--data-dir", default="/tmp/hdp_loader_bench")
    parser.add_argument("--num-ranks", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--batch-tokens", type=int, default=1 << 20, help="hdp_global_batch_tokens")
    parser.add_argument("--policy", default="balance")
    parser.add_argument("--steps", type=int, default=20, help="steps timed for planning and loading")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="simulated step: seconds of matmuls")
    parser.add_argument("--python-ops", type=int, default=20000, help="simulated step: tiny GIL-bound tensor ops")
    parser.add_argument("--overlap-steps", type=int, default=10)
    add_repeat_argument(parser)
    parser.add_argument("--output", default=str(RESULTS))
    return parser.parse_args(argv)


def corpus(args: argparse.Namespace) -> tuple[str, float]:
    """The benchmark's indexed dataset (written when missing) and the seconds writing it took (0 if reused)."""
    prefix = os.path.join(args.data_dir, f"bench_{args.num_docs}docs")
    if os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
        return prefix, 0.0
    start = time.perf_counter()
    lengths = synthetic_lengths(args.num_docs, seed=0, median=128, long_fraction=0.001, max_length=65536)
    write_indexed_dataset(prefix, synthetic_documents(lengths, vocab_size=32000, seed=0), vocab_size=32000)
    return prefix, time.perf_counter() - start


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "max": max(values)}


def simulated_step(seconds: float, python_ops: int) -> Callable[[], None]:
    """A training step stand-in: `seconds` of 1-thread matmuls (GIL released, like GPU kernels running)
    plus `python_ops` tiny tensor ops (GIL held, like the Python that launches kernels)."""
    a, tiny = torch.randn(512, 512), torch.zeros(8)
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    repeats = max(1, round(seconds / ((time.perf_counter() - start) / 10)))

    def step() -> None:
        for _ in range(repeats):
            a @ a
        for _ in range(python_ops):
            tiny.add_(1.0)

    return step


def overlap(make_loader: Callable[..., HDPDataLoader], step: Callable[[], None], num_steps: int, **options) -> dict:
    """Step time and exposed wait per step with the loader producing ahead (`options`: prefetch/workers)."""
    step_s, waits = [], []
    with make_loader(**options) as loader:
        next(loader)  # the first step cannot be hidden: nothing ran before it
        for _ in range(num_steps):
            start = time.perf_counter()
            step()
            step_s.append(time.perf_counter() - start)
            waited = loader.wait_seconds
            next(loader)
            waits.append(loader.wait_seconds - waited)
    return {"step_seconds": stats(step_s), "exposed_wait_seconds": stats(waits)}


def measure(args: argparse.Namespace, prefix: str, config: HDPConfig, cost_model) -> dict:
    """One run: open the index, then sampling, planning and every rank's reads step by step in the
    foreground, then rank 0's loader producing ahead of a simulated step (thread, worker process)."""
    start = time.perf_counter()
    source = IndexedDocumentSource(prefix)
    open_seconds = time.perf_counter() - start
    start = time.perf_counter()
    loader = HDPDataLoader(source, rank=0, num_ranks=args.num_ranks, config=config, cost_model=cost_model, seed=0)
    init_seconds = time.perf_counter() - start

    # Sampling, planning, and every rank's reads + collation, step by step, in the foreground.
    sample_s, plan_s, load_s, tokens, docs = [], [], [], 0, 0
    bytes_before = source.bytes_read
    consumed = 0
    for _ in range(args.steps):
        start = time.perf_counter()
        batch = loader.sampler.batch_at(consumed)
        sample_s.append(time.perf_counter() - start)
        consumed = batch.next_consumed_samples
        start = time.perf_counter()
        plan = loader.plan(batch)
        plan_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for rank in range(args.num_ranks):
            loader.load(plan, loader.reader(batch.sample_ids), rank=rank)
        load_s.append(time.perf_counter() - start)
        tokens += plan.num_tokens
        docs += batch.num_samples
    read_ratio = (source.bytes_read - bytes_before) / (tokens * source.itemsize)

    # Overlap: rank 0's loader producing ahead while the main thread runs a simulated step.
    step = simulated_step(args.step_seconds, args.python_ops)
    alone = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        alone.append(time.perf_counter() - start)
    serial = []
    for _ in range(3):
        start = time.perf_counter()
        batch = loader.sampler.batch_at(consumed)
        loader.load(loader.plan(batch), loader.reader(batch.sample_ids))
        serial.append(time.perf_counter() - start)

    def make_loader(**options) -> HDPDataLoader:
        return HDPDataLoader(source, rank=0, num_ranks=args.num_ranks, config=config, cost_model=cost_model, seed=0,
                             consumed_samples=consumed, **options)

    return {
        "setup": {"num_docs": int(source.lengths.size), "corpus_tokens": int(source.lengths.sum() + source.lengths.size),
                  "num_ranks": args.num_ranks, "capacity": args.capacity, "batch_tokens": args.batch_tokens,
                  "policy": args.policy, "steps": args.steps},
        "index": {"open_seconds": open_seconds, "loader_init_seconds": init_seconds},
        "per_step": {
            "documents": docs / args.steps,
            "tokens": tokens / args.steps,
            "sample_seconds": stats(sample_s),
            "plan_seconds": stats(plan_s),
            "load_all_ranks_seconds": stats(load_s),
            "load_one_rank_seconds": statistics.fmean(load_s) / args.num_ranks,
        },
        "throughput": {
            "tokens_per_second_all_ranks_one_process": tokens / sum(load_s),
            "tokens_per_second_with_planning": tokens / (sum(load_s) + sum(plan_s)),
            "bytes_read_over_plan_tokens": read_ratio,
        },
        "overlap": {
            "simulated_step": {"matmul_seconds": args.step_seconds, "python_ops": args.python_ops,
                               "seconds_alone": statistics.fmean(alone)},
            "serial_plan_and_load_seconds": statistics.fmean(serial),
            "thread": overlap(make_loader, step, args.overlap_steps, prefetch=1),
            "worker process": overlap(make_loader, step, args.overlap_steps, workers=1),
        },
    }


def print_result(result: dict) -> None:
    """The table of one run, or of `repeats.over_runs`'s spread (median [min, max] where a figure varied)."""
    per, overlapped = result["per_step"], result["overlap"]
    ms = lambda figure, fmt="{:.1f}": format_spread(figure, fmt, scale=1e3)  # noqa: E731
    rows = [
        ("documents in index", f"{result['setup']['num_docs']:,}"),
        ("open index (s)", format_spread(result["index"]["open_seconds"], "{:.3f}")),
        ("loader init: lengths, pool limit (s)", format_spread(result["index"]["loader_init_seconds"], "{:.3f}")),
        ("documents / tokens per step", f"{format_spread(per['documents'], '{:.0f}')} / "
                                        f"{format_spread(per['tokens'], '{:,.0f}')}"),
        ("sample batch per step (ms, mean)", ms(per["sample_seconds"]["mean"], "{:.2f}")),
        (f"plan per step, {result['setup']['policy']} (ms, mean / p50 / max)",
         f"{ms(per['plan_seconds']['mean'])} / {ms(per['plan_seconds']['p50'])} / {ms(per['plan_seconds']['max'])}"),
        (f"read + collate, all {result['setup']['num_ranks']} ranks (ms/step)", ms(per["load_all_ranks_seconds"]["mean"])),
        ("read + collate, one rank (ms/step)", ms(per["load_one_rank_seconds"], "{:.2f}")),
        ("loader throughput (M tokens/s)",
         format_spread(result["throughput"]["tokens_per_second_all_ranks_one_process"], "{:.1f}", scale=1e-6)),
        ("bytes read / plan tokens x itemsize", format_spread(result["throughput"]["bytes_read_over_plan_tokens"], "{:.4f}")),
        ("rank 0: plan + load in the step's thread (ms/step)", ms(overlapped["serial_plan_and_load_seconds"])),
        ("simulated step alone (ms)", ms(overlapped["simulated_step"]["seconds_alone"])),
    ]
    for mode in ("thread", "worker process"):
        rows += [
            (f"  {mode}: step with loader running (ms)", ms(overlapped[mode]["step_seconds"]["mean"])),
            (f"  {mode}: exposed wait per step (ms, mean / p50)",
             f"{ms(overlapped[mode]['exposed_wait_seconds']['mean'], '{:.2f}')} / "
             f"{ms(overlapped[mode]['exposed_wait_seconds']['p50'], '{:.2f}')}"),
        ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    config = HDPConfig(hdp_capacity=args.capacity, hdp_global_batch_tokens=args.batch_tokens, hdp_policy=args.policy)
    cost_model = analytic_cost_model("llama-7b")
    prefix, build_seconds = corpus(args)
    print(f"write index (s): {f'{build_seconds:.1f}' if build_seconds else 'reused'}")
    runs = repeat_measurement(lambda: measure(args, prefix, config, cost_model), args.repeat,
                              report=lambda _, result: print_result(result))
    combined = over_runs(runs)
    if args.repeat > 1:
        print(f"\nover {args.repeat} runs: median [min, max]")
        print_result(combined["spread"])
    write_result(args.output, {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/loader_bench.py " + " ".join(argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "index_build_seconds": build_seconds,
        **combined,
    }, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
