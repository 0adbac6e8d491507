"""`megatron-hdp plan`: plan one global batch with every policy and compare them side by side.

    megatron-hdp plan --dist byted --tokens 32M --ranks 1024 --capacity 16384 [--pp 1] [--vpp 1] [--policy balance]
        [--model llama-7b] [--hardware h100] [--tp 1] [--ep 1] [--etp TP] [--json plan.json] [--plot plans.png]
    megatron-hdp plan --lengths lengths.txt --ranks 64 --capacity 8192
    megatron-hdp plan --from runs/plans/iter_0000001.json --plot step1.png     # what training ran
    megatron-hdp plan --from runs/plans --plot steps.png                          # a directory of them

The batch is either a length file (one integer per line; all of it, or a sample of --tokens tokens) or
a mix (`--dist`: byted, github, wikipedia, prolong, wlbllm) sampled to --tokens (default 4 x ranks x
capacity, at most 128M tokens). Each policy's row shows the predicted step time, its gap to the lower
bound of the work (`bounds.step_time_lower_bound`) and to the critical-path floor (that bound, or the
longest document's fastest crossing of every pipeline stage when longer: `bounds.critical_path_floor`),
balance (max / mean rank time), the PP bubble (mean seconds a pipeline spends beyond
its micro-batches' time, `--vpp` for Megatron's interleaved schedule), rings, micro-batches per rank,
the padding micro-batches the runtime adds to the plan's own (`pad mb`: a rank without any runs one;
with --ep every member of an EP group runs its group's largest count, with --vpp the counts Megatron's
interleaved schedule needs: `timing.plan_runtime_counts`; balance's unit plans need none under EP, a
rank-by-rank plan it keeps because it times faster may),
ring-attention bytes (TB per step), the rings that are latent rings (multi-latent attention models;
`--ring-kind` forces one kind), the sequences that offload, the ring buffers (`ring MB`: the most
transient memory one ring call takes on a member in one layer's backward, beyond the activations the
capacity holds; a latent ring's up-projected K/V included: `peak_ring_buffer_bytes`) and the planner's
wall time (validation included). A policy whose plan is estimated to exceed --max-shards or --max-plan-seconds is skipped with
its reason. The plan of --policy is written as the StepPlan JSON of docs/architecture.md (--json) and all plans are
drawn (--plot).
`--ep` (and `--etp`) plan and time with Megatron's expert-parallel groups: their HDP ranks run every
micro-batch together (the MoE all-to-all), so `balance` plans each group as a unit (`plan.search.expert_units`).
`--from` reads plans saved by training (`--hdp-save-plans`), summarises and draws them
(`commands/saved_plans.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from megatron_hdp.commands.arguments import (add_expert_arguments, existing_file, existing_path, expert_unit, fraction,
                                             names_from, one_of, parse_count, policy_names, positive_float,
                                             positive_int)

logger = logging.getLogger(__name__)

DEFAULT_MICROBATCHES_PER_RANK = 4
MAX_DEFAULT_TOKENS = 128 << 20
"""The default --dist batch: 4 full micro-batches per rank, but at most 128M tokens (~2 s of balance
planning at 16,384 ranks here; 4 x 16,384 x 16K would be 1B tokens and minutes)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the plan subcommand."""
    from megatron_hdp.plan.cost.model import RING_KIND_SETTINGS
    from megatron_hdp.plan.lengths import DISTRIBUTIONS
    from megatron_hdp.plan.cost.presets import HARDWARE, MODELS

    policies = policy_names()

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", metavar="FILE", type=existing_file,
                        help="file of sequence lengths, one integer per line")
    source.add_argument("--dist", type=one_of(DISTRIBUTIONS, "length mix"), metavar="{" + ",".join(DISTRIBUTIONS) + "}",
                        help="length mix to sample the batch from")
    source.add_argument("--from", dest="saved", metavar="FILE.json|DIR", type=existing_path,
                        help="summarise and draw plans saved by training (--hdp-save-plans): one StepPlan JSON "
                             "or a directory of iter_*.json")
    parser.add_argument("--tokens", type=parse_count, default=None,
                        help="global batch tokens to sample (default: the whole --lengths file; for --dist "
                             "4 x ranks x capacity, at most 128M)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch sample")
    parser.add_argument("--ranks", type=positive_int, default=None,
                        help="HDP ranks D (DP x CP of a static mesh); required with --lengths and --dist")
    parser.add_argument("--capacity", type=parse_count, default=None,
                        help="tokens per rank per micro-batch C; required with --lengths and --dist")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (HDP ranks are then pipelines)")
    parser.add_argument("--vpp", type=positive_int, default=1,
                        help="model chunks (virtual pipeline stages) per pipeline stage: Megatron's interleaved "
                             "schedule when > 1")
    parser.add_argument("--policy", type=one_of(policies, "policy"), metavar="{" + ",".join(policies) + "}",
                        default="balance", help="policy whose plan --json writes")
    everyday = [name for name in policies if name != "optimal"]  # the exact MILP only when named: it takes seconds
    parser.add_argument("--compare", type=names_from(policies, "policy"), default=everyday,
                        help=f"comma-separated policies to tabulate (default: {','.join(everyday)}; `optimal`, "
                             "the exact plan of at most 12 documents on at most 8 ranks, when named)")
    parser.add_argument("--model", type=one_of(sorted(MODELS), "model"), default="llama-7b",
                        help="model preset of the analytic cost model")
    parser.add_argument("--hardware", type=one_of(sorted(HARDWARE), "hardware"), default="h100",
                        help="hardware preset (plan/cost/presets.py: FLOP/s, links, NVLink domain) of the cost model")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (divides the cost model)")
    parser.add_argument("--ring-kind", type=one_of(RING_KIND_SETTINGS, "ring kind"), default=None,
                        help="K/V ring (kv), multi-latent attention's latent ring (latent), or per ring call the "
                             "faster (default: auto)")
    add_expert_arguments(parser)
    parser.add_argument("--ranks-per-node", type=positive_int, default=None,
                        help="HDP ranks per node (default: the hardware's NVLink domain / --tp: 8 / TP, 72 / TP on "
                        "gb200): rings are "
                        "placed inside a node when they fit, and a ring that crosses nodes runs at the network's speed")
    parser.add_argument("--cost-model", type=existing_file, default=None,
                        help="cost model JSON from `megatron-hdp calibrate`")
    parser.add_argument("--no-offload", action="store_true", help="no selective offloading (k = ceil(s/C))")
    parser.add_argument("--max-offload-ratio", type=fraction, default=1.0, help="largest offload ratio allowed")
    parser.add_argument("--max-shards", type=positive_int, default=1_000_000,
                        help="skip a policy whose plan would hold more shards (~0.6 KB each while planned)")
    parser.add_argument("--max-plan-seconds", type=positive_float, default=20.0,
                        help="skip a policy whose planning is estimated to take longer")
    parser.add_argument("--plot-steps", type=positive_int, default=4,
                        help="with --from DIR: how many steps --plot draws side by side (evenly spaced)")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the --policy plan here")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="draw every plan's ranks here")


def _batch(args: argparse.Namespace) -> tuple[list[int], str]:
    """The global batch's lengths, and a note on where its size came from."""
    from megatron_hdp.plan.lengths import read_lengths, sample_global_batch

    if args.lengths:
        lengths = read_lengths(args.lengths)
        if len(lengths) == 0:
            raise ValueError(f"--lengths {args.lengths}: the file holds no lengths")
        if args.tokens is None:
            return lengths.tolist(), "the whole --lengths file"
        return sample_global_batch(lengths, num_tokens=args.tokens, seed=args.seed), "--tokens"
    if args.tokens is not None:
        return sample_global_batch(args.dist, num_tokens=args.tokens, seed=args.seed), "--tokens"
    tokens = DEFAULT_MICROBATCHES_PER_RANK * args.ranks * args.capacity
    note = f"default: {DEFAULT_MICROBATCHES_PER_RANK} x ranks x capacity"
    if tokens > MAX_DEFAULT_TOKENS:
        tokens, note = MAX_DEFAULT_TOKENS, f"default: capped at {MAX_DEFAULT_TOKENS >> 20}M tokens, set --tokens for more"
    return sample_global_batch(args.dist, num_tokens=tokens, seed=args.seed), note


def summary_row(plan, *, cost_model, wall_s: float, bound: float, critical: float) -> dict:
    """One table row (and JSON record) of a plan's statistics; `bound` is the batch's step-time lower bound
    of the work, `critical` its critical-path floor."""
    from megatron_hdp.plan.timeline.timing import plan_runtime_counts

    stats = plan.summary(cost_model)
    padding = sum(plan_runtime_counts(plan, ep_size=cost_model.expert_parallel_size)) - sum(
        len(r.microbatches) for r in plan.ranks)
    return {
        "policy": plan.policy,
        "step_s": plan.est_step_time,
        "gap": plan.est_step_time / bound - 1.0 if bound > 0 else 0.0,
        "critical_path_gap": plan.est_step_time / critical - 1.0 if critical > 0 else 0.0,
        "balance": stats.balance,
        "rings": stats.num_rings,
        "max_ring": max(stats.ring_sizes, default=1),
        "microbatches": f"{stats.min_microbatches}-{stats.max_microbatches}",
        "padding": padding,
        "bubble_s": pipeline_bubble(plan),
        "attention_tb": stats.attention_bytes / 1e12,
        "latent_rings": stats.latent_rings,
        "rings_across_nodes": stats.rings_across_nodes,
        "network_tb": stats.network_bytes / 1e12,
        "offloaded": sum(1 for s in plan.sequences if s.offload_ratio > 0),
        "ring_buffer_mb": peak_ring_buffer_bytes(plan, cost_model) / 1e6,
        "plan_ms": 1e3 * wall_s,
    }


def peak_ring_buffer_bytes(plan, cost_model) -> float:
    """The most transient device memory one ring call of the plan takes on a member in one layer's backward
    (`CostModel.layer_ring_buffer_bytes`: buffers of what circulates and of its gradient partials, and for
    a latent ring the up-projected K/V of a block), over every rank, micro-batch and ring call: memory a
    rank needs beyond its micro-batch's activations (the rings of one micro-batch run one after another)."""
    by_id = {seq.id: seq for seq in plan.sequences}
    peak = 0.0
    for rank in plan.ranks:
        for microbatch in rank.microbatches:
            calls: dict[tuple, int] = {}  # (ring, kind) -> this member's tokens in that ring call
            for shard in microbatch.shards:
                seq = by_id[shard.seq]
                if len(seq.ring) > 1:
                    calls[seq.ring, seq.ring_kind] = calls.get((seq.ring, seq.ring_kind), 0) + shard.num_tokens
            for (ring, kind), tokens in calls.items():
                peak = max(peak, cost_model.layer_ring_buffer_bytes(num_tokens=tokens, ring_size=len(ring), kind=kind))
    return peak


def pipeline_bubble(plan) -> float:
    """Predicted PP bubble: the mean over pipelines of their makespan (`RankSchedule.est_time`, Megatron's
    pipeline order) minus their micro-batches' time (the runtime's padding micro-batches count as bubble);
    0 without PP."""
    if plan.pp_size == 1:
        return 0.0
    return sum(r.est_time - sum(mb.est_time for mb in r.microbatches) for r in plan.ranks) / plan.num_ranks


def format_table(rows: list[dict]) -> str:
    """The side-by-side table: one line per policy, `n/a: reason` where a policy refused the batch."""
    header = (f"{'policy':<20}{'step (s)':>10}{'vs bound':>10}{'vs crit.':>10}{'balance':>9}{'bubble s':>9}{'rings':>7}"
              f"{'max ring':>9}{'mb/rank':>9}{'pad mb':>8}{'ring TB':>10}{'latent':>7}{'x-node':>8}{'net TB':>9}{'offload':>8}"
              f"{'ring MB':>9}{'plan ms':>9}")
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['policy']:<20}n/a: {row['error']}")
            continue
        lines.append(
            f"{row['policy']:<20}{row['step_s']:>10.3f}{'+%.1f%%' % (100 * row['gap']):>10}"
            f"{'+%.1f%%' % (100 * row['critical_path_gap']):>10}{row['balance']:>9.3f}"
            f"{row['bubble_s']:>9.3f}{row['rings']:>7}{row['max_ring']:>9}{row['microbatches']:>9}{row['padding']:>8}"
            f"{row['attention_tb']:>10.2f}{row['latent_rings']:>7}"
            f"{row['rings_across_nodes']:>8}{row['network_tb']:>9.2f}{row['offloaded']:>8}{row['ring_buffer_mb']:>9.1f}"
            f"{row['plan_ms']:>9.1f}"
        )
    return "\n".join(lines)


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations argparse cannot express, naming the flags."""
    if args.saved:
        given = [f for f, v in (("--tokens", args.tokens), ("--json", args.json)) if v is not None]
        if given:
            raise ValueError(f"--from draws saved plans; {', '.join(given)} only apply to --lengths/--dist")
        return
    if args.vpp > 1 and args.pp == 1:
        raise ValueError(f"--vpp {args.vpp} needs pipeline parallelism: set --pp > 1 or --vpp 1")
    missing = [flag for flag, value in (("--ranks", args.ranks), ("--capacity", args.capacity)) if value is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required with "
                         f"{'--lengths' if args.lengths else '--dist'}")
    expert_unit(args, num_ranks=args.ranks)


def run(args: argparse.Namespace) -> int:
    """Plan the batch with every policy (or read saved plans), print the table, write --json / --plot."""
    _check_flags(args)
    if args.saved:
        from megatron_hdp.commands.saved_plans import show_saved_plans

        return show_saved_plans(args.saved, plot=args.plot, plot_steps=args.plot_steps)
    from tqdm import tqdm

    from megatron_hdp.commands.plan_budget import estimate_plan
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.plan.timeline.bounds import critical_path_floor, fastest_crossing, step_time_lower_bound
    from megatron_hdp.plan.cost.mesh import mesh_cost_model
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.policies.milp import native_stdout_silenced

    config = HDPConfig(hdp=True, hdp_capacity=args.capacity, hdp_policy=args.policy,
                       hdp_offload=not args.no_offload, hdp_max_offload_ratio=args.max_offload_ratio,
                       hdp_cost_model=args.cost_model)
    try:
        cost_model = mesh_cost_model(model=args.model, hardware=args.hardware, tp_size=args.tp, ep_size=args.ep,
                                     etp_size=args.etp, ranks_per_node=args.ranks_per_node, ring_kind=args.ring_kind,
                                     measured=args.cost_model)
    except ValueError as error:  # name the flag when the ring kind is what the model cannot run
        raise ValueError(f"--ring-kind {args.ring_kind}: {error}" if "ring_kind" in str(error) else str(error)) from None
    lengths, batch_note = _batch(args)
    bound = step_time_lower_bound(lengths, num_ranks=args.ranks, capacity=args.capacity, cost_model=cost_model,
                                  pp_size=args.pp, max_offload_ratio=config.max_offload_ratio)
    crossing, crossing_ring = fastest_crossing(max(lengths), num_ranks=args.ranks, cost_model=cost_model,
                                               pp_size=args.pp)
    critical = critical_path_floor(bound, lengths, num_ranks=args.ranks, cost_model=cost_model, pp_size=args.pp)
    print(f"batch: {len(lengths)} sequences, {sum(lengths):,} tokens ({batch_note}), longest {max(lengths):,}; "
          f"{args.ranks} ranks x capacity {args.capacity:,}, pp {args.pp}, vpp {args.vpp}, hardware {args.hardware} "
          f"({cost_model.ranks_per_node} HDP ranks per node); step-time lower bound "
          f"{bound:.3f} s (work), critical-path floor {critical:.3f} s (the longest document crosses the "
          f"pipeline in {crossing:.3f} s at best, on a ring of {crossing_ring})")
    compared = list(args.compare)
    if args.policy not in compared:
        compared.append(args.policy)
    plans, rows = {}, []
    progress = tqdm(compared, desc="planning", unit="policy", delay=2.0, disable=None, file=sys.stderr, leave=False)
    for policy in progress:
        progress.set_postfix_str(policy)
        estimate = estimate_plan(policy, lengths, num_ranks=args.ranks, capacity=args.capacity)
        refusal = estimate.refusal(max_shards=args.max_shards, max_seconds=args.max_plan_seconds)
        if refusal:
            rows.append({"policy": policy, "error": refusal})
            continue
        start = time.perf_counter()
        quiet = native_stdout_silenced() if policy == "optimal" else contextlib.nullcontext()  # HiGHS's stray line
        try:
            with quiet:
                plan = make_plan(lengths, num_ranks=args.ranks, config=config, cost_model=cost_model,
                                 pp_size=args.pp, vpp_size=args.vpp, policy=policy)
        except (ValueError, ImportError) as error:  # a policy that refuses this batch (or is not installed)
            rows.append({"policy": policy, "error": str(error)})
            continue
        plans[policy] = plan
        rows.append(summary_row(plan, cost_model=cost_model, wall_s=time.perf_counter() - start, bound=bound,
                                critical=critical))
    progress.close()
    print(format_table(rows))
    if args.json:
        if args.policy not in plans:
            raise ValueError(f"--policy {args.policy} produced no plan for this batch; nothing written to {args.json}")
        Path(args.json).write_text(json.dumps(plans[args.policy].to_dict()) + "\n")
        print(f"wrote the {args.policy} plan to {args.json}")
    if args.plot:
        if not plans:
            raise ValueError(f"no policy produced a plan of this batch; nothing drawn to --plot {args.plot}")
        from megatron_hdp.sim.plots import plot_plans  # matplotlib only when asked for

        plot_plans(plans, args.plot)
        print(f"wrote {args.plot}")
    return 0
