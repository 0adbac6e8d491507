"""The online cost-model refit learns the true compute coefficients from per-rank step times."""

import dataclasses

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.fit import fit_relative
from megatron_hdp.plan.cost.online_refit import OnlineRefit, RefitSettings, compute_features
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model, model_shape

TRUE = analytic_cost_model(model_shape("llama-7b"), "h100")
WRONG = dataclasses.replace(TRUE, a1=TRUE.a1 * 3, b1=TRUE.b1 / 3, g=TRUE.g * 3)
CONFIG = HDPConfig(hdp=True, hdp_capacity=16384)


def _plan(seed: int, model=TRUE):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(7.5, 1.2, size=48).astype(int) + 16, 60000)
    return make_plan(lengths, num_ranks=8, config=CONFIG, cost_model=model)


def _true_compute(plan) -> np.ndarray:
    """Each rank's compute under the true coefficients, straight from the cost model's own time of each
    micro-batch (independent of the refit's features): rings' traffic is hidden at these sizes."""
    times = np.zeros(plan.num_ranks)
    lengths = {s.id: s.length for s in plan.sequences}
    for rank in range(plan.num_ranks):
        for mb in plan.microbatches(rank):
            shards = [(lengths[sh.seq], sh.num_tokens, (0,)) for sh in mb.shards]  # compute only: no ring
            times[rank] += TRUE.microbatch_time(shards)
    return times


def test_features_reproduce_the_cost_models_compute_time():
    plan = _plan(0)
    coef = np.array([TRUE.a1, TRUE.b1, TRUE.g])
    np.testing.assert_allclose(compute_features(plan, num_layers=TRUE.num_layers) @ coef, _true_compute(plan), rtol=1e-9)
    # a saved plan (JSON dict) gives the same features
    np.testing.assert_allclose(compute_features(plan.to_dict(), num_layers=TRUE.num_layers),
                               compute_features(plan, num_layers=TRUE.num_layers))


def test_fit_recovers_the_coefficients_and_drops_an_outlier():
    plans = [_plan(seed) for seed in range(4)]
    features = np.concatenate([compute_features(p, num_layers=TRUE.num_layers) for p in plans])
    measured = np.concatenate([_true_compute(p) for p in plans])
    measured[5] *= 4.0  # one preempted rank
    coef = fit_relative(features, measured, outlier_mads=RefitSettings().outlier_mads)
    np.testing.assert_allclose(coef, [TRUE.a1, TRUE.b1, TRUE.g], rtol=1e-6, atol=1e-12)


def test_updates_are_bounded_and_converge_from_a_wrong_model():
    refit = OnlineRefit(WRONG, RefitSettings(warmup_steps=2, max_step=1.5))
    history = []
    for seed in range(12):
        plan = _plan(seed, refit.model)
        before = refit.model
        after = refit.observe(plan, _true_compute(plan))
        for name in ("a1", "b1", "g"):
            ratio = getattr(after, name) / getattr(before, name)
            assert 1 / 1.5 - 1e-12 <= ratio <= 1.5 + 1e-12
        history.append(after)
    assert history[1] == WRONG  # still warming up
    assert refit.updates == 10
    assert refit.model.a1 == pytest.approx(TRUE.a1, rel=1e-6)
    assert refit.model.b1 == pytest.approx(TRUE.b1, rel=1e-6)
    assert refit.model.g == pytest.approx(TRUE.g, rel=1e-6)  # started 3x too large
    assert refit.model.ring_bandwidth == TRUE.ring_bandwidth  # everything else is kept
    resumed = OnlineRefit.from_state_dict(refit.state_dict(), model=WRONG)  # only a1, b1, g differ
    assert resumed.model == refit.model and resumed.steps_seen == 12


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_step"):
        RefitSettings(max_step=1.0)
    with pytest.raises(ValueError, match="measured times"):
        OnlineRefit(TRUE).observe(_plan(0), [1.0, 2.0])


def test_saved_refit_is_restored_and_exported_by_calibrate(tmp_path):
    """What a checkpoint saves (`save_refit`) is what --load restores and `calibrate --from-run` exports."""
    from megatron_hdp.cli import main
    from megatron_hdp.plan.cost.model import CostModel
    from megatron_hdp.plan.cost.online_refit import load_refit, save_refit

    refit = OnlineRefit(WRONG, RefitSettings(warmup_steps=0))
    for seed in range(3):
        plan = _plan(seed, refit.model)
        refit.observe(plan, _true_compute(plan))
    save_refit(refit, tmp_path / "ckpt", iteration=30)
    assert (tmp_path / "ckpt" / "hdp_cost_model_iter_0000030.json").is_file()
    restored = load_refit(tmp_path / "ckpt", model=WRONG)
    assert restored.model == refit.model and restored.steps_seen == 3 and restored.updates == 3
    assert load_refit(tmp_path, model=WRONG) is None
    assert main(["calibrate", "--from-run", str(tmp_path / "ckpt"), "--output", str(tmp_path / "cm.json")]) == 0
    assert CostModel.from_json(tmp_path / "cm.json") == refit.model


def test_the_all_to_all_is_taken_off_before_the_fit():
    """Under EP 2 with a MoE model, measured compute = the learned terms + the all-to-all's transfers
    (`alltoall_seconds`, checked against the published shapes in test_mesh_cost.py): the refit learns the
    true coefficients, not ones inflated by the transfers."""
    from megatron_hdp.plan.cost.mesh import mesh_cost_model
    from megatron_hdp.plan.cost.online_refit import alltoall_seconds

    true = mesh_cost_model(model="mixtral-8x7b", hardware="h100", ep_size=2)
    assert true.expert_alltoall_seconds_per_token() > 0
    refit = OnlineRefit(dataclasses.replace(true, b1=true.b1 * 1.2), RefitSettings(warmup_steps=0, max_step=2.0))
    for seed in range(4):
        plan = _plan(seed, true)
        features = compute_features(plan, num_layers=true.num_layers, expert_parallel_size=2,
                                    expert_share=true.expert_share)
        refit.observe(plan, features @ [true.a1, true.b1, true.g] + alltoall_seconds(plan, true))
    assert refit.model.b1 == pytest.approx(true.b1, rel=1e-6) and refit.model.a1 == pytest.approx(true.a1, rel=1e-6)
