"""`megatron-hdp simulate`: what HDP buys on a model, cluster, context length and data mix, before a run.

    megatron-hdp simulate --model llama-7b --gpus 1024 --tp 8 --pp 1 [--vpp 1] [--ep 1] --context 2M --dist byted \
        [--global-batch-tokens 32M] [--policies static,megatron-hybrid-cp,megatron-dynamic-cp,naive,balance] \
        [--ring-kind auto|kv|latent] [--steps 4] [--json out.json] [--plot out.png]

Samples global batches from the length mix, plans each with every policy, simulates every step per rank
(`megatron_hdp/sim/simulator.py`) and prints tokens/s, speedup over static, the share of the work floor
and of the critical-path floor each policy reaches (`sim.compare`: the batch's compute over every GPU,
and no less than the longest document's fastest crossing of the pipeline), balance, idle fraction (and
the part of it spent in PP bubbles) and ring-attention traffic. `--vpp N` runs every pipeline stage as N
model chunks in Megatron's interleaved schedule (the default capacity then follows its larger
activation memory). `--plot out.png` writes the per-rank timelines of one step (out.png) and tokens/s
against context length, 256K..2M (out-throughput.png). `--cost-model` takes a `megatron-hdp calibrate`
JSON so that measured kernel timings replace the analytic FLOP model. `megatron-dynamic-cp` runs only with
MEGATRON_LM_DIR set to a Megatron-LM dev checkout; otherwise its row says why it is n/a. `--ep N` shards
the routed experts over N HDP ranks (memory, gradient bytes, and their all-to-all coupling micro-batches).
Multi-latent attention models (deepseek-v3, moonlight-16b-a3b) run each ring as a K/V ring or a latent
ring: `--ring-kind kv` or `latent` forces one for every policy, `auto` (default) lets the cost model pick
per ring call.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from megatron_hdp.commands.arguments import (add_expert_arguments, existing_file, names_from, one_of, parse_count,
                                             policy_names, positive_float, positive_int)

logger = logging.getLogger(__name__)

SWEEP_CONTEXTS = tuple(k * 1024 for k in (256, 512, 1024, 2048))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the simulate subcommand."""
    from megatron_hdp.plan.cost.model import RING_KIND_SETTINGS
    from megatron_hdp.plan.lengths import DISTRIBUTIONS
    from megatron_hdp.plan.cost.presets import HARDWARE, MODELS
    from megatron_hdp.sim.compare import DEFAULT_POLICIES

    policies = policy_names()

    parser.add_argument("--model", type=one_of(sorted(MODELS), "model"), default="llama-7b",
                        help="model preset (plan/cost/presets.py MODELS)")
    parser.add_argument("--gpus", type=positive_int, default=1024, help="GPUs in the cluster")
    parser.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=positive_int, default=1,
                        help="model chunks (virtual pipeline stages) per pipeline stage: Megatron's interleaved "
                             "schedule when > 1 (--num-virtual-stages-per-pipeline-rank)")
    add_expert_arguments(parser)
    parser.add_argument("--ring-kind", type=one_of(RING_KIND_SETTINGS, "ring kind"), default=None,
                        help="K/V ring (kv), multi-latent attention's latent ring (latent), or per ring call the "
                             "faster (auto, the default)")
    parser.add_argument("--hardware", type=one_of(sorted(HARDWARE), "hardware"), default="h100",
                        help="hardware preset (plan/cost/presets.py HARDWARE)")
    parser.add_argument("--context", type=parse_count, default="2M", help="context length: the longest sequence (e.g. 256K, 2M)")
    parser.add_argument("--dist", default="byted", type=one_of(DISTRIBUTIONS, "length mix"),
                        metavar="{" + ",".join(DISTRIBUTIONS) + "}", help="sequence-length mix")
    parser.add_argument("--global-batch-tokens", type=parse_count, default=None,
                        help="tokens per global batch (e.g. 32M); default 4 full micro-batches per HDP rank")
    parser.add_argument("--policies", type=names_from(policies, "policy"), default=list(DEFAULT_POLICIES),
                        help=f"comma-separated policies (default {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--steps", type=positive_int, default=2, help="global batches to simulate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled batches")
    parser.add_argument("--capacity", type=parse_count, default=None, help="tokens per rank per micro-batch (C); default from GPU memory")
    parser.add_argument("--allreduce-bandwidth", type=positive_float, default=None,
                        help="bytes/s per GPU of the gradient all-reduce (default: the hardware's inter-node link)")
    parser.add_argument("--ring-bandwidth", type=positive_float, default=None,
                        help="bytes/s of a ring-attention link (default: the cost model's)")
    parser.add_argument("--cost-model", type=existing_file, default=None,
                        help="cost model JSON from `megatron-hdp calibrate`")
    parser.add_argument("--no-offload", action="store_true", help="plan without selective activation offload")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON ('-': stdout)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="write the step timelines to FILE.png and tokens/s vs context to FILE-throughput.png")


def _check_flags(args: argparse.Namespace) -> None:
    """What depends on several flags, refused naming them (before minutes of simulation)."""
    from megatron_hdp.plan.cost.presets import model_shape

    if args.gpus % (args.tp * args.pp):
        raise ValueError(f"--gpus {args.gpus} is not a multiple of --tp {args.tp} x --pp {args.pp}")
    layers = model_shape(args.model).num_layers
    if layers % args.pp:
        raise ValueError(f"--pp {args.pp} does not divide --model {args.model}'s {layers} layers")
    if args.vpp > 1 and args.pp == 1:
        raise ValueError(f"--vpp {args.vpp} needs pipeline parallelism: set --pp > 1 or --vpp 1")
    if layers % (args.pp * args.vpp):
        raise ValueError(f"--pp {args.pp} x --vpp {args.vpp} does not divide --model {args.model}'s {layers} layers")
    expert_grid = (args.etp or args.tp) * args.ep * args.pp
    if args.gpus % expert_grid:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of --etp {args.etp or args.tp} x --ep {args.ep} x --pp "
                         f"{args.pp} (Megatron's expert grid; then the HDP pool holds whole expert-parallel groups)")
    if args.ring_kind == "latent" and not model_shape(args.model).is_mla:
        raise ValueError(f"--ring-kind latent needs a multi-latent attention model; --model {args.model} is not one")


def capacity_note(spec) -> str:
    """How C follows from GPU memory (`ClusterSpec.memory_budget`), one line."""
    budget = spec.memory_budget()
    experts = spec.shape.expert_parameters()
    sharded = (f"; experts over expert TP {spec.expert_tp_size} x EP {spec.ep_size}, their Adam states over "
               f"{spec.num_gpus // (spec.expert_tp_size * spec.ep_size * spec.pp_size)} expert-data-parallel ranks"
               if experts else "")
    return (f"C from memory: {budget['states_gb']:.1f} GB of model states per GPU (dense weights over TP x PP, Adam "
            f"states over the pool{sharded}) leave {budget['free_gb']:.1f} GB for activations of "
            f"{budget['token_mb']:.2f} MB a token: {budget['fits']:,} tokens fit, rounded down to a power of two, "
            f"C = {budget['capacity']:,} (--capacity sets it)")


def run(args: argparse.Namespace) -> int:
    """Simulate, print the table, write the JSON and plots asked for."""
    from megatron_hdp.sim.cluster import ClusterSpec, format_tokens
    from megatron_hdp.sim.compare import compare_policies, format_table, throughput_sweep

    _check_flags(args)
    spec = ClusterSpec(
        model=args.model, num_gpus=args.gpus, tp_size=args.tp, pp_size=args.pp, vpp_size=args.vpp,
        hardware=args.hardware, ring_kind=args.ring_kind,
        allreduce_bandwidth=args.allreduce_bandwidth, ring_bandwidth=args.ring_bandwidth,
        cost_model_path=args.cost_model,
        capacity=args.capacity, ep_size=args.ep, etp_size=args.etp,
    )
    context, budget = args.context, args.global_batch_tokens
    try:
        spec.check_context(context)
    except ValueError as error:
        raise ValueError(f"--context {format_tokens(context)}: {error}") from None
    policies = args.policies
    options = dict(distribution=args.dist, global_batch_tokens=budget, policies=policies, steps=args.steps,
                   seed=args.seed, offload=not args.no_offload)
    comparison = compare_policies(spec, context=context, **options)
    print(f"{args.model} on {args.gpus} GPUs (TP={args.tp}, PP={args.pp}, VPP={args.vpp}, EP={args.ep}, "
          f"rings {args.ring_kind or 'auto'}, HDP pool {spec.num_ranks} ranks, "
          f"C={spec.rank_capacity}), context {format_tokens(context)}, {args.dist}, "
          f"{comparison.global_batch_tokens:,} tokens per global batch, {args.steps} steps")
    if args.capacity is None:
        print(capacity_note(spec))
    print(format_table(comparison))
    result = comparison.to_dict()
    if args.plot:
        from megatron_hdp.sim.plots import plot_gantt, plot_throughput

        plot_gantt(comparison.timelines, args.plot)
        pool = spec.rank_capacity * spec.num_ranks
        contexts = [c for c in SWEEP_CONTEXTS if c <= pool]
        curve_path = str(Path(args.plot).with_name(Path(args.plot).stem + "-throughput.png"))
        curves = throughput_sweep(spec, contexts=contexts, **options)
        plot_throughput(contexts, curves, curve_path,
                        title=f"{args.model}, {args.gpus} GPUs, TP={args.tp} PP={args.pp}, {args.dist}")
        result["throughput_vs_context"] = {"contexts": contexts, "tokens_per_second": curves}
        print(f"wrote {args.plot} and {curve_path}")
    if args.json:
        text = json.dumps(result, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
            logger.info("wrote %s", args.json)
    return 0
