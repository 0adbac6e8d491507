"""Multi-latent attention under HDP is exact: loss and every gradient equal ordinary training of the batch.

Plain Megatron's MLA cannot run on the CPU (its local `DotProductAttention` takes no separate q/k and v
head dims in megatron-core 0.19; MLA needs TE's attention), so the reference is Megatron's own GPT with
its own `MLASelfAttention` (down and up projections, latent norms, RoPE or YaRN at positions 0..L-1 of
each document, its own softmax scale) around an independent float64 core attention
(`exactness_cases.ReferenceCoreAttention`), one document per micro-batch on one process. HDP runs
`HDPMLASelfAttention` (RoPE at the collated positions, V unpadded) and HDP's core attention: whole
documents on the local kernel, split ones on the K/V ring. Models (`MODELS`): DeepSeek-V3's attention
(a query latent, latent norms, YaRN with mscale != mscale_all_dim) on a dense model, and DeepSeek-V2-Lite's
(no query latent, plain RoPE) on a MoE model shaped as DeepSeek-V3's (a dense first layer by
`moe_layer_freq`, a shared expert, sigmoid routing with top-k scaling, the per-document load-balancing
loss and z-loss), and DeepSeek-V3's attention with a learnable sink (`softmax_type`, gpt-oss's).
Layouts: HDP = 5 with the sink and core-attention recompute (rings of 2 to 5 ranks and whole documents in
both steps), TP = 2 with sequence parallelism and `--recompute-modules mla_up_proj core_attn` x HDP = 2
(against Megatron at TP = 2: see that test), PP = 2 x HDP = 2 (the MoE model).
The reference launch also checks that the spec `--hdp` builds keeps Megatron's parameter names: the state
dict and sharded state dict keys of an HDP model equal those of Megatron's MLA spec.
"""

import dataclasses
import types

import pytest
import torch
from test_megatron_exactness import ADAM_EPS, BATCHES, MOE_CLIP_GRAD, MOE_LOSSES, NUM_EXPERTS, _check, _hdp, _init

from megatron_hdp.comm.launch import run_gloo

DEEPSEEK_MOE = dict(
    num_moe_experts=NUM_EXPERTS, moe_layer_freq=[0, 1], moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
    moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5, **MOE_LOSSES,
)
"""DeepSeek-V3's MoE layout, tiny: the first layer dense, then routed experts plus a shared one, sigmoid
scores with top-k scaling (its expert bias is left out: Megatron counts padding tokens into it, docs/moe.md)."""


def _models():
    from megatron_hdp.harness.model import tiny_mla_fields

    return {
        "mla-yarn-q-latent": tiny_mla_fields(),
        "mla-yarn-q-latent-sink": {**tiny_mla_fields(), "softmax_type": "learnable"},
        "mla-rope-moe": {**tiny_mla_fields(q_lora_rank=None, rope_type="rope"), **DEEPSEEK_MOE},
    }


def _state_dict_keys(model):
    from megatron.core.transformer.module import MegatronModule

    assert isinstance(model, MegatronModule)
    return sorted(model.state_dict()), sorted(model.sharded_state_dict())


def _reference(rank, world_size):
    from exactness_cases import reference_mla_block

    from megatron_hdp.harness.exactness import VOCAB_SIZE, full_weights, reference_steps
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training
    from megatron_hdp.megatron.layers.spec import hdp_layer_spec

    out = {}
    for name, fields in _models().items():
        _init()
        config = tiny_llama_config(**fields)
        model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False,
                          transformer_layer_spec=reference_mla_block(config))
        local = types.SimpleNamespace(transformer=dataclasses.replace(config, transformer_impl="local"))
        hdp_model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128,  # as `--hdp` builds it
                              transformer_layer_spec=hdp_layer_spec(local))
        keys = (_state_dict_keys(model), _state_dict_keys(hdp_model))
        init = full_weights(model)
        ddp, opt = wrap_for_training(model, adam_eps=ADAM_EPS, **(dict(clip_grad=MOE_CLIP_GRAD) if "moe" in name else {}))
        out[name] = {"init": init, "steps": reference_steps(ddp, opt, BATCHES), "keys": keys}
        destroy_hdp()
    return out


@pytest.fixture(scope="module")
def reference():
    return run_gloo(_reference, 1, timeout_s=240)[0]


def test_hdp_spec_keeps_megatrons_parameter_names(reference):
    """The spec `--hdp` builds (`hdp_layer_spec`: a layer spec for the dense model, Megatron's block spec with
    a dense and a MoE layer for the MoE one) against Megatron's MLA spec: the same keys."""
    for name, want in reference.items():
        (state, sharded), (hdp_state, hdp_sharded) = want["keys"]
        assert hdp_state == state and hdp_sharded == sharded, name
        assert any("linear_kv_up_proj" in key for key in state) and any("linear_q_up_proj" in k for k in state) == (
            "q-latent" in name)


RING_SIZES_SEED = 11
"""The seed of HDP = 5's random plans (`_plan` draws seed, seed + 1): each step has whole documents and
rings of 2, 3, 4 and 5 ranks."""


LATENT_RING_SIZES = ((2, 4), (3, 5))
"""Per step, the ring sizes that run the latent ring; the others the K/V ring: each size runs both."""


def test_mla_on_rings_of_two_to_five_ranks_with_a_sink_and_core_attention_recompute(reference):
    """HDP = 5, whole documents and rings of 2-5 ranks in each step, the latent ring on some rings and the
    K/V ring on the others (`LATENT_RING_SIZES`), a learnable sink on every layer and
    `--recompute-modules core_attn mlp` (the latent reaches the recomputed ring as an argument of the
    checkpointed call): loss and every gradient (`linear_kv_up_proj`'s, `linear_kv_down_proj`'s and the
    sink's included) equal the float64 reference."""
    from test_megatron_exactness import _plan

    name = "mla-yarn-q-latent-sink"
    for step, (_, lengths) in enumerate(BATCHES):
        plan = _plan(lengths, num_ranks=5, seed=RING_SIZES_SEED + step, pp_size=1, idle=False)
        assert {len(s.ring) for s in plan.sequences} == {1, 2, 3, 4, 5}
    case = dict(fields=_models()[name], latent_ring_sizes=LATENT_RING_SIZES, recompute="selective")
    results = run_gloo(_hdp, 5, 1, 1, 1, reference[name]["init"], RING_SIZES_SEED, False, case, timeout_s=300)
    _check(reference[name], results)
    assert any("softmax_offset" in grad for grad in results[0][0]["grads"])


def _tp_reference(rank, world_size, init, fields):
    """Megatron's own MLA (`_reference`'s model) at TP = `world_size` with sequence parallelism, one pipeline,
    each document its own micro-batch padded to a multiple of the TP size: this TP rank's grads."""
    from exactness_cases import reference_mla_block

    from megatron_hdp.harness.exactness import VOCAB_SIZE, load_full_weights, reference_steps
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training

    _init(tp=world_size)
    config = tiny_llama_config(sequence_parallel=True, **fields)
    model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False,
                      transformer_layer_spec=reference_mla_block(config))
    load_full_weights(model, init)
    ddp, opt = wrap_for_training(model, adam_eps=ADAM_EPS)
    return reference_steps(ddp, opt, BATCHES, token_multiple=world_size)


def test_mla_tensor_and_sequence_parallel_with_up_projection_and_core_attention_recompute(reference):
    """TP = 2 with sequence parallelism x HDP = 2, `--recompute-modules mla_up_proj core_attn`, the latent
    ring in step 1 and the K/V ring in step 2, against Megatron's own MLA at TP = 2 with sequence
    parallelism: TP rank by TP rank. (Not against TP = 1: Megatron's MLA with
    its local spec computes other gradients at TP = 2 than at TP = 1. The shared RoPE key's gradient
    reaches the column-parallel `linear_kv_down_proj` only from the heads of the TP rank that holds its
    columns, since `gather_from_tensor_model_parallel_region` splits the gradient back without a sum; and
    without sequence parallelism `finalize_model_grads` sums `q_layernorm`'s gradient, already whole on
    every rank, over TP. HDP runs Megatron's code there and gives the same gradients as Megatron.)"""
    name = "mla-yarn-q-latent"
    fields = _models()[name]
    want = run_gloo(_tp_reference, 2, reference[name]["init"], fields, timeout_s=240)
    case = dict(fields=fields, sp=True, recompute="mla_up_proj", latent_ring_sizes=((2,), ()))
    results = run_gloo(_hdp, 4, 2, 1, 1, reference[name]["init"], 31, False, case, timeout_s=240)
    for rank_steps in results:
        for step, got in enumerate(rank_steps):
            assert got["loss"] == pytest.approx(want[0][step]["loss"], rel=1e-5), f"step {step} loss"
            for grad_name, (info, grad) in got["grads"].items():
                where = f"step {step} grad of {grad_name} (TP rank {info.tp_rank})"
                torch.testing.assert_close(
                    torch.as_tensor(grad), torch.as_tensor(want[info.tp_rank][step]["grads"][grad_name]),
                    rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {m}",
                )
        assert rank_steps[0]["rings"] > 0


def test_mla_deepseek_moe_under_pipeline_parallelism(reference):
    name = "mla-rope-moe"
    fields = {k: v for k, v in _models()[name].items() if k not in ("num_moe_experts", *MOE_LOSSES)}
    case = dict(fields=fields, moe=True, block=True)
    results = run_gloo(_hdp, 4, 1, 2, 1, reference[name]["init"], 41, False, case, timeout_s=240)
    _check(reference[name], results)


def test_the_latent_ring_normalises_with_the_fused_norm_of_the_te_spec():
    """Under the TE spec `linear_kv_up_proj` is a layer-norm linear: the latent ring normalises the latent
    with that module's own `layer_norm_weight` (and bias), as its fused norm would (RMSNorm; LayerNorm with
    zero-centred gamma), and leaves it alone under the local spec (no norm parameters on the module)."""
    from megatron_hdp.megatron.layers.mla import normalised_latent

    latent = torch.randn(5, 16, dtype=torch.float64)
    weight, bias = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    fused = types.SimpleNamespace(layer_norm_weight=weight, layer_norm_bias=bias)
    config = types.SimpleNamespace(layernorm_zero_centered_gamma=False, layernorm_epsilon=1e-5, normalization="RMSNorm")
    rms = latent / (latent.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight
    torch.testing.assert_close(normalised_latent(fused, latent, config), rms)
    config = types.SimpleNamespace(
        layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6, normalization="LayerNorm")
    centred = latent - latent.mean(-1, keepdim=True)
    layer = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (weight + 1) + bias
    torch.testing.assert_close(normalised_latent(fused, latent, config), layer)
    assert normalised_latent(torch.nn.Linear(16, 8), latent, config) is latent


def test_with_gradient_accumulation_fusion_the_rings_weight_gradient_goes_to_main_grad():
    """Megatron's fused linears add their weight gradient into `main_grad` and DDP then ignores `.grad`:
    the latent ring's share (`fused_weight_grad`) goes there too, added to what is already there."""
    from megatron_hdp.megatron.layers.mla import fused_weight_grad

    weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    latent = torch.randn(5, 4, dtype=torch.float64)
    weight.main_grad = torch.ones(3, 4, dtype=torch.float32)
    (latent @ fused_weight_grad(weight).t()).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(weight.main_grad, (1 + latent.sum(0)).expand(3, 4).float())
