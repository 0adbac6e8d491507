"""The planner's Act(s) and T(s) under Megatron's activation recomputation, and the warning when a
calibrated cost model was measured under another setting than the run's."""

import json
import logging

import pytest
import torch

from megatron_hdp.harness.calibrate import measure_layer
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.presets import analytic_cost_model, model_shape
from megatron_hdp.plan.cost.sharding import min_ring_size


def test_analytic_model_under_recompute():
    none, full, selective = (analytic_cost_model("llama-7b", recompute_granularity=g) for g in ("none", "full", "selective"))
    h = model_shape("llama-7b").hidden_size
    assert full.a2 == 2 * h  # bf16 layer input only
    assert full.b1 == pytest.approx(none.b1 * 4 / 3) and full.a1 == pytest.approx(none.a1 * 4 / 3)
    assert selective.a1 == pytest.approx(none.a1 * 4 / 3) and (selective.b1, selective.a2) == (none.b1, none.a2)
    assert (none.recompute_granularity, full.recompute_granularity) == ("none", "full")
    # fewer activation bytes per token: with offload a member keeps more tokens, so a long document needs
    # strictly fewer ranks (without offload both need ceil(200000 / 8192) = 25: activations do not enter)
    kwargs = dict(capacity=8192, num_ranks=64, max_offload_ratio=1.0)
    assert min_ring_size(200_000, cost_model=full, **kwargs)[0] < min_ring_size(200_000, cost_model=none, **kwargs)[0]
    with pytest.raises(ValueError, match="'partial'"):
        analytic_cost_model("llama-7b", recompute_granularity="partial")
    with pytest.raises(ValueError, match="recompute_granularity"):
        CostModel.from_dict({**none.to_dict(), "recompute_granularity": "sometimes"})


def test_calibration_under_full_recompute_keeps_only_the_layer_input():
    """Measured, not assumed: under torch's reentrant checkpoint (what Megatron's full recompute uses) the
    saved bytes of a layer are exactly its input, s * h * 4 bytes in fp32."""
    shape = model_shape("llama-7b").__class__(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=128
    )
    kwargs = dict(shape=shape, seq_lens=[64, 128], device=torch.device("cpu"), dtype=torch.float32, repeats=1)
    plain = measure_layer(**kwargs)
    full = measure_layer(**kwargs, recompute="full")
    for p, f in zip(plain, full):
        assert f.activation_bytes == f.seq_len * 64 * 4
        assert p.activation_bytes > 4 * f.activation_bytes
    with pytest.raises(ValueError, match="'selective'"):
        measure_layer(**kwargs, recompute="selective")


@pytest.mark.parametrize("recorded,flags,warns", [
    ("none", [], False), ("none", ["--recompute-granularity", "full"], True),
    ("full", ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], False),
    ("full", [], True), (None, ["--recompute-granularity", "selective"], True),
])
def test_validate_hdp_args_warns_when_the_cost_model_was_measured_otherwise(tmp_path, caplog, recorded, flags, warns):
    from megatron_flags import HDP, TINY

    from megatron_hdp.megatron.pretrain.args import parse_and_check

    data = analytic_cost_model("llama-7b").to_dict()
    if recorded is None:  # a JSON from before the field existed: measured without recompute
        del data["recompute_granularity"]
    else:
        data["recompute_granularity"] = recorded
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="megatron_hdp.megatron.pretrain.args"):
        parse_and_check(TINY + HDP + ["--hdp-cost-model", str(path), *flags], world_size=2)
    messages = [r.getMessage() for r in caplog.records if "recompute granularity" in r.getMessage()]
    assert bool(messages) == warns, messages
    if warns:
        assert str(path) in messages[0] and f"measured with recompute granularity {recorded or 'none'}" in messages[0]
