"""Attention sinks: one more term, exp(s_h), in every row's softmax normaliser (Megatron's `softmax_type`).

Megatron's `off-by-one` softmax (s_h = 0) and `learnable` softmax (s_h = `softmax_offset[h]`, a parameter
per query head) divide each row's scores by exp(s_h) + sum_j exp(S_j) instead of sum_j exp(S_j): as if
every row attended to one more key with score s_h and a zero value. The kernels and the ring compute plain
attention, (out, lse); the sink is applied once to the finished rows (after the ring's LSE merge, or after
the one local call of whole documents):

    lse' = logaddexp(lse, s_h),    out' = out * exp(lse - lse') = out * sigmoid(lse - s_h).

Backward. The kernels' block backward takes the rows' final (out, lse) (`backends/base.py`); fed
(out', lse') it recomputes the probabilities exp(S - lse'), which are the true ones, and
D' = rowsum(dO * out'), which is the true D (the sink's column carries no value), so it yields the exact
dq, dk, dv with no correction. The sink's own gradient is
    ds_h = -sum over rows of exp(s_h - lse') * D'
(d out'/d s_h = -p_sink * out', p_sink = exp(s_h - lse')). Every rank sums over its own rows; the
parameter's gradient is reduced over ranks like every other parameter's (Megatron's DDP).

No kernel needs to know about the sink, so every kernel serves a sink on every path (whole documents,
rings, windows, deterministic mode; the sum over rows is a plain reduction, deterministic).
"""

from __future__ import annotations

import torch


def check_sink(sink: torch.Tensor | None, q: torch.Tensor) -> None:
    """ValueError unless `sink` is None or one logit per query head of `q` ([Hq]) on q's device."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor) or sink.shape != (q.shape[1],) or not sink.is_floating_point():
        shape = tuple(sink.shape) if isinstance(sink, torch.Tensor) else type(sink).__name__
        raise ValueError(f"sink must be a float tensor of one logit per query head ({q.shape[1]},), got {shape}")
    if sink.device != q.device:
        raise ValueError(f"sink is on {sink.device} but q is on {q.device}; make the sink where the layer runs")


def _logits(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """s_h as a [H, 1] column in lse's (fp32 or fp64) dtype."""
    return sink.detach().to(lse.dtype)[:, None]


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of finished rows (out [T, H, D], lse [H, T]) with the sink's term in each normaliser;
    out' keeps out's dtype, the scaling is computed in lse's dtype."""
    logits = _logits(sink, lse)
    kept = torch.sigmoid(lse - logits)  # exp(lse - lse'): the share of the mass the keys keep
    scaled = out.to(lse.dtype) * kept.t().unsqueeze(-1)
    return scaled.to(out.dtype), torch.logaddexp(lse, logits)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """ds_h = -sum_rows exp(s_h - lse') * rowsum(dout * out') for rows with the sink's (out', lse'), in
    the sink's dtype."""
    rowsum = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).t()  # D' [H, T]
    share = torch.exp(_logits(sink, lse) - lse)  # the sink column's probability
    return -(share * rowsum).sum(-1).to(sink.dtype)
