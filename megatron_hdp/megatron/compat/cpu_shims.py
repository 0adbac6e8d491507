"""The few patches Megatron-Core needs to train on a CPU-only PyTorch (gloo), applied only without CUDA.

Megatron-Core assumes a GPU in a handful of places: tensors created with `device="cuda"` or
`torch.cuda.current_device()` (the loss-token counter of the schedules, the optimizer's scale and
found-inf flags, grad-norm clipping, DDP's buffers), `torch.cuda.synchronize/current_stream`, and a CUDA
RNG tracker. On a CPU build these raise "Torch not compiled with CUDA enabled". The patches below make
them CPU operations and nothing else; with CUDA present `apply_cpu_shims()` does nothing. Patch 5:
the distributed optimizer's checkpoints with torch's own Adam (no TE or Apex) and fp32 parameters.
Patch 6: Megatron-LM main's MTP layer built without Transformer Engine. Patch 7: Megatron's fused
elementwise functions run eagerly (no Inductor C++ build in every process).

Each patch is small and named after what it fixes; `apply_cpu_shims()` is idempotent and checks the
Megatron-Core version it was written against.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

TESTED_MCORE_VERSIONS = ("0.19", "0.20")
"""Megatron-Core versions (major.minor prefixes) these patches were written and tested against."""

_APPLIED: list[TorchFunctionMode] = []


def _cpu_device(device: Any) -> Any:
    """`device` with any CUDA device (`"cuda"`, `"cuda:0"`, `0`, `torch.device("cuda")`) made the CPU."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    return device


class CudaDeviceToCpu(TorchFunctionMode):
    """Patch 1: every torch call that names a CUDA device gets the CPU instead.

    Covers factory functions (`torch.zeros(..., device="cuda")` in schedules.py, optimizer.py,
    clip_grads.py), `Tensor.cuda()` (identity) and `Tensor.to("cuda" | 0)`. And `Tensor.type()` with no
    argument names the CUDA type (`torch.cuda.FloatTensor`), because grad clipping asserts it
    (clip_grads.py). Cheap: a few comparisons per torch call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _NullEvent:
    """Patch 2a: what `torch.cuda.Event()` and a null stream's `record_event()` return (MoE's token
    dispatcher synchronizes on one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    """Patch 2b: what `torch.cuda.Stream()` / `current_stream()` return: a stream that does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _patch_torch_cuda() -> None:
    """Patch 2: the `torch.cuda` functions Megatron calls for bookkeeping become CPU no-ops.

    `current_device()` returns the CPU device: Megatron passes it as `device=` (also inside autograd
    backward functions such as the MoE all-to-all, where torch-function modes are not active, so patch 1
    cannot help there);
    `synchronize`/`empty_cache` do nothing; streams are null streams; `torch.cuda.stream(s)` is a no-op
    context. `is_available()` stays False so Megatron keeps its CPU code paths.
    """
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: _NullStream()
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None


def _patch_rng_tracker() -> None:
    """Patch 3: `model_parallel_cuda_manual_seed` uses the inference RNG tracker (no CUDA RNG states).

    Megatron's training tracker snapshots `torch.cuda` RNG states; its inference tracker keeps the same
    interface with no-op forks. With dropout off (fp32 exactness runs) and weights initialized on the CPU
    from the default generator (`use_cpu_initialization=True`), nothing depends on the forked states.
    """
    from megatron.core.tensor_parallel import random as mp_random

    original = mp_random.model_parallel_cuda_manual_seed
    if getattr(original, "_hdp_cpu_shim", False):
        return

    def model_parallel_cuda_manual_seed(
        seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False, *args: Any, **kwargs: Any
    ) -> None:
        # megatron.training passes both flags positionally; the CPU always gets (False, True)
        return original(seed, False, True, *args, **kwargs)

    model_parallel_cuda_manual_seed._hdp_cpu_shim = True  # type: ignore[attr-defined]
    mp_random.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed
    # Activation recomputation (`tensor_parallel.checkpoint`) snapshots and restores the CUDA RNG state
    # around each recomputed chunk: there is none on the CPU (the CPU state it also saves is the one used).
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    import megatron.core.tensor_parallel as tp

    tp.model_parallel_cuda_manual_seed = model_parallel_cuda_manual_seed


def _patch_moe_split_sizes() -> None:
    """Patch 4: the MoE all-to-all dispatcher gets its split sizes as numpy arrays on the CPU too.

    `maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA tensors; a CPU tensor stays a tensor
    and `all_to_all_single(output_split_sizes=tensor)` then raises. Same result as on a GPU.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_hdp_cpu_shim", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._hdp_cpu_shim = True  # type: ignore[attr-defined]
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_distributed_optimizer_checkpoints() -> None:
    """Patch 5: Megatron's distributed optimizer resumes with torch's Adam (no TE/Apex: `HAVE_APEX_OR_TE`
    False), `torch_dist` or `torch`; megatron-core 0.19.2 and 0.20, core/optimizer/distrib_optimizer.py:
    a) `state_dict()` reads the step from each parameter's Adam state (`assert len(steps) == 1`, lines
       837-839), which a fresh optimizer lacks: lent a step 0 per parameter for that call (the load's).
    b) `_set_main_param_and_optimizer_states` (1193-1225) `copy_`s into fp32 main params, views of leaves,
       in grad mode ("a view of a leaf Variable..."): run under `torch.no_grad()` as its fs_model_space
       callers do; and it copies a saved per-parameter step that `torch_dist` does not persist (a fresh 0
       returns) and `torch` lacks (KeyError): the step `load_state_dict` restored is kept.
    c) `load_state_dict` shares one step tensor among all parameters (1028-1032) and Adam bumps it once per
       parameter: each gets its own copy, as the HybridDeviceOptimizer branch does.
    """
    from megatron.core.optimizer import distrib_optimizer

    optimizer_class = distrib_optimizer.DistributedOptimizer
    if getattr(optimizer_class.state_dict, "_hdp_cpu_shim", False):
        return
    original_state_dict = optimizer_class.state_dict
    original_set = optimizer_class._set_main_param_and_optimizer_states
    original_load_state_dict = optimizer_class.load_state_dict

    def state_dict(self: Any) -> dict:
        inner = self.optimizer
        if distrib_optimizer.HAVE_APEX_OR_TE or len(inner.state) > 0:
            return original_state_dict(self)
        try:  # a fresh torch Adam: a placeholder step on each parameter for this one call
            inner.state.update({param: {"step": torch.tensor(0.0)} for group in inner.param_groups
                                for param in group["params"]})
            return original_state_dict(self)
        finally:
            inner.state.clear()

    def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state:  # restored from the param groups: copied onto itself, kept
            tensors = {**tensors, "step": state["step"]}
        with torch.no_grad():
            original_set(self, model_param, tensors)

    def load_state_dict(self: Any, state_dict: dict) -> None:
        original_load_state_dict(self, state_dict)
        for state in [] if distrib_optimizer.HAVE_APEX_OR_TE else self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].detach().clone()

    for shim in (state_dict, set_main_param_and_optimizer_states, load_state_dict):
        shim._hdp_cpu_shim = True  # type: ignore[attr-defined]
    optimizer_class.state_dict = state_dict
    optimizer_class._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    optimizer_class.load_state_dict = load_state_dict


def _patch_mtp_inference_linear() -> None:
    """Patch 6: Megatron-LM main's MTP layer (megatron-core 0.20) asks `is_inference_column_parallel_linear`
    of its projections while it is built, an isinstance over Transformer Engine's inference linear
    classes, which are Mocks when TE is not installed: a TypeError that stops any MTP model (plain or
    --hdp) from being built. Without TE no module can be such a linear, so the answer is False. Releases
    without the check (0.19) are left alone."""
    from megatron.core.transformer import multi_token_prediction as mtp

    try:
        from megatron.core.tensor_parallel.inference_layers import HAVE_TE
    except ImportError:
        return
    if not HAVE_TE and hasattr(mtp, "is_inference_column_parallel_linear"):
        mtp.is_inference_column_parallel_linear = lambda module: False


def _run_jit_fusions_eagerly() -> None:
    """Patch 7: Megatron's fused elementwise functions (`megatron.core.jit.jit_fuser`: `torch.compile`
    since torch 2.2, on swiglu, bias-dropout-add, the router's softmax, ...) run as the plain functions
    they wrap. On a CPU each one is a Dynamo trace and an Inductor C++ build in every process, about half
    of a tiny `pretrain` run (Megatron's `_warmup_jit_function` compiles them before the first step), and
    the values are the same up to rounding. Modules imported later get Megatron's own no-op decorator
    (`disable_jit_fuser`); functions already compiled in loaded modules (and their classes, and the names
    other modules imported them under) are put back to their originals. `torch.compile` stays on for
    everything else (our flex attention)."""
    from megatron.core import jit

    jit.disable_jit_fuser()
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron") or module is None:
            continue
        classes = [value for value in vars(module).values() if inspect.isclass(value) and value.__module__ == name]
        for owner in (module, *classes):
            for attribute, value in list(vars(owner).items()):
                original = getattr(value, "_torchdynamo_orig_callable", None)
                if inspect.isfunction(original) and original.__module__.startswith("megatron."):
                    setattr(owner, attribute, original)


def check_mcore_version() -> str:
    """The installed Megatron-Core version; a warning once when the shims were not tested against it."""
    from megatron.core import package_info

    version = package_info.__version__
    if not version.startswith(TESTED_MCORE_VERSIONS):
        logger.warning(
            "megatron-core %s is not one of %s that the CPU shims were tested against", version, TESTED_MCORE_VERSIONS
        )
    return version


def apply_cpu_shims() -> bool:
    """Apply the CPU patches when CUDA is absent (idempotent). Returns True when they are active."""
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    check_mcore_version()
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_moe_split_sizes()
    _patch_distributed_optimizer_checkpoints()
    _patch_mtp_inference_linear()
    _run_jit_fusions_eagerly()
    mode = CudaDeviceToCpu()
    mode.__enter__()  # stays on the torch-function mode stack for the life of the process
    _APPLIED.append(mode)
    logger.debug("Megatron CPU shims applied")
    return True


def apply_training_cpu_shims() -> None:
    """The extra patches `megatron.training.pretrain` needs on a CPU-only PyTorch (after `apply_cpu_shims`).

    Only for the Megatron-LM integration (`megatron_hdp.megatron.install`), only without CUDA:

    - `initialize_megatron` asserts "Megatron requires CUDA" unless called with `allow_no_cuda=True`;
      `pretrain` calls it without, so its name in `megatron.training.training` gets that default.
    - `_initialize_distributed` initializes Megatron's parallel_state only `if torch.cuda.device_count()
      > 0`: the CPU counts as one device (`set_device` is a no-op; the process group must already be
      initialized with gloo, as `run_gloo` and `examples/pretrain_gpt_hdp.py` do).
    - the rerun state machine saves and restores `torch.cuda`'s RNG state around every step: on the CPU
      there is none, so it saves an empty state and restores nothing.
    - `validate_args` asks the GPU's compute capability (`get_device_arch_version`, 0.19 and 0.20) once
      TP > 1: the CPU answers 9 (Hopper), as `args.parse_and_check` does, so TP runs need
      `CUDA_DEVICE_MAX_CONNECTIONS=1` as on Hopper. Apply these shims before parsing the arguments.
    """
    if torch.cuda.is_available():
        return
    import functools

    from megatron.training import arguments, training

    arguments.get_device_arch_version = lambda: 9
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda state, device="cuda": None
    if not getattr(training.initialize_megatron, "_hdp_cpu_shim", False):
        initialize = functools.partial(training.initialize_megatron, allow_no_cuda=True)
        initialize._hdp_cpu_shim = True  # type: ignore[attr-defined]
        training.initialize_megatron = initialize
