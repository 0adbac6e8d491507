"""RoPE angles at each token's own position inside its document.

Megatron's attention rotates at positions restarting at every `cu_seqlens` boundary, wrong for a zigzag
shard whose tokens sit at positions [a, b) and [c, d) of their document; HDP's core attention and its
multi-latent attention rotate at the positions the collation computed (`HDPBatchMeta.position_ids`).
"""

from __future__ import annotations

import torch


def rope_angles(rotary: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """[T, 1, 1, dim] RoPE angles of each token at its own document position: Megatron's
    `RotaryEmbedding.get_emb` (same frequencies, interpolation and layout) evaluated at `position_ids`
    rather than tabulated for 0..max position. So no table of max-position rows per micro-batch (its
    `lru_cache` would keep up to 32 of them on the GPU) and no host sync to find the max position."""
    if rotary.inv_freq.device != position_ids.device:
        rotary.inv_freq = rotary.inv_freq.to(position_ids.device)  # once, as Megatron's get_emb does
    seq = position_ids.to(rotary.inv_freq.dtype)
    if rotary.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rotary.seq_len_interpolation_factor)
    freqs = torch.outer(seq, rotary.inv_freq)
    if rotary.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]
