"""The MoE router's auxiliary losses under HDP (megatron_hdp/megatron/layers/moe_aux_loss.py).

Padding micro-batches — the loss-free micro-batches a rank runs to keep its EP group's all-to-alls (or
PP's 1F1B) aligned — must give the router no gradient: a real micro-batch followed by a padding one
must leave every router weight gradient exactly as the real micro-batch alone, with the load-balancing
loss and the z-loss on. Megatron's stock router fails that check (a padding token is routed like any
other), which shows the check can fail. Exactness of the per-document loss against plain data
parallelism on several ranks, rings and EP included: tests/megatron/test_megatron_exactness.py (EP=2 case).
"""

import pytest
import torch

from megatron_hdp.comm.launch import run_gloo

AUX_LOSS_COEFF = 0.5
Z_LOSS_COEFF = 0.1
LENGTHS = [37, 5, 20]
PACKING_DEPENDENT = ["seq_aux_loss", "global_aux_loss"]


def _padding_and_rejections(rank, world_size):
    """Router weight gradients {router: {padded: [per layer]}} of a real micro-batch without and with a
    padding micro-batch after it, for the HDP router and Megatron's stock one (the same model, its
    routers' class swapped back); and the error each packing-dependent load-balancing type raises."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hdp.data.collate import collate_microbatch, empty_microbatch
    from megatron_hdp.harness.exactness import VOCAB_SIZE, token_reader
    from megatron_hdp.megatron.core_api.forward_step import make_forward_step
    from megatron_hdp.plan.hand_plan import random_plan
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt

    state = initialize_hdp(seed=3)
    config = tiny_llama_config(num_moe_experts=4, moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_z_loss_coeff=Z_LOSS_COEFF)
    model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=64)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == config.num_layers
    plan = random_plan(LENGTHS, num_ranks=1, seed=5, pp_size=1)
    real = [collate_microbatch(plan, mb, token_reader(1, LENGTHS), rank=0) for mb in plan.microbatches(0)]
    forward_step = make_forward_step(hdp_global_ranks=state.hdp_global_ranks)
    grads = {}
    for kind in ("hdp", "stock"):
        if kind == "stock":
            for router in routers:
                router.__class__ = TopKRouter
        grads[kind] = {}
        for padded in (False, True):
            batches = real + [empty_microbatch(rank=0, num_tokens=3)] * padded
            model.zero_grad()
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=max(b.num_tokens for b in batches), micro_batch_size=1,
                forward_only=False,
            )
            grads[kind][padded] = [r.weight.grad.clone() for r in routers]
    rejected = {}
    for load_balancing_type in PACKING_DEPENDENT:
        config = tiny_llama_config(num_moe_experts=4, moe_aux_loss_coeff=0.01)
        config.moe_router_load_balancing_type = load_balancing_type
        try:
            build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=64)
        except ValueError as error:
            rejected[load_balancing_type] = str(error)
    return grads, rejected


@pytest.fixture(scope="module")
def results():
    return run_gloo(_padding_and_rejections, 1, timeout_s=180)[0]


def test_padding_microbatch_adds_no_router_gradient(results):
    grads, _ = results
    for kind in ("hdp", "stock"):
        assert all(g.abs().sum() > 0 for g in grads[kind][False]), f"{kind}: the router got no gradient"
    assert all(torch.equal(a, b) for a, b in zip(grads["hdp"][False], grads["hdp"][True]))
    # the same check fails for Megatron's stock router: its aux loss and z-loss route padding tokens too
    assert not any(torch.equal(a, b) for a, b in zip(grads["stock"][False], grads["stock"][True]))


@pytest.mark.parametrize("load_balancing_type", PACKING_DEPENDENT)
def test_packing_dependent_load_balancing_types_are_rejected(results, load_balancing_type):
    _, rejected = results
    assert repr(load_balancing_type) in rejected.get(load_balancing_type, "")


def test_document_rows_of_a_packed_microbatch(monkeypatch):
    """Whole documents keep their rows; a ring-split document's shard rows are the member's zigzag
    chunks (the members' rows add up to the document); padding is in no document."""
    from megatron_hdp.attention import core_attention
    from megatron_hdp.attention.core_attention import HDPBatchMeta

    # one process plays every ring member here: no ring plan (its kernel tensors) is built for a rank
    # this process is not
    monkeypatch.setattr(core_attention, "prepare_ring_plan", lambda *args, **kwargs: None)
    from megatron_hdp.attention.layout import AttentionGroup
    from megatron_hdp.megatron.layers.moe_aux_loss import DocumentRows, document_rows

    def meta(rank, shard):
        groups = [AttentionGroup(ring=(rank,), seq_ids=(0, 1), seqlens=(5, 3), tokens=(0, 8))] if rank == 0 else []
        start = groups[-1].tokens[1] if groups else 0
        groups.append(AttentionGroup(ring=(2, 0, 1), seq_ids=(4,), seqlens=(10,), tokens=(start, start + shard)))
        groups.append(AttentionGroup(ring=(rank,), seq_ids=(), seqlens=(2,), tokens=(start + shard, start + shard + 2)))
        return HDPBatchMeta(groups=tuple(groups), hdp_global_ranks=(10, 11, 12), position_ids=torch.zeros(0))

    # zigzag over 3 members, 6 chunks of a 10-token document: [0,1) [1,3) [3,5) [5,6) [6,8) [8,10)
    shards = {2: 1 + 2, 0: 2 + 2, 1: 2 + 1}  # HDP rank -> tokens: ring position p holds chunks p and 5 - p
    assert sum(shards.values()) == 10
    assert document_rows(meta(0, shards[0]), hdp_rank=0) == [
        DocumentRows(seq=0, rows=(0, 5), length=5, peers=()),
        DocumentRows(seq=1, rows=(5, 8), length=3, peers=()),
        DocumentRows(seq=4, rows=(8, 12), length=10, peers=(12, 11)),
    ]
    for rank in (1, 2):
        assert document_rows(meta(rank, shards[rank]), hdp_rank=rank) == [
            DocumentRows(seq=4, rows=(0, shards[rank]), length=10, peers=tuple(10 + r for r in (2, 0, 1) if r != rank))
        ]
