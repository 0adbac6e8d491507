"""`rope_angles` (RoPE at each token's own position, issue 13 fault 7) equals Megatron's own
`RotaryEmbedding` table indexed by those positions, bit for bit, for the layouts Megatron offers."""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_hdp.megatron.layer_spec import rope_angles


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("interpolation", [None, 4.0])
def test_rope_angles_equal_megatron_table(interleaved, interpolation, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where Megatron's get_emb moves inv_freq
    rotary = RotaryEmbedding(
        kv_channels=32, rotary_percent=1.0, rotary_interleaved=interleaved,
        seq_len_interpolation_factor=interpolation, rotary_base=10000, use_cpu_initialization=True,
    )
    positions = torch.tensor([5, 6, 7, 0, 1, 2, 3, 40, 41, 0])
    expected = rotary(int(positions.max()) + 1)[positions]
    assert torch.equal(rope_angles(rotary, positions), expected)
