"""`rope_angles` (RoPE at each token's own position, issue 13 fault 7) equals Megatron's own
`RotaryEmbedding` table indexed by those positions, bit for bit, for the layouts Megatron offers."""

import pytest
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_hdp.attention.rope import rope_angles


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


@pytest.mark.parametrize("scaling,mscale,mscale_all_dim", [(1.0, 1.0, 0.0), (40.0, 1.0, 1.0), (4.0, 0.707, 0.5)])
def test_multi_latent_attention_angles_equal_megatron_tables(scaling, mscale, mscale_all_dim, monkeypatch):
    """MLA's RoPE at each token's position (`mla.position_angles`): YaRN (DeepSeek-V3's scaling 40 with
    mscale = mscale_all_dim = 1; another mscale than mscale_all_dim; no scaling) equals Megatron's
    `YarnRotaryEmbedding` table at those positions bit for bit, with its mscale; plain RoPE, with a partial
    rotary dim, equals `RotaryEmbedding`'s with mscale 1."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding

    from megatron_hdp.megatron.layers.mla import position_angles

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    positions = torch.tensor([5, 6, 7, 0, 1, 2, 3, 900, 901, 0, 4095, 70000])
    yarn = YarnRotaryEmbedding(
        64, rotary_base=10000, scaling_factor=scaling, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=mscale, mscale_all_dim=mscale_all_dim, use_cpu_initialization=True,
    )
    table, table_mscale = yarn(int(positions.max()) + 1)
    angles, got_mscale = position_angles(yarn, positions)
    assert torch.equal(angles, table[positions]) and got_mscale == table_mscale
    assert (table_mscale != 1.0) == (mscale != mscale_all_dim and scaling > 1)
    rope = RotaryEmbedding(kv_channels=64, rotary_percent=0.5, rotary_base=10000, use_cpu_initialization=True)
    angles, got_mscale = position_angles(rope, positions)
    assert torch.equal(angles, rope(int(positions.max()) + 1)[positions]) and got_mscale == 1.0
