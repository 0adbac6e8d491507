"""The cost model counts multi-token prediction (plan/cost/presets.py `ModelShape.mtp_num_layers`).

Independent count: Megatron-LM's own `num_floating_point_operations` (megatron/training/training.py,
what Megatron logs as TFLOP/s), which counts MTP as D more layers like the decoder's last, D
projections with their norms and D more LM-head passes. The planner's training FLOPs of one sequence,
read back from install()'s cost model (T(s) = (a1 s^2 + b1 s) x layers, each coefficient times the
FLOP/s it was divided by), must equal Megatron's for a dense model, a MoE model and a DeepSeek-like one (a dense first layer,
narrower experts, a shared expert) at depths 0, 1 and 2.
"""

import pytest

from megatron_hdp.megatron.pretrain.args import parse_and_check
from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model
from megatron_hdp.plan.cost.presets import ModelShape, analytic_cost_model, hardware_profile

FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 96 --swiglu --seq-length 256 --max-position-embeddings 256 --micro-batch-size 1 "
    "--global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--attention-dropout 0.0 --position-embedding-type rope --hdp --calculate-per-token-loss"
).split()
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
DEEPSEEK_LIKE = MOE + ["--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "48",
                       "--moe-layer-freq", "[0,1]"]
"""A dense first layer, then MoE with narrower experts and a shared expert (DeepSeek's layout)."""


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("moe", [[], MOE, DEEPSEEK_LIKE], ids=["dense", "moe", "deepseek-like"])
def test_planner_flops_equal_megatrons_count_with_mtp(depth, moe):
    from megatron.training.training import num_floating_point_operations

    mtp = ["--mtp-num-layers", str(depth)] if depth else []
    args, config = parse_and_check(FLAGS + moe + mtp, world_size=1)
    args.padded_vocab_size = args.vocab_size  # 128: what Megatron pads it to for TP 1 (set at initialize)
    cost = _cost_model(args, config)  # what install() plans with (h100 without a GPU)
    hw = hardware_profile("h100")
    s = args.seq_length
    planned = (cost.a1 * hw.peak_flops * hw.attention_efficiency * s * s
               + cost.b1 * hw.peak_flops * hw.efficiency * s) * cost.num_layers
    assert planned == pytest.approx(num_floating_point_operations(args, batch_size=1), rel=1e-12)


def test_mtp_adds_its_layers_to_time_activations_and_parameters():
    base = ModelShape(32, 4096, 32, 8, 14336, 128256)
    mtp = ModelShape(32, 4096, 32, 8, 14336, 128256, mtp_num_layers=1)
    without, with_mtp = analytic_cost_model(base), analytic_cost_model(mtp)
    h = base.hidden_size
    assert with_mtp.a1 == pytest.approx(without.a1 * 33 / 32)  # one more layer of attention
    assert with_mtp.a2 == pytest.approx(without.a2 * 33 / 32 + 2 * 2 * h / 32)  # and its projection's input
    assert with_mtp.num_layers == 32  # the pipeline still splits the decoder's layers
    layer = (mtp.num_parameters() - base.num_parameters()) - (2 * h * h + 3 * h)
    assert layer == (base.num_parameters() - 2 * base.vocab_size * h) / 32  # one decoder layer's parameters
    with pytest.raises(ValueError, match="mtp_num_layers must be >= 0"):
        ModelShape(2, 64, 4, 4, 128, 128, mtp_num_layers=-1)
