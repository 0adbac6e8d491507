"""The one interface every local attention kernel is used through.

A backend computes attention over packed variable-length segments (THD) and returns the output with its
log-sum-exp, and computes the gradients of a block given the *final* output and log-sum-exp of the rows.
That second point is what lets ring attention use any kernel: the flash backward recomputes the block's
probabilities as exp(S - lse) and uses rowsum(dO * O); with the merged (global) out and lse it yields the
block's share of the exact gradients, so a ring sums block gradients without any correction. It is
also why every kernel serves attention sinks (Megatron's off-by-one / learnable softmax): the sink is
applied to the finished rows and the backward is fed their (out', lse') (`megatron_hdp.attention.sink`),
so no backend stands aside for a sink.

Shapes: q [Tq, Hq, D], k [Tk, Hkv, D] and v [Tk, Hkv, Dv] with Hkv dividing Hq (query head h uses kv
head h // (Hq / Hkv)); out [Tq, Hq, Dv] in q's dtype; lse [Hq, Tq], float32 (float64 for float64
inputs). V's head dim may differ from Q's and K's (multi-latent attention: 192 / 128). A kernel that
takes only equal head dims runs such calls exactly on V zero-padded to D (`pad_head_dim`, `narrow_head_dim`):
the padded columns of out are zero and dropped, they add nothing to dP = dO V^T nor to rowsum(dO * O), and
the padded columns of dV are discarded. Each backend's docstring says which it does.
Segment i pairs q rows cu_q[i]:cu_q[i+1] with kv rows cu_k[i]:cu_k[i+1]; every segment is non-empty.
A causal segment has as many q as kv rows and uses the plain lower-triangular mask.
A windowed call (`window`, a `BlockWindow`: Megatron's sliding-window attention) replaces that mask by
the window rule at the segments' true positions: row i of segment s sees key j when
0 <= (i + shift_s) - j <= left, shift_s being the position of the segment's first query minus that of
its first key (0 for a whole document; a ring's piece of two chunks carries their distance). Every query
row of a call must see at least one key (the ring plan trims its pieces to such rows).

Whether a kernel runs is decided in two steps: `supports(device, dtype)` (is it importable and built for
this device and dtype at all) when a backend is named, and `shape_problem(KernelShape)` (does it have a
kernel for these head counts, head dim and segment lengths; TE's cuDNN kernels do not cover every shape)
once per shape signature, cached by the dispatcher in `backends/__init__.py`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import itertools
from typing import Callable, ClassVar

import torch

from megatron_hdp.attention.host_tables import HostTables


@dataclasses.dataclass(frozen=True)
class Segments:
    """Per-segment q and kv lengths of one kernel call, with their cumulative forms."""

    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    device: torch.device
    """Where `cu_seqlens_q` / `cu_seqlens_k` tensors are made (kernels that take tensors)."""

    def __post_init__(self) -> None:
        assert len(self.seqlens_q) == len(self.seqlens_k), (self.seqlens_q, self.seqlens_k)
        assert all(n > 0 for n in self.seqlens_q + self.seqlens_k), (self.seqlens_q, self.seqlens_k)

    @property
    def num_segments(self) -> int:
        return len(self.seqlens_q)

    @functools.cached_property
    def cu_q(self) -> tuple[int, ...]:
        """Cumulative q lengths, starting at 0 (Python ints)."""
        return (0, *itertools.accumulate(self.seqlens_q))

    @functools.cached_property
    def cu_k(self) -> tuple[int, ...]:
        """Cumulative kv lengths, starting at 0 (Python ints)."""
        return (0, *itertools.accumulate(self.seqlens_k))

    @functools.cached_property
    def cu_seqlens_q(self) -> torch.Tensor:
        """`cu_q` as an int32 tensor on `device`."""
        return torch.tensor(self.cu_q, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        """`cu_k` as an int32 tensor on `device`."""
        return torch.tensor(self.cu_k, dtype=torch.int32, device=self.device)

    def schedule_tables(self, tables: HostTables) -> None:
        """Have `tables` deliver `cu_seqlens_q` and `cu_seqlens_k` (those not made yet) with the micro-batch's
        one asynchronous copy, so that no kernel call makes them by a synchronous copy of its own."""
        pending = [name for name in ("cu_seqlens_q", "cu_seqlens_k") if name not in self.__dict__]
        if self.seqlens_q == self.seqlens_k and len(pending) == 2:  # one table serves both
            tables.add(self.cu_q, lambda t: self.__dict__.update(cu_seqlens_q=t, cu_seqlens_k=t), dtype=torch.int32)
            return
        for name in pending:
            values = self.cu_q if name == "cu_seqlens_q" else self.cu_k
            tables.add(values, lambda t, name=name: self.__dict__.__setitem__(name, t), dtype=torch.int32)

    @property
    def max_q(self) -> int:
        return max(self.seqlens_q)

    @property
    def max_k(self) -> int:
        return max(self.seqlens_k)


@dataclasses.dataclass(frozen=True)
class BlockWindow:
    """A sliding window over the segments of one kernel call: key j of segment s is visible to query i
    when 0 <= (i + shifts[s]) - j <= left (Megatron's `window_size = (left, 0)` under the causal mask)."""

    left: int
    shifts: tuple[int, ...]
    """Per segment: position of its first query minus position of its first key (within the document)."""

    def __post_init__(self) -> None:
        assert self.left >= 0, self.left

    def shift_table(self, device: torch.device) -> torch.Tensor:
        """`shifts` as an int64 tensor on `device` (flex's mask reads each row's shift from it): the one
        `schedule_tables` delivered, else made here by a synchronous copy (outside any layer only)."""
        tables = self.__dict__.setdefault("_shift_tables", {})
        if device not in tables:
            tables[device] = torch.tensor(self.shifts, dtype=torch.int64, device=device)
        return tables[device]

    def schedule_tables(self, tables: HostTables, device: torch.device) -> None:
        """Have `tables` (transferred to `device`) deliver `shift_table(device)` with the micro-batch's one
        asynchronous copy (a ring's pieces at offsets; whole documents, all shifts 0, need no table)."""
        made = self.__dict__.setdefault("_shift_tables", {})
        if any(self.shifts) and device not in made:
            tables.add(self.shifts, lambda t: made.__setitem__(device, t), dtype=torch.int64)

    def aligned(self, segments: Segments) -> bool:
        """Whether every segment is a whole causal square (shift 0, as many q as kv rows): the form that
        flash-attn, TE and `varlen_attn` express as the window (left, 0) with the causal mask."""
        return all(d == 0 for d in self.shifts) and segments.seqlens_q == segments.seqlens_k

    def mask(self, segment: int, num_q: int, num_k: int, device: torch.device) -> torch.Tensor:
        """The [num_q, num_k] bool mask (True: visible) of one segment."""
        diff = (
            torch.arange(num_q, device=device)[:, None]
            + self.shifts[segment]
            - torch.arange(num_k, device=device)[None, :]
        )
        return (diff >= 0) & (diff <= self.left)


def window_form(window: BlockWindow | None, segments: Segments) -> str:
    """How a call's mask is shaped, for kernel choice: "" (no window), "aligned" (`BlockWindow.aligned`)
    or "offset" (pieces at other offsets: only kernels taking a mask over positions express it)."""
    if window is None:
        return ""
    return "aligned" if window.aligned(segments) else "offset"


def window_pair(causal: bool, window: BlockWindow | None) -> tuple[int, int]:
    """The (left, right) window of kernels taking one per call (flash-attn, TE, `varlen_attn`; -1: no
    bound): (-1, 0) causal, (-1, -1) full, (left, 0) for an aligned window."""
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    assert causal and all(d == 0 for d in window.shifts), "a window at offsets is not one (left, right) pair"
    return (window.left, 0)


def offset_window_problem(shape: KernelShape) -> str | None:
    """Why a kernel taking one bottom-right (left, right) window per call has no kernel for `shape`."""
    if shape.window == "offset":
        return "its window is one (left, right) pair per call, bottom-right aligned: no ring pieces at offsets"
    return None


def segment_rows(cu_seqlens: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed row: its segment id and its position inside the segment, computed on the device of
    `cu_seqlens` (no copy from the host and no sync, unlike building them from the Python lengths)."""
    cu = cu_seqlens.to(torch.int64)
    rows = torch.arange(num_rows, device=cu.device)
    segment = torch.searchsorted(cu[1:], rows, right=True)
    return segment, rows - cu[segment]


def _length_bucket(n: int) -> int:
    """The power of two >= n: the segment-length bucket a kernel choice is made (and cached) for."""
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What a kernel's availability can depend on beyond device and dtype (the key of the cached choice).

    `max_seqlen` is the longest q or kv segment rounded up to a power of two, so a run whose document
    lengths change every micro-batch asks a kernel's selector once per bucket, not once per call; a
    selector is asked about the bucket's upper end (TE's limits grow stricter with length, never looser).
    """

    device: torch.device
    dtype: torch.dtype
    heads_q: int
    heads_kv: int
    head_dim: int
    """Q's and K's head dim."""
    max_seqlen: int
    deterministic: bool = False
    """Whether the backward must be deterministic (Megatron's `deterministic_mode`): kernels without a
    deterministic backward have no kernel for such calls."""
    window: str = ""
    """`window_form` of the call: kernels that cannot express an "offset" window have no kernel for it."""
    window_left: int = -1
    """The window's `left` (-1: no window); TE's kernel selector is asked with it."""
    head_dim_v: int | None = None
    """V's head dim (None: `head_dim`); multi-latent attention's is narrower than Q's and K's."""

    @property
    def value_dim(self) -> int:
        """V's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        segments: Segments,
        *,
        v: torch.Tensor | None = None,
        deterministic: bool = False,
        window: BlockWindow | None = None,
    ) -> KernelShape:
        """The shape signature of one kernel call (`v`: its value tensor; None: V shaped like K)."""
        length = _length_bucket(max(segments.max_q, segments.max_k))
        form, left = window_form(window, segments), -1 if window is None else window.left
        value_dim = None if v is None or v.shape[2] == q.shape[2] else v.shape[2]
        heads_and_dim = (q.shape[1], k.shape[1], q.shape[2])
        return cls(q.device, q.dtype, *heads_and_dim, length, deterministic, form, left, value_dim)


class AttentionBackend(abc.ABC):
    """A local attention kernel: forward returning (out, lse), backward taking (out, lse)."""

    name: ClassVar[str]

    def __init__(self, *, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        """Run a deterministic backward (bitwise-equal gradients for equal inputs): Megatron's
        `deterministic_mode`. A backend without one says so in `shape_problem`."""

    @classmethod
    @abc.abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the kernel is importable here and handles this device and dtype."""

    @classmethod
    def shape_problem(cls, shape: KernelShape) -> str | None:
        """Why the kernel has no kernel for calls of `shape` (None: it has). Asked once per shape, for a
        backend whose `supports(shape.device, shape.dtype)` holds; by default every shape runs (a kernel
        taking one bottom-right window per call says `offset_window_problem` for windows at offsets)."""
        return None

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        segments: Segments,
        causal: bool,
        scale: float,
        window: BlockWindow | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of each q segment over its kv segment: (out [Tq, Hq, Dv], lse [Hq, Tq]). With a
        `window` the window rule (module doc) is the mask and `causal` must be True."""

    @abc.abstractmethod
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        segments: Segments,
        causal: bool,
        scale: float,
        window: BlockWindow | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of this block, in the dtypes of q, k, v, for the rows' final `out` and `lse`."""


def half_precision_cuda_problem(
    device: torch.device, dtype: torch.dtype, library_problem: Callable[[], str | None], kernel: str
) -> str | None:
    """Why a library's fp16/bf16 CUDA kernel (TE, flash-attn) cannot run on `device` with `dtype`: not
    CUDA, another dtype, the library's own problem (absent, wrong version), or compute capability < 8.0."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return "it takes float16 or bfloat16 only"
    problem = library_problem()
    if problem is not None:
        return problem
    if torch.cuda.get_device_capability(device)[0] < 8:
        return f"{kernel} needs compute capability 8.0 or newer"
    return None


def pad_head_dim(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`x` [..., d] zero-padded to [..., head_dim] (`x` itself when d == head_dim): V, and out / dout of
    a backward, for a kernel that takes V only at Q's and K's head dim (module doc: exact)."""
    return x if x.shape[-1] == head_dim else torch.nn.functional.pad(x, (0, head_dim - x.shape[-1]))


def narrow_head_dim(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The first `head_dim` columns of `x` [..., d], contiguous (`x` itself when d == head_dim): a padded
    kernel's out and dV cut back to V's head dim."""
    return x if x.shape[-1] == head_dim else x[..., :head_dim].contiguous()


def grads_by_recompute(
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block gradients for kernels whose backward cannot take an external (out, lse): recompute the
    block's (o_b, lse_b) with autograd and back-propagate the block's share of the merged output.

    With w = exp(lse_b - lse) the merged output is O = sum_b w_b o_b, so dL/do_b = w dO and
    dL/dlse_b = w * rowsum(dO * (o_b - O)); autograd through the kernel then gives the exact block
    gradients (the same as a flash backward fed the final out and lse). Costs one extra forward.
    """
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        block_out, block_lse = forward(*leaves)
        weight = torch.exp(block_lse - lse)  # [H, T]
        dout_acc = dout.to(block_lse.dtype)
        grad_out = (weight.t().unsqueeze(-1) * dout_acc).to(block_out.dtype)
        grad_lse = weight * (dout_acc * (block_out.to(dout_acc.dtype) - out.to(dout_acc.dtype))).sum(-1).t()
        grads = torch.autograd.grad((block_out, block_lse), leaves, (grad_out, grad_lse))
    return grads[0], grads[1], grads[2]
