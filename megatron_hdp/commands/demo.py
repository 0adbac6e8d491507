"""`megatron-hdp demo`: train a tiny Llama-style GPT (RoPE, GQA, SwiGLU) with HDP on gloo CPU ranks.

The same Megatron-Core model, trainer and global batches (documents of a Megatron indexed dataset with
a long-tailed length mix, written to --data-dir, read by the HDP loader) run under the HDP
`balance` plan and under the static DP x CP layout; per step it prints loss, step time, balance (slowest
rank's compute / mean), rings and measured ring-attention bytes, side by side.

Step time is that of a cluster with one core per rank (each rank's measured CPU seconds composed through
the plan's ring waits, as `benchmarks/step_bench.py` measures it, see `megatron_hdp.harness.cpu_training`);
wall time, next to it, is the total work of all ranks on this host's shared cores. Each reported step runs
`--timing-repeats` times and every phase keeps its fewest CPU seconds, as the cost-model fit does: one run
on a shared host is inflated by whatever else runs there (benchmarks/results/observations.json, entry
"single-run-inflation"), and a ring waits for its slowest member, so a single run measures the
neighbours too.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
from typing import TYPE_CHECKING

from megatron_hdp.commands.arguments import names_from, parse_count, policy_names, positive_float, positive_int

if TYPE_CHECKING:
    from megatron_hdp.harness.cpu_training import CpuRunSpec

logger = logging.getLogger(__name__)


def at_least_two(text: str) -> int:
    """--ranks: rings need two ranks at least."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 for rings to exist, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the demo subcommand."""
    policies = policy_names()

    parser.add_argument("--ranks", type=at_least_two, default=4, help="gloo CPU ranks (the HDP domain), >= 2")
    parser.add_argument("--steps", type=positive_int, default=3, help="reported training steps per policy")
    parser.add_argument("--capacity", type=parse_count, default=512, help="tokens per rank per micro-batch (C)")
    parser.add_argument("--tokens-per-step", type=parse_count, default=8192, help="tokens of each global batch")
    parser.add_argument("--policies", type=names_from(policies, "policy"), default=["balance", "static"],
                        help="comma-separated planner policies (default balance,static)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-repeats", type=positive_int, default=3,
                        help="runs of each reported step; each phase of each rank keeps its fewest CPU seconds, as "
                             "the cost-model fit does (other processes on the host inflate single runs), for every "
                             "policy alike")
    parser.add_argument("--timeout", type=positive_float, default=900.0, help="seconds before the ranks are stopped")
    parser.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "megatron_hdp_demo"),
                        help="where the demo's Megatron indexed dataset (a seeded synthetic corpus) is written")


def format_rows(rows: list[dict]) -> str:
    """The per-step table, policies side by side for each step."""
    header = (f"{'step':>4} {'policy':<20} {'loss':>8} {'step s':>8} {'pred s':>8} {'wall s':>8} {'balance':>8} "
              f"{'rings':>6} {'ring sizes':<16} {'attn MiB':>9}")
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: (r["step"], r["policy"])):
        sizes = ",".join(f"{k}x{v}" for k, v in sorted(row["ring_sizes"].items(), key=lambda kv: int(kv[0]))) or "-"
        lines.append(
            f"{row['step']:>4} {row['policy']:<20} {row['loss']:>8.4f} {row['step_time']:>8.3f} "
            f"{row['predicted_time']:>8.3f} {row['wall_time']:>8.3f} {row['balance']:>8.2f} {row['num_rings']:>6} "
            f"{sizes:<16} "
            f"{row['attention_bytes'] / 2**20:>9.2f}"
        )
    return "\n".join(lines)


def demo_spec(args: argparse.Namespace) -> CpuRunSpec:
    """What the demo trains for its parsed flags `args`: the `CpuRunSpec`, reading the demo's corpus (a
    Megatron indexed dataset written under --data-dir when not there yet) through the HDP loader."""
    from megatron_hdp.harness.build_dataset import build_demo_dataset
    from megatron_hdp.harness.cpu_training import CpuRunSpec
    from megatron_hdp.harness.exactness import VOCAB_SIZE

    spec = CpuRunSpec(policies=tuple(args.policies), steps=args.steps, capacity=args.capacity,
                      tokens_per_step=args.tokens_per_step, seed=args.seed, timing_repeats=args.timing_repeats)
    prefix = build_demo_dataset(args.data_dir, vocab_size=VOCAB_SIZE, max_length=spec.max_length, seed=args.seed)
    return dataclasses.replace(spec, data_prefix=prefix)


def run(args: argparse.Namespace) -> int:
    """Launch the ranks, print the table and the mean step time per policy."""
    from megatron_hdp.harness.cpu_training import silence_megatron_warnings, train_policies

    silence_megatron_warnings()  # before Megatron is imported here (the ranks do the same for themselves)
    from megatron_hdp.comm.launch import run_gloo

    spec = demo_spec(args)
    logger.info("training %d steps per policy on %d gloo ranks: %s", spec.steps, args.ranks, dataclasses.asdict(spec))
    result = run_gloo(train_policies, args.ranks, spec, timeout_s=args.timeout)[0]
    print(format_rows(result["rows"]))
    print("\nstep s: one core per rank (measured CPU time + ring waits); wall s: this host's shared cores;\n"
          "pred s: simulator + the measured step overhead it does not model (plan check, collation, optimizer)")
    for policy in spec.policies:
        rows = [r for r in result["rows"] if r["policy"] == policy]
        step = sum(r["step_time"] for r in rows) / len(rows)
        wall = sum(r["wall_time"] for r in rows) / len(rows)
        print(f"{policy:<20} mean step time {step:.3f} s (wall {wall:.3f} s)")
    return 0
