"""HDP's Megatron-LM flags and the checks that reject flag combinations HDP cannot run.

`add_hdp_args` is an `extra_args_provider`: it adds one argument group generated from `HDPConfig` by
Megatron's own `ArgumentGroupFactory` (field name = flag name, field docstring = help), so the planner,
the CLI and Megatron read the same fields. `validate_hdp_args` runs after Megatron's `validate_args`
(it needs the derived `data_parallel_size`) and before anything distributed starts, so a bad
combination stops every rank with the same ValueError instead of a hang.
"""

import contextlib
import dataclasses
import json
import logging
import os
from argparse import ArgumentParser, Namespace
from pathlib import Path
from typing import Callable, Optional

from megatron_hdp.config import HDPConfig
from megatron_hdp.data import quantization
from megatron_hdp.megatron.comparison.dynamic_cp import scheduler_checkout
from megatron_hdp.megatron.layers.options import flag_name as _flag
from megatron_hdp.megatron.layers.options import flag_problems
from megatron_hdp.megatron.compat.versions import require_megatron_training
from megatron_hdp.plan.planner import KV_RING_ONLY_POLICIES

require_megatron_training()

from megatron.training.argument_utils import ArgumentGroupFactory  # noqa: E402

logger = logging.getLogger(__name__)

GROUP_TITLE = "hybrid data parallelism (megatron_hdp)"


def add_hdp_args(
    parser: ArgumentParser, *, then: Optional[Callable[[ArgumentParser], ArgumentParser]] = None
) -> ArgumentParser:
    """Add the `--hdp*` flags to Megatron's parser; usable as `extra_args_provider`.

    `then` chains another provider (e.g. ModelOpt's `add_modelopt_args`), since Megatron takes only one.
    """
    ArgumentGroupFactory(HDPConfig).build_group(parser, title=GROUP_TITLE)
    return then(parser) if then is not None else parser


_USED_WITHOUT_HDP = ("hdp", "hdp_mock_mix")
"""Fields that act without --hdp (the mock mix shapes a plain run's data too, so the two compare)."""


def _warn_ignored(args: Namespace) -> None:
    """HDP is off: say once which --hdp-* flags were given for nothing."""
    changed = [
        _flag(f.name)
        for f in dataclasses.fields(HDPConfig)
        if f.name not in _USED_WITHOUT_HDP and hasattr(args, f.name) and getattr(args, f.name) != f.default
    ]
    if changed:
        logger.warning("HDP is off (no --hdp): ignoring %s", ", ".join(changed))


def _incompatibilities(args: Namespace, config: HDPConfig) -> list[str]:
    """One message per flag combination that cannot run with --hdp, each saying what to change."""
    problems = []
    if args.context_parallel_size > 1:
        problems.append(
            f"--context-parallel-size {args.context_parallel_size}: HDP replaces context parallelism (it decides "
            "per sequence how many data-parallel ranks hold it); use --context-parallel-size 1 and fold those "
            "ranks into data parallelism"
        )
    for flag in ("hybrid_context_parallel", "dynamic_context_parallel"):  # the second: newer Megatron-LM
        if getattr(args, flag, False):
            problems.append(
                f"{_flag(flag)}: Megatron's dynamic context parallelism and HDP both re-plan the data-parallel "
                f"group per step; drop {_flag(flag)} (HDP already sizes a ring per sequence; Megatron's "
                "hybrid-CP scheduler is available as --hdp-policy megatron-hybrid-cp)"
            )
    if not args.calculate_per_token_loss:
        problems.append(
            "missing --calculate-per-token-loss: ranks hold different numbers of tokens, so HDP's loss is the "
            "token sum over the global batch divided by its token count; add --calculate-per-token-loss"
        )
    if args.micro_batch_size != 1:
        problems.append(
            f"--micro-batch-size {args.micro_batch_size}: an HDP micro-batch is one packed (THD) sequence of up "
            "to --hdp-capacity tokens; use --micro-batch-size 1 and size micro-batches with --hdp-capacity"
        )
    if args.num_experts and args.expert_model_parallel_size > 1 and args.moe_token_dispatcher_type == "allgather":
        problems.append(
            f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size "
            f"{args.expert_model_parallel_size}: the allgather dispatcher gathers equal-sized token buffers from "
            "every rank of an expert-parallel group, and HDP's ranks hold their own token counts in a micro-batch "
            "(a collective size mismatch); use --moe-token-dispatcher-type alltoall"
        )
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        problems.append(
            "--overlap-moe-expert-parallel-comm: Megatron's combined 1F1B schedule builds each micro-batch's "
            "forward from the model's own schedule plan (forward_step(..., return_schedule_plan=True)), not from "
            "HDP's forward step with its packed documents and rings; drop --overlap-moe-expert-parallel-comm"
        )
    if args.rampup_batch_size is not None:
        problems.append(
            "--rampup-batch-size: HDP's micro-batch counts come from each step's plan; drop --rampup-batch-size "
            "(ramp --hdp-global-batch-tokens in stages instead)"
        )
    if args.use_megatron_fsdp or args.use_torch_fsdp2:
        problems.append(
            "--use-megatron-fsdp / --use-torch-fsdp2: FSDP gathers parameters over the data-parallel group in "
            "every micro-batch, and HDP ranks run different numbers of micro-batches; use Megatron DDP "
            "(optionally --use-distributed-optimizer)"
        )
    if args.cuda_graph_impl != "none":
        problems.append(
            f"CUDA graphs (--cuda-graph-impl {args.cuda_graph_impl}, or the deprecated --enable-cuda-graph / "
            "--external-cuda-graph): a graph replays fixed tensor shapes, and every HDP micro-batch has its own "
            "token count and its own ring P2P; drop the CUDA-graph flag"
        )
    if args.tp_comm_overlap:
        problems.append(
            "--tp-comm-overlap: Transformer Engine's userbuffers are allocated for a fixed --seq-length x "
            "--micro-batch-size token count, and HDP micro-batches vary in size; drop --tp-comm-overlap"
        )
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and config.hdp_capacity % tp:
        problems.append(
            f"--hdp-capacity {config.hdp_capacity} with --sequence-parallel: a micro-batch's tokens are split "
            f"over the {tp} tensor-parallel ranks; use a multiple of --tensor-model-parallel-size {tp}"
        )
    problems += quantization.problems(args) + _expert_problems(args)
    if config.hdp_policy == "megatron-hybrid-cp" and args.pipeline_model_parallel_size > 1:
        problems.append(
            "--hdp-policy megatron-hybrid-cp with --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size}: Megatron's hybrid-CP scheduler has no pipeline support; "
            "use --hdp-policy balance"
        )
    if config.hdp_policy == "megatron-dynamic-cp":
        try:
            scheduler_checkout()
        except ValueError as error:
            problems.append(f"--hdp-policy megatron-dynamic-cp: {error}")
    problems += _ring_kind_problems(args, config)
    if config.hdp_cost_model is not None and not os.path.isfile(config.hdp_cost_model):
        problems.append(
            f"--hdp-cost-model {config.hdp_cost_model}: no such file; write one with `megatron-hdp calibrate` "
            "or leave the flag out for the analytic cost model"
        )
    return problems + flag_problems(args)


def _ring_kind_problems(args: Namespace, config: HDPConfig) -> list[str]:
    """`--hdp-ring-kind latent` where no latent ring can run: without multi-latent attention, or with a
    policy that plans K/V rings only."""
    if config.hdp_ring_kind != "latent":
        return []
    if not getattr(args, "multi_latent_attention", False):
        return ["--hdp-ring-kind latent without --multi-latent-attention: the latent ring circulates multi-latent "
                "attention's latent; drop --hdp-ring-kind or set it to kv"]
    if config.hdp_policy in KV_RING_ONLY_POLICIES:
        return [f"--hdp-ring-kind latent with --hdp-policy {config.hdp_policy}: that policy plans K/V rings only "
                "(Megatron's Hybrid-CP scheduler runs the K/V ring); use --hdp-policy balance or --hdp-ring-kind kv"]
    return []


def _kv_fallback(args: Namespace, config: HDPConfig) -> Optional[str]:
    """Why split documents run K/V rings only although --hdp-ring-kind (auto, or left out with multi-latent
    attention) would let the cost model pick latent rings; None when it can."""
    if config.hdp_ring_kind not in (None, "auto"):
        return None
    mla = getattr(args, "multi_latent_attention", False)
    if not mla:
        return "no --multi-latent-attention (only its latent can circulate)" if config.hdp_ring_kind else None
    if config.hdp_policy in KV_RING_ONLY_POLICIES:
        return f"--hdp-policy {config.hdp_policy} plans K/V rings only"
    return None


def ring_kind_setting(args: Namespace, config: HDPConfig) -> Optional[str]:
    """The cost model's `ring_kind` for this run: --hdp-ring-kind, "kv" where auto can only plan K/V rings
    (`_kv_fallback`, said once by `validate_hdp_args`), None (unset): the cost model's own."""
    return "kv" if _kv_fallback(args, config) else config.hdp_ring_kind


def _expert_problems(args: Namespace) -> list[str]:
    """The HDP pool must hold whole expert-parallel groups: the planner plans the HDP ranks an MoE
    all-to-all couples together (`plan.cost.experts.expert_unit_size`), and Megatron lays its expert grid
    (expert TP x EP) over world / PP ranks (it would stop later, inside initialize_model_parallel)."""
    from megatron_hdp.plan.cost.experts import expert_unit_size

    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    unit = expert_unit_size(tp_size=tp, ep_size=ep, etp_size=etp)
    if args.data_parallel_size % unit:
        return [f"--expert-model-parallel-size {ep} with --expert-tensor-parallel-size {etp}: an expert-parallel "
                f"group spans {unit} HDP ranks, which does not divide the HDP pool of {args.data_parallel_size} "
                f"(data-parallel) ranks; choose them so that expert TP x EP divides world size / PP"]
    return []


def validate_hdp_args(args: Namespace) -> Optional[HDPConfig]:
    """Check the HDP flags against the rest of Megatron's (already validated) arguments.

    Returns the HDPConfig when `--hdp` is on, None when it is off. Raises ValueError listing every
    combination that cannot run, each with what to change.
    """
    if not getattr(args, "hdp", False):
        _warn_ignored(args)
        return None
    config = HDPConfig.from_namespace(args)
    problems = _incompatibilities(args, config)
    if problems:
        raise ValueError("--hdp cannot run with these flags:\n  - " + "\n  - ".join(problems))
    _warn_recompute_mismatch(args, config)
    fallback = _kv_fallback(args, config)
    if fallback:
        logger.warning("--hdp-ring-kind %s: split documents run K/V rings: %s", config.hdp_ring_kind or "auto",
                       fallback)
    return config


def _warn_recompute_mismatch(args: Namespace, config: HDPConfig) -> None:
    """Warn when --hdp-cost-model was measured under another --recompute-granularity than this run's:
    recomputation trades activation memory (Act(s), hence D(s) and the capacity) for compute time."""
    if config.hdp_cost_model is None:
        return
    try:  # only the recorded setting: the coefficients are checked where the cost model is built
        recorded = json.loads(Path(config.hdp_cost_model).read_text())
    except ValueError:
        return
    measured = recorded.get("recompute_granularity", "none") if isinstance(recorded, dict) else "none"
    running = getattr(args, "recompute_granularity", None) or "none"
    if measured != running:
        logger.warning(
            "--hdp-cost-model %s was measured with recompute granularity %s but this run uses %s: the "
            "planner's Act(s), ring sizes and step times will be off; re-run `megatron-hdp calibrate "
            "--recompute-granularity %s`",
            config.hdp_cost_model, measured, running, running,
        )



def parse_and_check(
    argv: list[str], *, world_size: int, env: Optional[dict[str, str]] = None, device_arch: int = 9
) -> tuple[Namespace, Optional[HDPConfig]]:
    """Parse `argv` exactly as `pretrain_gpt.py` would on a job of `world_size` ranks, then validate.

    Runs Megatron's own `parse_args` (with `add_hdp_args`) and `validate_args`, then `validate_hdp_args`,
    without starting anything distributed: a dry run of a launch script's flags. `env` adds the launch
    script's environment (e.g. CUDA_DEVICE_MAX_CONNECTIONS, which validate_args checks). Without a GPU,
    validate_args' device queries answer as a GPU of compute capability `device_arch` (9 = Hopper).
    """
    import sys
    from unittest import mock

    import torch
    from megatron.training import arguments

    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    environ = {**(env or {}), "WORLD_SIZE": str(world_size), "RANK": "0"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(sys, "argv", ["pretrain_gpt.py", *argv]))
        stack.enter_context(mock.patch.dict(os.environ, environ))
        if not torch.cuda.is_available():
            stack.enter_context(mock.patch.object(arguments, "get_device_arch_version", lambda: device_arch))
            stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda *_: (device_arch, 0)))
        args = arguments.parse_args(extra_args_provider=add_hdp_args)
        arguments.validate_args(args)
    return args, validate_hdp_args(args)
