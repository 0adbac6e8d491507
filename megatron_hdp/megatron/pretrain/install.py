"""`install(args)`: wire HDP into `megatron.training` (megatron-core 0.19.x, 0.20.x) after argument parsing.

Call it once, after `parse_and_validate_args` and before the model config is built from `args`
(`examples/pretrain_gpt_hdp.py` and the patched `pretrain_gpt.py` do). Without `--hdp` it only checks
the flags. With `--hdp` it changes ten names: `args.spec`, seven in `megatron.training.training`'s
namespace, one in `megatron.training.checkpointing`'s and one in `megatron.training.models.gpt`'s, each a
thin wrapper around Megatron's own function (the whole monkeypatch surface, in call order):

1. `args.spec`: the GPT layer spec is Megatron's with `HDPCoreAttention` as its `core_attention` leaf.
2. `setup_model_and_optimizer`: after Megatron builds (and DDP-wraps) the model, `prepare_model_for_hdp`
   moves RoPE into the HDP core attention of each chunk; with `--hdp-offload` an `ActivationOffloader`
   is attached to each chunk's transformer layers (one per virtual pipeline stage). (Not `get_model`: `pretrain` with a config container,
   as `examples/pretrain_gpt_hdp.py` calls it, builds through the model builder and never calls it.)
3. `build_train_valid_test_datasets`: the datasets provider runs with every rank building its
   datasets (`datasets_built_on_every_rank`; `pretrain_gpt.py` builds them on TP rank 0 of the first
   and last stages only, and every rank plans). `build_pretraining_data_loader`: the HDP loader (our sampler + planner + THD collation) over the same
   Megatron dataset; it yields one `HDPStep` per training step.
4. `get_forward_backward_func`: the schedule is called with this rank's micro-batches of the step,
   prepared by `data.prepare.prepare_step` exactly as the Core-API trainer prepares them (plan checked on
   every rank, padded to the count the step runs, pinned; with virtual pipeline stages each model chunk
   gets its own iterator over the same micro-batches), its own micro-batch count, and HDP's forward step
   (token-level loss; Megatron's `calculate_per_token_loss` divides by the global batch's token count,
   summed over the HDP domain; each micro-batch offloads the ratio it carries from its plan); it also
   keeps `args.consumed_train_samples` equal to the documents the loader consumed.
5. `training_log`: HDP statistics (balance, rings, ring-attention bytes, micro-batch counts, loader
   wait, offloaded bytes) and the measured telemetry of `comm/telemetry.py` in Megatron's log line and its
   TensorBoard / W&B writers, every `--hdp-log-interval` steps; with --hdp-online-refit the measured
   steps refit the cost model the loaders plan with (`HDPRuntime.learn`); with MTP, Megatron's MTP loss
   log is the token-level mean over the global batch (`mtp.log_token_level_mtp_loss`).
6. `consume_seqlen_stats_in_iteration`: the plan's real tokens and sum of s^2 for Megatron's FLOPs.
7. `save_checkpoint`: with --hdp-online-refit, the learned cost model is written next to each checkpoint.
8. `checkpointing._load_base_checkpoint` (`resume_check`): a resume may change the pool's size, not TP,
   PP, EP or the documents' lengths (`data/resume.py`).
9. `megatron.training.models.gpt.mtp_block_spec` (with --mtp-num-layers): the MTP block is built from the
   HDP layer spec (Megatron builds it from its stock specs whatever --spec says), so its layers attend
   with HDP's core attention; their rolls come from the loader (`megatron/layers/mtp.py`).

With PP > 1 it also sets `args.variable_seq_lengths` before the model config is built from `args`
(`_pipeline_shapes_per_microbatch`): the tensors between stages take each micro-batch's length.

What the wrappers share (config, loaders, offloaders, telemetry, the current cost model and its online
refit) is one `HDPRuntime`, built by install() and closed over by each wrapper; the patch table in
`megatron.training.training` is the only process-wide state (`installed()` reads the runtime from it).

Anything else Megatron does (optimizer, DDP gradient reduction over the data-parallel group = the HDP
domain, checkpoints, LR schedule) is unchanged; an HDP model's checkpoint has plain Megatron's keys.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any, Callable, Optional

from megatron_hdp.comm.telemetry import StepTelemetry
from megatron_hdp.config import HDPConfig
from megatron_hdp.megatron.compat.versions import check_megatron_version, require_megatron_training
from megatron_hdp.megatron.pretrain import wrappers
from megatron_hdp.megatron.pretrain.args import validate_hdp_args
from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model, run_online_refit
from megatron_hdp.megatron.pretrain.resume_check import wrap_load_base_checkpoint
from megatron_hdp.megatron.pretrain.runtime import HDPRuntime
from megatron_hdp.offload import OffloadConfig

logger = logging.getLogger(__name__)

HDP_LAYER_SPEC = ("megatron_hdp.megatron.layers.spec", "hdp_layer_spec")
"""`--spec` under --hdp: Megatron's GPT layer spec with HDP's core attention (`layers.spec.hdp_layer_spec`)."""

_PATCHES = {
    "setup_model_and_optimizer": wrappers.wrap_setup_model_and_optimizer,
    "build_train_valid_test_datasets": wrappers.wrap_build_datasets,
    "build_pretraining_data_loader": wrappers.wrap_build_data_loader,
    "get_forward_backward_func": wrappers.wrap_get_forward_backward_func,
    "training_log": wrappers.wrap_training_log,
    "consume_seqlen_stats_in_iteration": wrappers.wrap_consume_seqlen_stats,
    "save_checkpoint": wrappers.wrap_save_checkpoint,
}
"""Wrappers of names in `megatron.training.training`."""
_MODEL_PATCHES = {"mtp_block_spec": wrappers.wrap_mtp_block_spec}
"""Wrappers of names in `megatron.training.models.gpt` (the config-container model builder)."""


def _wrap(module: Any, name: str, wrap: Callable, runtime: HDPRuntime) -> Callable:
    """Replace `module.name` by `wrap(Megatron's own function, runtime)` (never a wrapper around a wrapper)."""
    current = getattr(module, name)
    original = getattr(current, "_hdp_original", current)
    wrapped = wrap(original, runtime)
    wrapped._hdp_original = original  # type: ignore[attr-defined]
    setattr(module, name, wrapped)
    return wrapped


def install(args: Optional[Namespace] = None) -> Optional[HDPConfig]:
    """Check the HDP flags and, with `--hdp`, wire HDP into megatron.training (module docstring).

    `args` defaults to Megatron's `get_args()`. Returns the HDPConfig, or None when HDP is off. Raises
    ValueError for flags HDP cannot run with and, with --hdp only, RuntimeError on a megatron-core release
    not in `compat.versions.SUPPORTED_MCORE` (without --hdp it only warns). Builds the one `HDPRuntime`
    the wrappers close over (`installed()` finds it). Calling it again in the same process re-reads the
    flags and wraps Megatron's own functions again, around a new runtime (never a wrapper around a wrapper).
    """
    require_megatron_training()
    from megatron.training import training

    if args is None:
        from megatron.training import get_args

        args = get_args()
    config = validate_hdp_args(args)
    if config is None:
        return None
    check_megatron_version(hdp=True)
    wrappers.pipeline_shapes_per_microbatch(args)
    if args.spec is not None and tuple(args.spec) != HDP_LAYER_SPEC:
        raise ValueError(
            f"--spec {' '.join(args.spec)} with --hdp: HDP supplies the layer spec (Megatron's GPT layer with "
            "HDP core attention); drop --spec"
        )
    args.spec = list(HDP_LAYER_SPEC)
    from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims, apply_training_cpu_shims

    if apply_cpu_shims():
        apply_training_cpu_shims()
    cost_model, refit = run_cost_model(args, config), None
    if config.hdp_online_refit:
        refit = run_online_refit(args, config, cost_model)
        cost_model = refit.model
    offload = None
    if config.hdp_offload_min_tensor_bytes is not None:
        offload = OffloadConfig(min_tensor_bytes=config.hdp_offload_min_tensor_bytes)
    node = cost_model.ranks_per_node and cost_model.ranks_per_node * args.tensor_model_parallel_size
    runtime = HDPRuntime(config=config, cost_model=cost_model, telemetry=StepTelemetry(ranks_per_node=node),
                         offload_config=offload, refit=refit)
    from megatron.training.models import gpt

    for name, wrap in _PATCHES.items():
        _wrap(training, name, wrap, runtime)
    for name, wrap in _MODEL_PATCHES.items():
        _wrap(gpt, name, wrap, runtime)
    training.get_forward_backward_func._hdp_runtime = runtime  # type: ignore[attr-defined]
    wrap_load_base_checkpoint(runtime)
    logger.info("HDP installed into megatron.training: %s", config)
    return config
