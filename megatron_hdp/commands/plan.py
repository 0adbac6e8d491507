"""`megatron-hdp plan`: plan one global batch with every policy and compare them side by side.

    megatron-hdp plan --dist byted --tokens 32M --ranks 1024 --capacity 16384 [--pp 1] [--policy balance]
        [--model llama-7b] [--hardware h100] [--tp 1] [--json plan.json] [--plot plans.png]
    megatron-hdp plan --lengths lengths.txt --ranks 64 --capacity 8192

The batch is either a length file (one integer per line; all of it, or a sample of --tokens tokens) or
a mix (`--dist`: byted, github, wikipedia, prolong, wlbllm) sampled to --tokens. Each policy's row
shows the predicted step time, its gap to the lower bound any plan has, balance (max / mean rank
time), rings, micro-batches per rank, ring-attention bytes (TB per step), the sequences that offload
and the planner's wall time (validation included). The plan of
--policy is written as the StepPlan JSON of DESIGN.md (--json) and all plans are drawn (--plot).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text: str) -> int:
    """'32M' -> 33554432, '4096' -> 4096 (binary suffixes K, M, G)."""
    text = str(text).strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count such as 4096, 256K or 32M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the plan subcommand."""
    from megatron_hdp.config import POLICIES
    from megatron_hdp.plan.lengths import DISTRIBUTIONS

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", metavar="FILE", help="file of sequence lengths, one integer per line")
    source.add_argument("--dist", choices=DISTRIBUTIONS, help="length mix to sample the batch from")
    parser.add_argument("--tokens", type=parse_count, default=None,
                        help="global batch tokens to sample (default: the whole --lengths file; 4 x ranks x "
                             "capacity for --dist)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch sample")
    parser.add_argument("--ranks", type=int, required=True, help="HDP ranks D (DP x CP of a static mesh)")
    parser.add_argument("--capacity", type=parse_count, required=True, help="tokens per rank per micro-batch C")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (HDP ranks are then pipelines)")
    parser.add_argument("--policy", choices=POLICIES, default="balance", help="policy whose plan --json writes")
    parser.add_argument("--compare", default=",".join(POLICIES),
                        help="comma-separated policies to tabulate (default: all)")
    parser.add_argument("--model", default="llama-7b", help="model preset of the analytic cost model")
    parser.add_argument("--hardware", default="h100", help="hardware preset of the analytic cost model")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides the cost model)")
    parser.add_argument("--cost-model", default=None, help="cost model JSON from `megatron-hdp calibrate`")
    parser.add_argument("--no-offload", action="store_true", help="no selective offloading (k = ceil(s/C))")
    parser.add_argument("--max-offload-ratio", type=float, default=1.0, help="largest offload ratio allowed")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the --policy plan here")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw every plan's ranks here")


def _batch(args: argparse.Namespace) -> list[int]:
    from megatron_hdp.plan.lengths import read_lengths, sample_global_batch

    if args.lengths:
        lengths = read_lengths(args.lengths)
        if args.tokens is None:
            return lengths.tolist()
        return sample_global_batch(lengths, num_tokens=args.tokens, seed=args.seed)
    tokens = args.tokens or 4 * args.ranks * args.capacity
    return sample_global_batch(args.dist, num_tokens=tokens, seed=args.seed)


def summary_row(plan, *, cost_model, wall_s: float, max_offload_ratio: float = 1.0) -> dict:
    """One table row (and JSON record) of a plan's statistics."""
    from megatron_hdp.plan.bounds import gap

    stats = plan.summary(cost_model)
    return {
        "policy": plan.policy,
        "step_s": plan.est_step_time,
        "gap": gap(plan, cost_model=cost_model, max_offload_ratio=max_offload_ratio),
        "balance": stats.balance,
        "rings": stats.num_rings,
        "max_ring": max(stats.ring_sizes, default=1),
        "microbatches": f"{stats.min_microbatches}-{stats.max_microbatches}",
        "attention_tb": stats.attention_bytes / 1e12,
        "offloaded": sum(1 for s in plan.sequences if s.offload_ratio > 0),
        "plan_ms": 1e3 * wall_s,
    }


def format_table(rows: list[dict]) -> str:
    """The side-by-side table: one line per policy, `n/a: reason` where a policy refused the batch."""
    header = (f"{'policy':<20}{'step (s)':>10}{'vs bound':>10}{'balance':>9}{'rings':>7}{'max ring':>9}"
              f"{'mb/rank':>9}{'ring TB':>10}{'offload':>8}{'plan ms':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['policy']:<20}n/a: {row['error']}")
            continue
        lines.append(
            f"{row['policy']:<20}{row['step_s']:>10.3f}{'+%.1f%%' % (100 * row['gap']):>10}{row['balance']:>9.3f}"
            f"{row['rings']:>7}{row['max_ring']:>9}{row['microbatches']:>9}{row['attention_tb']:>10.2f}"
            f"{row['offloaded']:>8}{row['plan_ms']:>9.1f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan the batch with every policy, print the table, write --json / --plot."""
    from megatron_hdp.config import POLICIES, HDPConfig
    from megatron_hdp.plan.bounds import step_time_lower_bound
    from megatron_hdp.plan.cost_model import CostModel
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.presets import analytic_cost_model

    config = HDPConfig(hdp=True, hdp_capacity=args.capacity, hdp_policy=args.policy,
                       hdp_offload=not args.no_offload, hdp_max_offload_ratio=args.max_offload_ratio,
                       hdp_cost_model=args.cost_model)
    if args.cost_model:
        cost_model = CostModel.from_json(args.cost_model)
    else:
        cost_model = analytic_cost_model(args.model, args.hardware, tp_size=args.tp)
    lengths = _batch(args)
    bound = step_time_lower_bound(lengths, num_ranks=args.ranks, capacity=args.capacity, cost_model=cost_model,
                                  pp_size=args.pp, max_offload_ratio=config.max_offload_ratio)
    print(f"batch: {len(lengths)} sequences, {sum(lengths):,} tokens, longest {max(lengths):,}; "
          f"{args.ranks} ranks x capacity {args.capacity:,}, pp {args.pp}; step-time lower bound {bound:.3f} s")
    compared = [p.strip() for p in args.compare.split(",") if p.strip()]
    unknown = sorted(set(compared) - set(POLICIES))
    if unknown:
        raise ValueError(f"--compare names unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if args.policy not in compared:
        compared.append(args.policy)
    plans, rows = {}, []
    for policy in compared:
        start = time.perf_counter()
        try:
            plan = make_plan(lengths, num_ranks=args.ranks, config=config, cost_model=cost_model,
                             pp_size=args.pp, policy=policy)
        except (ValueError, ImportError) as error:  # a policy that refuses this batch (or is not installed)
            rows.append({"policy": policy, "error": str(error)})
            continue
        plans[policy] = plan
        rows.append(summary_row(plan, cost_model=cost_model, wall_s=time.perf_counter() - start,
                                max_offload_ratio=config.max_offload_ratio))
    print(format_table(rows))
    if args.json:
        if args.policy not in plans:
            logger.error("policy %s produced no plan for this batch; nothing written to %s", args.policy, args.json)
            return 1
        Path(args.json).write_text(json.dumps(plans[args.policy].to_dict()) + "\n")
        print(f"wrote the {args.policy} plan to {args.json}")
    if args.plot:
        from megatron_hdp.sim.plots import plot_plans  # matplotlib only when asked for

        plot_plans(plans, args.plot)
        print(f"wrote {args.plot}")
    return 0
