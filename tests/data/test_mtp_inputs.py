"""Multi-token prediction's inputs under HDP, every rank in one process (data/mtp_shift.py, megatron/layers/mtp.py).

Reference: Megatron's own `roll_tensor` applied d times to each whole document (input ids, labels, position
ids, loss mask: what Megatron's MTP computes for a one-document micro-batch), its loss weight at depth d
Megatron's `original / rolled` token counts, then cut into the zigzag shards of the plan. Every rank's
collated depth-1..D rows must equal it, for documents whole and on rings of 2..4 ranks (chunks shorter than
D, documents shorter than 2k and than D), with a random loss mask.
"""

import types

import numpy as np
import pytest
import torch

from megatron_hdp.attention.layout import zigzag_token_indices
from megatron_hdp.data.collate import collate_microbatch, empty_microbatch
from megatron_hdp.data.mtp_shift import MTPRolls
from megatron_hdp.megatron.layers.mtp import hdp_roll_tensor, install_mtp
from megatron_hdp.plan.hand_plan import plan_from_rings

DEPTH = 2
LENGTHS = [9, 1, 17, 3, 26, 2, 12]
RINGS = [(0,), (1,), (1, 2), (3, 0, 2), (0, 1, 2, 3), (2, 3), (3,)]
SLOTS = [0, 0, 1, 0, 1, 0, 1]


def _raw(seq, start, end):
    return np.random.default_rng(seq).integers(1, 500, size=LENGTHS[seq] + 1)[start:end]


def _mask(seq, start, end):
    return (np.random.default_rng(100 + seq).random(LENGTHS[seq]) < 0.7).astype(np.float32)[start:end]


def _megatron_rolls(seq):
    """[DEPTH, L] tokens, labels, positions and weighted loss mask of document `seq` by Megatron's roll."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    n = LENGTHS[seq]
    raw = torch.from_numpy(_raw(seq, 0, n + 1))
    current = [raw[:-1][None], raw[1:][None], torch.arange(n)[None], torch.from_numpy(_mask(seq, 0, n))[None]]
    original = current[3].sum()
    rows = []
    for _ in range(DEPTH):
        current = [roll_tensor(t, shifts=-1, dims=-1)[0] for t in current]
        weight = original / current[3].sum().clamp(min=1)  # process_mtp_loss's per-token rescaling
        rows.append(current[:3] + [current[3] * weight])
    return [torch.cat([row[i] for row in rows]) for i in range(4)]


def test_every_ranks_mtp_rows_equal_megatrons_roll_of_each_document():
    plan = plan_from_rings(LENGTHS, RINGS, SLOTS, num_ranks=4, capacity=64)
    reference = {seq: _megatron_rolls(seq) for seq in range(len(LENGTHS))}
    covered = {seq: 0 for seq in range(len(LENGTHS))}
    for rank in range(4):
        for mb in plan.microbatches(rank):
            packed = collate_microbatch(plan, mb, _raw, pad_to_multiple=8, read_loss_mask=_mask, rank=rank,
                                        mtp_depth=DEPTH)
            got = (packed.mtp_tokens, packed.mtp_labels, packed.mtp_position_ids, packed.mtp_loss_mask)
            assert packed.mtp_depth == DEPTH and all(t.shape == (DEPTH, packed.num_tokens) for t in got)
            for group in packed.groups:
                lo, hi = group.tokens
                if not group.seq_ids:  # padding: no input, no target, no loss
                    assert all(not t[:, lo:hi].any() for t in got)
                    continue
                position = group.ring.index(rank)
                offset = lo
                for seq in group.seq_ids:
                    rows = zigzag_token_indices([LENGTHS[seq]], len(group.ring), position)
                    for want, have in zip(reference[seq], got):
                        torch.testing.assert_close(have[:, offset:offset + len(rows)], want[:, rows].to(have.dtype),
                                                   rtol=1e-6, atol=0)
                    offset += len(rows)
                    covered[seq] += len(rows)
                assert offset == hi
    assert covered == dict(enumerate(LENGTHS))
    padding = empty_microbatch(rank=0, num_tokens=3, mtp_depth=DEPTH)
    assert padding.mtp_tokens.shape == (DEPTH, 3) and not padding.mtp_loss_mask.any()


def _rolls():
    plan = plan_from_rings(LENGTHS, RINGS, SLOTS, num_ranks=4, capacity=64)
    packed = collate_microbatch(plan, plan.microbatches(0)[1], _raw, rank=0, mtp_depth=DEPTH)
    return packed, MTPRolls.of_batch(packed)


def test_hdp_roll_answers_each_of_megatrons_rolls_from_the_loader():
    from megatron.core.transformer.multi_token_prediction import roll_tensor as megatrons

    packed, rolls = _rolls()
    roll = hdp_roll_tensor(megatrons)
    params = types.SimpleNamespace(mtp_rolls=rolls)
    inputs = rolls.inputs
    ids = inputs["input_ids"]
    for depth in range(DEPTH):  # MultiTokenPredictionLayer._get_embeddings: each layer rolls what it got
        ids, _ = roll(ids, shifts=-1, dims=-1, cp_group=None, packed_seq_params=params)
        assert torch.equal(ids[0], packed.mtp_tokens[depth])
    # A copy of the input ids has the labels' dtype and shape: outside Megatron's MTP loss it is refused,
    # never taken for the labels' copy (which would train depth d on the labels, one token ahead)
    for stray in (inputs["input_ids"].clone(), inputs["labels"].clone()):
        with pytest.raises(ValueError, match="cannot roll this tensor"):
            roll(stray, -1, -1, None, params)
    with rolls.copying(inputs["labels"]):  # what hdp_process_mtp_loss opens around Megatron's MTP loss
        labels, mask = inputs["labels"].clone(), rolls.normaliser  # process_mtp_loss copies the labels first
        assert mask.sum() == 1  # the count Megatron takes before rolling
        for depth in range(DEPTH):
            labels, _ = roll(labels, -1, -1, None, params)
            mask, count = roll(mask, -1, -1, None, params)
            assert torch.equal(labels[0], packed.mtp_labels[depth])
            assert torch.equal(mask[0], packed.mtp_loss_mask[depth])
            assert count == 1  # Megatron's original / rolled = 1: the weights are in the mask
            got_depth, tokens = rolls.loss_tokens(labels)  # what the token-level log counts at this depth
            assert got_depth == depth + 1 and torch.equal(tokens[0], packed.mtp_loss_mask[depth] > 0)
        with pytest.raises(ValueError, match="cannot roll this tensor"):
            roll(inputs["labels"].clone(), -1, -1, None, params)  # a second copy: not Megatron's pattern
    assert rolls.loss_tokens(inputs["labels"]) == (0, None) and rolls.loss_tokens(ids) == (0, None)
    _, total = roll(inputs["position_ids"], -1, -1, None, params, return_sum=False)  # megatron-core 0.20
    assert total is None
    with pytest.raises(ValueError, match="cannot roll this tensor"):
        roll(torch.zeros(1, packed.num_tokens), -1, -1, None, params)
    with pytest.raises(ValueError, match="rolls it 3 times"):
        roll(ids, -1, -1, None, params)
    with pytest.raises(ValueError, match="without MTP rolls"):
        roll(ids, -1, -1, None, types.SimpleNamespace(mtp_rolls=None))
    plain = torch.arange(6)[None]  # not an HDP micro-batch: Megatron's own roll
    assert torch.equal(roll(plain, -1, -1, None, None)[0], megatrons(plain, -1, -1, None, None)[0])


def test_install_mtp_is_idempotent_and_checks_megatrons_signatures(monkeypatch):
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    monkeypatch.setattr(mtp, "roll_tensor", mtp.roll_tensor)
    monkeypatch.setattr(gpt_model, "process_mtp_loss", gpt_model.process_mtp_loss)
    install_mtp()
    installed = mtp.roll_tensor, gpt_model.process_mtp_loss
    install_mtp()
    assert (mtp.roll_tensor, gpt_model.process_mtp_loss) == installed
    assert all(wrapper._hdp_original is not wrapper for wrapper in installed)

    def list_roll(tensors, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):  # Megatron-LM dev's
        return tensors

    monkeypatch.setattr(mtp, "roll_tensor", list_roll)
    with pytest.raises(ValueError, match="HDP's MTP was written for"):
        install_mtp()
    monkeypatch.setattr(mtp, "roll_tensor", installed[0])

    def other_loss(hidden_states, labels, loss_mask, output_layer):
        return hidden_states

    monkeypatch.setattr(gpt_model, "process_mtp_loss", other_loss)
    with pytest.raises(ValueError, match="process_mtp_loss takes"):
        install_mtp()


def test_megatrons_mtp_loss_takes_each_documents_weight_even_without_depth0_loss_tokens(monkeypatch):
    """Megatron's own `process_mtp_loss` through `hdp_process_mtp_loss`, one process, against autograd of
    the loss written out: depth 1's gradient is scale x (the weighted depth-1 mask) x token losses. The
    micro-batch is a ring chunk inside an SFT prompt (no depth-0 loss token) whose next positions are
    answer tokens: with Megatron's per-micro-batch ratio (depth-0 over depth-1 loss tokens, 0 here) it
    would train nothing."""
    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_hdp.megatron.layers.mtp import hdp_process_mtp_loss

    monkeypatch.setattr(mtp, "roll_tensor", hdp_roll_tensor(mtp.roll_tensor))
    torch.manual_seed(0)
    tokens, vocab, hidden = 5, 7, 3
    chain = [torch.randint(0, vocab, (1, tokens)) for _ in range(2)]
    mask0, mask1 = torch.zeros(1, tokens), torch.tensor([[0.0, 0.0, 0.0, 1.25, 1.25]])  # depth 1: weight 5/4
    rolls = MTPRolls(tokens=[c.clone() for c in chain], labels=chain, position_ids=[torch.zeros_like(c) for c in chain],
                     loss_mask=[mask0, mask1])
    weight = torch.randn(hidden, vocab, requires_grad=True)
    states = torch.randn(2 * tokens, 1, hidden)

    def output_layer(h, weight=None, runtime_gather_output=None):
        return h @ weight, None

    def token_losses(labels, logits):  # [1, T] from labels [1, T] and logits [T, 1, V], as Megatron's
        return torch.nn.functional.cross_entropy(logits[:, 0], labels[0], reduction="none")[None]

    config = types.SimpleNamespace(mtp_num_layers=1, mtp_detach_heads=False, mtp_loss_scaling_factor=0.5,
                                   calculate_per_token_loss=True)
    out = hdp_process_mtp_loss(mtp.process_mtp_loss)(
        hidden_states=states, labels=chain[0], loss_mask=rolls.inputs["loss_mask"], output_layer=output_layer,
        output_weight=weight, runtime_gather_output=None, is_training=False, compute_language_model_loss=token_losses,
        config=config, packed_seq_params=types.SimpleNamespace(mtp_rolls=rolls))
    out.sum().backward()  # the MTP loss's gradient rides on the returned hidden states (MTPLossAutoScaler)
    got = weight.grad.clone()
    weight.grad = None
    (0.5 * (mask1 * token_losses(chain[1], states[tokens:] @ weight)).sum()).backward()
    torch.testing.assert_close(got, weight.grad)
    assert got.abs().sum() > 0
