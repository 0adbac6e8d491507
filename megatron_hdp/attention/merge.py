"""The log-sum-exp merge of partial attention results, in fp32 (fp64 for fp64 inputs).

Attention of a row over the union of two key blocks is the weighted mean of the two partial outputs,
the weights being each block's share exp(lse_b - lse) of the softmax mass:
    out = out - sigmoid(lse_b - lse) * (out - out_b),    lse = logaddexp(lse, lse_b).
The sigmoid form never exponentiates a large number. Both inputs must be finite rows (a row that
attends to nothing in a block is simply not part of that block).
"""

from __future__ import annotations

import torch


def merge_attention(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running (out [T, H, D], lse [H, T]) merged with one block's (block_out, block_lse), same rows.

    `out` and `lse` are in the accumulation dtype; `block_out` may be lower precision. Returns new
    tensors.
    """
    block_weight = torch.sigmoid(block_lse - lse).t().unsqueeze(-1)  # [T, H, 1]
    merged_out = out - block_weight * (out - block_out.to(out.dtype))
    return merged_out, torch.logaddexp(lse, block_lse)
