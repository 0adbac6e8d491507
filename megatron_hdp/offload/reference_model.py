"""A Llama-shaped GPT in plain torch: what the offload tests, benchmark and calibration run.

Same GEMM shapes as a Megatron GPT layer of the given `ModelShape` (fused QKV with GQA, output
projection, SwiGLU MLP, pre-RMSNorm, RoPE) and the same attention kernel class (PyTorch's fused causal
`scaled_dot_product_attention`: flash on CUDA, the CPU flash kernel here), so its saved activations are
O(s) and its compute O(s^2) like the real model, without needing Megatron's parallel state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hdp.plan.cost.presets import ModelShape

_ROPE_BASE = 10000.0


def rope_tables(seq_len: int, head_dim: int, *, device: torch.device, dtype: torch.dtype):
    """cos and sin of rotary position embeddings, [seq_len, head_dim]."""
    inv_freq = 1.0 / _ROPE_BASE ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class ReferenceLayer(nn.Module):
    """One pre-norm Llama decoder layer on [batch, seq, hidden]."""

    def __init__(self, shape: ModelShape, *, device=None, dtype=None) -> None:
        super().__init__()
        h = shape.hidden_size
        self.num_heads = shape.num_attention_heads
        self.num_kv_heads = shape.num_query_groups
        self.head_dim = shape.channels_per_head
        kw = {"device": device, "dtype": dtype}
        self.attn_norm = nn.RMSNorm(h, **kw)
        self.qkv = nn.Linear(h, shape.q_channels + 2 * shape.kv_channels, bias=False, **kw)
        self.proj = nn.Linear(shape.q_channels, h, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(h, **kw)
        self.gate_up = nn.Linear(h, 2 * shape.ffn_hidden_size, bias=False, **kw)
        self.down = nn.Linear(shape.ffn_hidden_size, h, bias=False, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d, kv = self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(self.attn_norm(x)).split([self.num_heads * d, kv, kv], dim=-1)
        q = _rotate(q.view(b, s, -1, d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, -1, d).transpose(1, 2), cos, sin)
        v = v.view(b, s, -1, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads
        )
        x = x + self.proj(out.transpose(1, 2).reshape(b, s, self.num_heads * d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceGPT(nn.Module):
    """Embedding, `shape.num_layers` ReferenceLayers, final norm, LM head; forward returns the mean loss."""

    def __init__(self, shape: ModelShape, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.shape = shape
        self.embedding = nn.Embedding(shape.vocab_size, shape.hidden_size, **kw)
        self.layers = nn.ModuleList(ReferenceLayer(shape, **kw) for _ in range(shape.num_layers))
        self.final_norm = nn.RMSNorm(shape.hidden_size, **kw)
        self.output = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, **kw)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        cos, sin = rope_tables(
            tokens.shape[1], self.shape.hidden_size // self.shape.num_attention_heads, device=x.device, dtype=x.dtype
        )
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.final_norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
