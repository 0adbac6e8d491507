"""Stand-in for Transformer Engine's FP8 autocast collectives, for the fake-GPU harness (TE is absent here).

What it models, from TE v2.8's source (unchanged in its collective behaviour through v2.18):
* `FP8GlobalStateManager.fp8_autocast_enter` (pytorch/fp8.py): at depth 0 the next FP8 module is the
  "first" one (`IS_FIRST_FP8_MODULE = True`); depth += 1.
* A TE linear's forward under delayed scaling registers its amaxes in the global buffer
  (`add_fp8_tensors_to_global_buffer`, a no-op for every other recipe), and the first FP8 module with a
  gradient records `ctx.reduce_and_update_bwd_fp8_tensors = is_first_fp8_module()`
  (module/linear.py; layernorm_linear.py and layernorm_mlp.py alike).
* `fp8_autocast_exit`: depth -= 1; at depth 0 with grad enabled, `reduce_and_update_fp8_tensors(
  forward=True)`: for a non-empty buffer, one `all_reduce(MAX)` over the autocast's `fp8_group` when that
  group has more than one rank (`reduce_tensor_across_group_op_max`).
* At the end of that first module's backward, `reduce_and_update_fp8_tensors(forward=False)`: the same
  all-reduce over the same group.
* Current-scaling, MXFP8, blockwise and NVFP4 recipes leave the buffer empty, so neither point reduces.
Megatron's side is its own `fp8_utils.get_fp8_context`, whose group choice is repeated here
(`get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=config.tp_only_amax_red)`), with
`transformer_engine.pytorch.fp8_autocast` replaced by `Autocast`. Megatron's local linears
(Column/RowParallelLinear) play TE's linears.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

_STATE = {"depth": 0, "first": False, "buffered": False, "autocast": None}


def _reduce_amaxes(group) -> None:
    """`reduce_and_update_fp8_tensors` for a non-empty delayed-scaling buffer: one MAX all-reduce."""
    if dist.get_world_size(group=group) > 1:
        dist.all_reduce(torch.zeros(4, device="cuda"), op=dist.ReduceOp.MAX, group=group)


class Autocast:
    """`fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)` as far as collectives go."""

    def __init__(self, recipe: str, group) -> None:
        self.recipe, self.group = recipe, group

    def __enter__(self) -> "Autocast":
        if _STATE["depth"] == 0:
            _STATE.update(first=True, buffered=False)
        _STATE["depth"] += 1
        _STATE["autocast"] = self
        return self

    def __exit__(self, *exc) -> None:
        _STATE["depth"] -= 1
        if _STATE["depth"] == 0 and torch.is_grad_enabled() and _STATE["buffered"]:
            _reduce_amaxes(self.group)


class _ReduceAfterBackward(torch.autograd.Function):
    """Identity on the first FP8 module's input: its backward runs when that module's backward ends."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _reduce_amaxes(ctx.group)
        return grad, None


def get_fp8_context(config, layer_no: int = -1, is_init: bool = False):
    """Megatron's `fp8_utils.get_fp8_context` (v0.19) with TE's autocast stood in for."""
    from megatron.core import parallel_state

    if is_init or not config.fp8:
        return nullcontext()
    group = parallel_state.get_amax_reduction_group(
        with_context_parallel=True, tp_only_amax_red=config.tp_only_amax_red
    )
    return Autocast(str(getattr(config.fp8_recipe, "value", config.fp8_recipe)), group)


def _linear_pre_hook(module, args):
    """A TE linear's forward under the autocast: buffer amaxes (delayed) and arm the backward reduction."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    autocast = _STATE["autocast"]
    if _STATE["depth"] == 0 or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return None
    delayed = autocast.recipe == "delayed"
    _STATE["buffered"] |= delayed
    x = args[0]
    if torch.is_grad_enabled() and x.requires_grad and _STATE["first"]:
        _STATE["first"] = False  # is_first_fp8_module()
        if delayed:
            return (_ReduceAfterBackward.apply(x, autocast.group), *args[1:])
    return None


def install() -> None:
    """Route Megatron's FP8 contexts through the stand-in (call after `fake_gpu.install`)."""
    from megatron.core import fp8_utils
    from megatron.core.transformer import transformer_block
    from torch.nn.modules.module import register_module_forward_pre_hook

    fp8_utils.get_fp8_context = transformer_block.get_fp8_context = get_fp8_context
    register_module_forward_pre_hook(_linear_pre_hook)
