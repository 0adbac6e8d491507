"""Fake-GPU harness: run our code paths with CUDA tensors and NCCL's rules on a CPU-only PyTorch.

What it is made of (test-only; nothing here is importable from the package):
* `fake_cuda_guard.cpp`, built once with `torch.utils.cpp_extension` and loaded *before* torch is
  imported (so PyTorch's accelerator is "cuda"): a CUDA device guard and CUDA hooks, without which the
  autograd engine of a CPU build cannot run a backward over tensors on "cuda".
* `FakeTensorMode` (PyTorch's own): tensors created on "cuda" are fake (shape, dtype, device; no data),
  every op propagates them with its meta/fake kernel (including `varlen_attn` and its backward), and an
  op that mixes "cuda" with a CPU tensor of more than 0 dimensions raises `FakeTensorDeviceMismatchError`,
  as on a GPU.
* `HostAndDevice`, a dispatch mode above it: work on real CPU tensors stays real (the data loader, the
  collation, the planner), a host-to-device copy (`.to("cuda")`, `copy_`) becomes a fake CUDA tensor and
  is recorded (bytes, non_blocking, from pinned memory, inside a layer or not), and a host sync (`.item()`,
  `.tolist()`, `bool()` of a CUDA tensor, a copy to the host: `.cpu()`) inside a transformer layer raises
  `HostSyncInLayer`; outside a layer it returns a placeholder (0, or a host tensor of zeros), since a fake
  tensor has no value.
* `NcclRulesGroup`, a process-group backend ("fake_nccl") for one process that plays one rank of a
  world of any size: no data moves, but a CPU tensor in any collective or P2P op raises `NcclRuleError`,
  and so does a P2P op that is the first operation of its group without reaching every rank of it (NCCL
  creates the communicator on a group's first call with all ranks taking part). Every group logs its
  operations (`collective_log`): several processes, each playing one rank of the same world, write
  their logs, and a test compares them (NCCL pairs the n-th collective of every member of a
  communicator, so members that post different sequences hang or mix data). P2P sends and receives
  are logged apart (`p2p_log`: per NCCL group call, each op's peer, size and dtype) and
  `p2p_problems` checks the logs of all played ranks against NCCL's P2P rules: the n-th send from a to
  b meets the n-th receive on b from a, with the same size and dtype, and the group calls of all ranks,
  executed in order on each rank's communicator stream, all complete (none waits on a peer's later call).
* compiled flex attention (Inductor cannot compile for a fake GPU) is its uncompiled higher-order op:
  under fake tensors both are shape propagation, and the harness's own dispatch passes it through.
* `torch.cuda` answers as one H100 would (available, capability 9.0, current device 0).

Run a scenario in a fresh interpreter: `python tests/fake_gpu.py <library.so> <scenario>` (see
`tests/fake_gpu_scenarios.py`); under pytest, `tests/megatron/test_fake_gpu.py` runs each in a process forked from
one interpreter that has made these imports once (`tests/fake_gpu_server.py`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
import traceback
from pathlib import Path

GUARD_SOURCE = Path(__file__).with_name("fake_cuda_guard.cpp")
CODE = (
    str(Path(__file__).resolve().parents[1] / "megatron_hdp") + os.sep,
    *(location + os.sep for location in importlib.util.find_spec("megatron").submodule_search_locations),
)
"""Frames worth naming in a message: the package's and Megatron's (their directories, not a name that any
path may hold: a checkout cloned into a folder called megatron_hdp has its tests/ under such a name)."""


def build_guard_library() -> Path:
    """Compile `fake_cuda_guard.cpp` (cached by torch.utils.cpp_extension) and return the library path.
    Runs in the parent process (it imports torch, after which the library can no longer take effect)."""
    from torch.utils import cpp_extension

    return Path(
        cpp_extension.load(
            name="megatron_hdp_fake_cuda_guard", sources=[str(GUARD_SOURCE)], is_python_module=False, verbose=False
        )
    )


def preload(library: Path) -> None:
    """Load the guard library before torch: PyTorch decides its accelerator once, at import."""
    assert "torch" not in sys.modules, "the fake CUDA guard must be loaded before torch is imported"
    torch_lib = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "lib"
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(torch_lib / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


class HostSyncInLayer(RuntimeError):
    """A host sync (.item(), .tolist()) on a CUDA tensor inside a transformer layer's forward or backward."""


class NcclRuleError(RuntimeError):
    """An operation NCCL rejects or that is undefined under NCCL."""


COMMUNICATORS: list = []
"""Every `NcclRulesGroup` of this process in creation order; `ranks` is set by `install`'s new_group."""

_BATCH: list = [None]
"""A fresh token while a `batch_isend_irecv` runs (its ops are one NCCL group call), else None."""

_LAYER_DEPTH = [0]
"""How many transformer layers' forwards are running (set by module hooks in `install`)."""


def _where() -> str:
    """The innermost frame of package or Megatron code on the Python stack ('file:line')."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in CODE):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _in_layer() -> str | None:
    """Where the current op runs when it runs inside a transformer layer's forward, or in a backward
    (the autograd engine runs a CUDA backward on its device thread), else None."""
    if _LAYER_DEPTH[0] > 0:
        return "forward at " + _where()
    if threading.current_thread() is not threading.main_thread():
        return "backward at " + _where()
    return None


def patch_torch_cuda() -> None:
    """Have `torch.cuda` answer as one H100 would (available, capability 9.0, current device 0; streams and
    events that do nothing). Process-wide and repeatable; done before Megatron is imported, which binds
    some of these functions at import (`tensor_parallel.random`: `_lazy_init`)."""
    import torch

    from megatron_hdp.megatron.compat.cpu_shims import _NullEvent, _NullStream

    assert torch._C._get_accelerator().type == "cuda", "load the guard library with preload() before torch"
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.get_device_name = lambda device=None: "fake H100"
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None

    class TimedEvent(_NullEvent):
        """A CUDA event with timing; fake kernels take no time."""

        def elapsed_time(self, end) -> float:
            return 0.0

    cuda.Stream, cuda.Event = _NullStream, TimedEvent
    cuda.current_stream = cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: _NullStream()
    cuda.manual_seed = cuda.manual_seed_all = lambda seed: None
    cuda._lazy_init = lambda: None
    cuda.get_rng_state = cuda.random.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)
    cuda.set_rng_state = cuda.random.set_rng_state = lambda new_state, device="cuda": None
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda device=None: 0)
    cuda.reset_peak_memory_stats = lambda device=None: None
    torch.backends.cuda.is_flash_attention_available = lambda: True


def install(*, world_size: int, rank: int):
    """Enter the fake GPU: patch torch.cuda, push FakeTensorMode and the host/device mode, register
    and initialise the NCCL-rules default process group. Returns the `HostAndDevice` mode (its records)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import (
        FakeTensor,
        FakeTensorDeviceMismatchError,
        FakeTensorMode,
        unset_fake_temporarily,
    )
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves, tree_map
    from torch.utils.weak import WeakTensorKeyDictionary

    patch_torch_cuda()
    aten = torch.ops.aten

    def is_cuda(device) -> bool:
        if device is None:
            return False
        return torch.device(device).type == "cuda"

    class HostAndDevice(TorchDispatchMode):
        """Real CPU work stays real; host-to-device copies become fake CUDA tensors; host syncs checked."""

        supports_higher_order_operators = True
        """Higher-order operators (flex attention) pass through to FakeTensorMode's rules for them."""

        def __init__(self) -> None:
            super().__init__()
            self.h2d: list[dict] = []
            """Every host-to-device copy: bytes, non_blocking, pinned, layer (frame or None)."""
            self.host_syncs: list[str] = []
            """Where each host sync outside a layer happened (placeholders were returned)."""
            self._pinned = WeakTensorKeyDictionary()
            self.clock = 0
            """Operations dispatched so far: the position of a copy (`clock` of `h2d`) or a backward op."""
            self.backward_ops: list[int] = []
            """Clock of every operation run by autograd's device thread (a backward)."""

        def _h2d(self, src, non_blocking: bool) -> None:
            self.h2d.append(
                dict(bytes=src.numel() * src.element_size(), non_blocking=bool(non_blocking),
                     pinned=src in self._pinned, layer=_in_layer(), where=_where(), clock=self.clock)
            )

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            self.clock += 1
            if threading.current_thread() is not threading.main_thread():
                self.backward_ops.append(self.clock)
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            fake = any(isinstance(t, FakeTensor) for t in tensors)
            to_host = func is aten._to_copy.default and fake and kwargs.get("device") is not None and not is_cuda(
                kwargs["device"])
            if (func is aten._local_scalar_dense.default or to_host) and fake:
                where = _in_layer()
                if where is not None:
                    raise HostSyncInLayer(f"host sync (.item(), .tolist(), .cpu()) on a CUDA tensor inside a layer "
                                          f"at {where}")
                self.host_syncs.append(traceback.format_stack(limit=4)[0])
                if to_host:  # a device-to-host copy: a real host tensor of placeholder values
                    with unset_fake_temporarily():
                        return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
                dtype = args[0].dtype
                return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
            if not fake:
                if func is aten._pin_memory.default:
                    with unset_fake_temporarily():
                        pinned = args[0].clone()
                    self._pinned[pinned] = True
                    return pinned
                if func is aten.is_pinned.default:
                    return args[0] in self._pinned
                if func is aten._to_copy.default and is_cuda(kwargs.get("device")):
                    src = args[0]
                    self._h2d(src, kwargs.get("non_blocking", False))
                    return torch.empty_strided(
                        src.shape, src.stride(), dtype=kwargs.get("dtype") or src.dtype, device="cuda"
                    )
                if not is_cuda(kwargs.get("device")):
                    with unset_fake_temporarily():  # host work: real tensors, real values
                        return func(*args, **kwargs)
            if func is aten.copy_.default and not isinstance(args[1], FakeTensor) and args[0].device.type == "cuda":
                self._h2d(args[1], len(args) > 2 and args[2])
                return args[0]
            try:
                return func(*args, **kwargs)
            except FakeTensorDeviceMismatchError as err:
                shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
                raise FakeTensorDeviceMismatchError(func, err.common_device, err.device) from RuntimeError(
                    f"{func} on tensors {shapes}"
                )

    class TensorConstructors(TorchFunctionMode):
        """`torch.tensor(data, device="cuda")` is a host-to-device copy: build it on the host (real),
        then copy (recorded by `HostAndDevice`)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in (torch.tensor, torch.as_tensor) and isinstance(args[0], (list, tuple)) and any(
                isinstance(t, FakeTensor) for t in tree_leaves(args[0])
            ):  # CUDA scalars read on the host (a sync each): placeholder values, as `.item()` gives
                data = tree_map(lambda t: t.item() if isinstance(t, FakeTensor) else t, args[0])
                device = kwargs.pop("device", None)
                with unset_fake_temporarily():
                    host = func(data, *args[1:], **kwargs)
                return host.to(device) if is_cuda(device) else host
            if func in (torch.tensor, torch.as_tensor) and not any(
                isinstance(t, FakeTensor) for t in tree_leaves(args)
            ):
                device = kwargs.pop("device", None)
                with unset_fake_temporarily():
                    host = func(*args, **kwargs)
                return host.to(device) if is_cuda(device) else host
            return func(*args, **kwargs)

    from torch._C._distributed_c10d import _create_work_from_future

    def done_work():
        from torch.futures import Future

        future = Future()
        future.set_result(None)
        return _create_work_from_future(future)

    class NcclRulesGroup(dist.ProcessGroup):
        """One rank of a group under NCCL's rules; no data moves (tensors are fake)."""

        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self._rank, self._size = rank, size
            self.started = False
            self.ops: list[str] = []
            """Each operation as 'name numel,numel,...' (what NCCL matches across the members)."""
            self.ranks: tuple[int, ...] | None = None
            """Global ranks of the group (labelled by `install`'s new_group)."""
            self.p2p: list[list[list]] = []
            """P2P ops per NCCL group call, in posting order: [kind, peer global rank, numel, dtype]."""
            self._batch = None
            COMMUNICATORS.append(self)

        def size(self) -> int:
            return self._size

        def getBackendName(self) -> str:
            return "fake_nccl"

        def _check(self, op: str, tensors, peer: int | None = None):
            tensors = [t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)]
            for t in tensors:
                if t.device.type != "cuda":
                    raise NcclRuleError(
                        f"NCCL {op}: a tensor of shape {tuple(t.shape)} on {t.device}; NCCL takes CUDA tensors only"
                    )
            if peer is not None and not self.started and self._size > 2:
                raise NcclRuleError(
                    f"NCCL {op} with rank {peer} is the first operation of a group of {self._size} ranks: NCCL "
                    "creates the communicator on a group's first call with every rank taking part (undefined, "
                    "can hang); initialise the group eagerly (a barrier with device_ids, or device_id=)"
                )
            self.started = True
            self.ops.append(f"{op} " + ",".join(str(t.numel()) for t in tensors))
            return done_work()

        def allreduce(self, tensors, opts=None):
            return self._check("all_reduce", tensors)

        def allreduce_coalesced(self, tensors, opts=None):
            return self._check("all_reduce_coalesced", tensors)

        def allgather(self, outputs, inputs, opts=None):
            return self._check("all_gather", (outputs, inputs))

        def _allgather_base(self, output, input, opts=None):
            return self._check("all_gather_into_tensor", (output, input))

        def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
            return self._check("all_gather_into_tensor_coalesced", (outputs, inputs))

        def reduce_scatter(self, outputs, inputs, opts=None):
            return self._check("reduce_scatter", (outputs, inputs))

        def _reduce_scatter_base(self, output, input, opts=None):
            return self._check("reduce_scatter_tensor", (output, input))

        def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
            return self._check("reduce_scatter_tensor_coalesced", (outputs, inputs))

        def broadcast(self, tensors, opts=None):
            return self._check("broadcast", tensors)

        def reduce(self, tensors, opts=None):
            return self._check("reduce", tensors)

        def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
            return self._check("all_to_all_single", (output, input))

        def alltoall(self, outputs, inputs, opts=None):
            return self._check("all_to_all", (outputs, inputs))

        def barrier(self, opts=None):
            return self._check("barrier", [])

        def _p2p(self, kind: str, tensors, peer: int):
            work = self._check(kind, tensors, peer=peer)
            op = [kind, self.ranks[peer] if self.ranks else peer, sum(t.numel() for t in tensors),
                  str(tensors[0].dtype).removeprefix("torch.")]
            if _BATCH[0] is None or self._batch is not _BATCH[0]:  # a new NCCL group call
                self.p2p.append([])
            self._batch = _BATCH[0]
            self.p2p[-1].append(op)
            return work

        def send(self, tensors, dst, tag=0):
            return self._p2p("send", tensors, dst)

        def recv(self, tensors, src, tag=0):
            return self._p2p("recv", tensors, src)

    def create(store, group_rank, group_size, timeout):
        return NcclRulesGroup(group_rank, group_size)

    if "fake_nccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("fake_nccl", create, devices=["cuda"])
    original_new_group = dist.new_group

    def new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":  # Megatron's CPU-side groups: no NCCL rules, no peers to meet
            kwargs["backend"] = "fake"
        created = len(COMMUNICATORS)
        group = original_new_group(*args, **kwargs)
        ranks = kwargs.get("ranks", args[0] if args else None)
        for communicator in COMMUNICATORS[created:]:
            communicator.ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(world_size))
        return group

    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    dist.new_group = new_group
    dist.all_gather_object = _all_gather_object_on_cuda(dist, torch)
    dist.batch_isend_irecv = _one_nccl_group_call(dist.batch_isend_irecv)
    _uncompiled_flex_attention()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake_nccl", store=FakeStore(), rank=rank, world_size=world_size)
    COMMUNICATORS[0].ranks = tuple(range(world_size))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_mode.__enter__()
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    def enter_layer(module, args):
        _LAYER_DEPTH[0] += isinstance(module, TransformerLayer)

    def leave_layer(module, args, output):
        _LAYER_DEPTH[0] -= isinstance(module, TransformerLayer)

    register_module_forward_pre_hook(enter_layer)
    register_module_forward_hook(leave_layer)
    mode = HostAndDevice()
    mode.__enter__()
    TensorConstructors().__enter__()
    return mode


def collective_log() -> dict[str, list[str]]:
    """The collectives (P2P sends/receives left out) each NCCL-rules group of this process posted, in
    order, keyed 'ranks#k' (`_communicator_keys`)."""
    return {
        key: [op for op in c.ops if not op.startswith(("send ", "recv "))]
        for key, c in zip(_communicator_keys(), COMMUNICATORS)
    }


def _communicator_keys() -> list[str]:
    """'ranks#k' of every NCCL-rules group of this process, in creation order: the k-th group created
    over those global ranks (every member creates the groups in the same order, so a key names one
    communicator in every process that plays a member)."""
    keys, seen = [], {}
    for communicator in COMMUNICATORS:
        ranks = ",".join(map(str, communicator.ranks or ()))
        keys.append(f"{ranks}#{seen.setdefault(ranks, 0)}")
        seen[ranks] += 1
    return keys


def p2p_log() -> dict[str, list[list[list]]]:
    """The P2P ops each NCCL-rules group of this process posted, per NCCL group call (a
    `batch_isend_irecv`, or one lone send/recv), keyed as `collective_log`; groups without P2P left out."""
    return {key: c.p2p for key, c in zip(_communicator_keys(), COMMUNICATORS) if c.p2p}


def p2p_problems(logs: dict[int, list[list[list]]]) -> list[str]:
    """What NCCL would do wrong with the P2P group calls `logs[rank]` (one communicator, every rank that
    posted on it, from `p2p_log`): the n-th send from a to b is matched with the n-th receive on b from a
    (a different size or dtype: corrupt data or a hang; one without a partner: a hang), and each rank's
    group calls run one after another on its communicator's stream, an op completing once its partner's
    call runs too (a call whose partner sits behind a call that waits on this rank's later one: a
    deadlock). Empty when every call completes. Pure Python: the logs come from other processes."""
    posted: dict[tuple, list[tuple]] = {}  # (kind, src, dst) -> (rank, call, op, numel, dtype), in order
    for rank, calls in logs.items():
        for index, call in enumerate(calls):
            for op, (kind, peer, numel, dtype) in enumerate(call):
                pair = (rank, peer) if kind == "send" else (peer, rank)
                posted.setdefault((kind, *pair), []).append((rank, index, op, numel, dtype))
    problems, partner = [], {}
    for src, dst in sorted({key[1:] for key in posted}):
        sends, recvs = posted.get(("send", src, dst), []), posted.get(("recv", src, dst), [])
        for n, (send, recv) in enumerate(zip(sends, recvs)):
            if send[3:] != recv[3:]:
                problems.append(f"send #{n} from rank {src} to rank {dst}: {send[3]} {send[4]} sent, "
                                f"{recv[3]} {recv[4]} received")
            partner[send[:3]], partner[recv[:3]] = recv[:3], send[:3]
        if len(sends) != len(recvs):
            problems.append(f"rank {src} posts {len(sends)} sends to rank {dst}, rank {dst} {len(recvs)} "
                            f"receives from rank {src}: the rest wait forever")
    if problems:
        return problems
    head = dict.fromkeys(logs, 0)  # each rank's running group call
    done: set[tuple[int, int, int]] = set()
    progress = True
    while progress:
        progress = False
        for rank, calls in logs.items():
            index = head[rank]
            if index == len(calls):
                continue
            for op in range(len(calls[index])):
                peer, peer_index, peer_op = partner[rank, index, op]
                if head[peer] == peer_index:
                    done.update({(rank, index, op), (peer, peer_index, peer_op)})
            if all((rank, index, op) in done for op in range(len(calls[index]))):
                head[rank] += 1
                progress = True
    for rank, calls in logs.items():
        index = head[rank]
        if index < len(calls):
            waits = [
                f"{kind} {'to' if kind == 'send' else 'from'} rank {peer} (in its call "
                f"#{partner[rank, index, op][1]}, it runs #{head[peer]})"
                for op, (kind, peer, _, _) in enumerate(calls[index]) if (rank, index, op) not in done
            ]
            problems.append(f"deadlock: rank {rank}'s NCCL group call #{index} waits on {'; '.join(waits)}")
    return problems


def blocking_copies_in_microbatches(mode, *, code: str = CODE[0]) -> list[dict]:
    """The blocking host-to-device copies (not both pinned and non-blocking) that code under `code` (by
    default megatron_hdp) made between a micro-batch's own transfer (its copies
    from `collate.py`) and the end of its backward: each drains the GPU's queue while the micro-batch's
    work is in it. A micro-batch's window runs from its last transfer copy to the last backward operation
    before the next micro-batch's transfer."""
    starts = [c["clock"] for c in mode.h2d if "collate.py" in c["where"]]
    windows = []
    for start, following in zip(starts, starts[1:] + [float("inf")]):
        backward = [t for t in mode.backward_ops if start < t < following]
        if backward:
            windows.append((start, backward[-1]))
    return [
        c for c in mode.h2d
        if code in c["where"] and not (c["pinned"] and c["non_blocking"])
        and any(a < c["clock"] < b for a, b in windows)
    ]


def _one_nccl_group_call(batch_isend_irecv):
    """`dist.batch_isend_irecv` marking its ops as one group call in the P2P logs (NCCL runs a batch as
    one ncclGroupStart/End; the harness's group, not NCCL's own class, gets them one by one)."""

    def batched(p2p_op_list):
        _BATCH[0] = object()
        try:
            return batch_isend_irecv(p2p_op_list)
        finally:
            _BATCH[0] = None

    return batched


def _uncompiled_flex_attention() -> None:
    """Compiled flex attention (`megatron_hdp.attention.backends.flex`) as flex's uncompiled higher-order
    op: Inductor cannot compile kernels for a fake GPU, and under fake tensors both only propagate shapes."""
    import torch.nn.attention.flex_attention as flex_attention

    from megatron_hdp.attention.backends import flex

    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the op itself, not an eager compile
    flex._compiled_flex = lambda: flex_attention.flex_attention


def _all_gather_object_on_cuda(dist, torch):
    """`dist.all_gather_object` as NCCL runs it (through the current CUDA device), every rank's object
    taken to be this rank's (no data moves in a one-process world)."""

    def all_gather_object(object_list, obj, group=None):
        size = torch.tensor([1], dtype=torch.int64, device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(size, group=group)
        object_list[:] = [obj] * len(object_list)

    return all_gather_object


def run_scenario(scenario: str, *args: str) -> None:
    """Run `fake_gpu_scenarios.<scenario>(*args)` in this process (the guard preloaded), print
    'scenario NAME: ok' or the traceback, and end the process (0 or 1) without its teardown: with the fake
    CUDA guard preloaded it aborted twice in one CI run on a loaded host ("terminate called without an
    active exception" from a C++ destructor, after "ok"; never reproduced on an idle one), which is not
    what any scenario tests."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import fake_gpu_scenarios

        getattr(fake_gpu_scenarios, scenario)(*args)
        print(f"scenario {scenario}: ok", flush=True)
        code = 0
    except BaseException:  # noqa: BLE001 - the traceback is the report
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    """`python tests/fake_gpu.py <library.so> <scenario> [args...]`: one scenario in this fresh interpreter."""
    preload(Path(argv[1]))
    run_scenario(argv[2], *argv[3:])


if __name__ == "__main__":
    main(sys.argv)
