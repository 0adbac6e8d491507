"""The MoE router's auxiliary losses under HDP (megatron_hdp/megatron/moe_aux_loss.py).

Padding micro-batches — the loss-free micro-batches a rank runs to keep its EP group's all-to-alls (or
PP's 1F1B) aligned — must give the router no gradient: a real micro-batch followed by a padding one
must leave every router weight gradient exactly as the real micro-batch alone, with the load-balancing
loss and the z-loss on. Megatron's stock router fails that check (a padding token is routed like any
other), which shows the check can fail. Exactness of the per-document loss against plain data
parallelism on several ranks, rings and EP included: tests/test_megatron_exactness.py (EP=2 case).
"""

import pytest
import torch

from megatron_hdp.comm.launch import run_gloo

AUX_LOSS_COEFF = 0.5
Z_LOSS_COEFF = 0.1
LENGTHS = [37, 5, 20]


def _router_grads(rank, world_size, stock_router):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_hdp.data.collate import collate_microbatch, empty_microbatch
    from megatron_hdp.megatron.exactness import VOCAB_SIZE, token_reader
    from megatron_hdp.megatron.forward_step import make_forward_step
    from megatron_hdp.megatron.hand_plan import random_plan
    from megatron_hdp.megatron.initialize import initialize_hdp
    from megatron_hdp.megatron.model import build_gpt, tiny_llama_config

    state = initialize_hdp(seed=3)
    config = tiny_llama_config(num_moe_experts=4, moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_z_loss_coeff=Z_LOSS_COEFF)
    model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=64)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == config.num_layers
    if stock_router:
        for router in routers:
            router.__class__ = TopKRouter
    plan = random_plan(LENGTHS, num_ranks=1, seed=5, pp_size=1)
    real = [collate_microbatch(plan, mb, token_reader(1, LENGTHS), rank=0) for mb in plan.microbatches(0)]
    forward_step = make_forward_step(hdp_global_ranks=state.hdp_global_ranks)
    grads = {}
    for padded in (False, True):
        batches = real + [empty_microbatch(rank=0, num_tokens=3)] * padded
        model.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=max(b.num_tokens for b in batches), micro_batch_size=1,
            forward_only=False,
        )
        grads[padded] = [r.weight.grad.clone() for r in routers]
    return grads


@pytest.mark.parametrize("stock_router", [False, True], ids=["hdp-router", "megatron-stock-router"])
def test_padding_microbatch_adds_no_router_gradient(stock_router):
    grads = run_gloo(_router_grads, 1, stock_router, timeout_s=120)[0]
    same = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    assert same != stock_router, "stock router: padding changed the router gradient" if stock_router else ""
    assert all(g.abs().sum() > 0 for g in grads[False])


def _build_router(rank, world_size, load_balancing_type):
    from megatron_hdp.megatron.exactness import VOCAB_SIZE
    from megatron_hdp.megatron.initialize import initialize_hdp
    from megatron_hdp.megatron.model import build_gpt, tiny_llama_config

    initialize_hdp(seed=3)
    config = tiny_llama_config(num_moe_experts=4, moe_aux_loss_coeff=0.01)
    config.moe_router_load_balancing_type = load_balancing_type
    try:
        build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=64)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("load_balancing_type", ["seq_aux_loss", "global_aux_loss"])
def test_packing_dependent_load_balancing_types_are_rejected(load_balancing_type):
    error = run_gloo(_build_router, 1, load_balancing_type, timeout_s=120)[0]
    assert error is not None and repr(load_balancing_type) in error
