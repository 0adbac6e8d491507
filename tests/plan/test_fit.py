"""The one cost-model fit (`plan/cost/fit.py`): known coefficients come back, nothing goes negative, and the
CostModel made from a fit keeps what was not fitted."""

import dataclasses

import numpy as np
import pytest

from megatron_hdp.plan.cost.fit import (
    fit_activation, fit_alltoall_rate, fit_compute, fit_jitter, fit_relative, fitted_cost_model,
)
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.presets import analytic_cost_model

SEQ_LENS = (256, 512, 1024, 2048, 4096)


def test_fits_recover_exact_coefficients():
    a1, b1, g, a2, b2 = 3e-9, 2e-6, 4e-4, 5000.0, 1e6
    seconds = [a1 * s * s + b1 * s + g for s in SEQ_LENS]
    assert fit_compute(SEQ_LENS, seconds) == pytest.approx((a1, b1, g), rel=1e-6)
    assert fit_activation(SEQ_LENS, [int(a2 * s + b2) for s in SEQ_LENS]) == pytest.approx((a2, b2), rel=1e-6)


def test_fits_never_go_negative_and_need_enough_points():
    lens = (100, 200, 400)
    assert min(fit_compute(lens, [1.0 / s for s in lens])) >= 0  # falling times: no negative coefficient
    with pytest.raises(ValueError, match="at least 3"):
        fit_compute(lens[:2], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        fit_activation(lens[:1], [10.0])
    with pytest.raises(ValueError, match="3 sequence lengths but 2 measured"):
        fit_compute(lens, [1.0, 2.0])


def test_relative_error_weighs_short_rows_as_long_ones():
    """Hand case: T = s exactly except one short row 10% high; relative least squares over rows s=1 and
    s=1000 (one coefficient) puts the error in proportion, where absolute least squares would ignore
    the short row. Closed form: minimise ((c - 1.1)/1.1)^2 + ((1000c - 1000)/1000)^2."""
    features = np.array([[1.0], [1000.0]])
    measured = np.array([1.1, 1000.0])
    (c,) = fit_relative(features, measured)
    expected = (1 / 1.1 + 1.0) / (1 / 1.1**2 + 1.0)
    assert c == pytest.approx(expected, rel=1e-9)


def test_outliers_are_dropped_only_when_asked():
    s = np.arange(1.0, 41.0)
    features = np.stack([s**2, s, np.ones_like(s)], axis=1)
    measured = features @ [1e-3, 1e-2, 0.5]
    measured[7] *= 4.0  # one preempted rank
    np.testing.assert_allclose(fit_relative(features, measured, outlier_mads=5.0), [1e-3, 1e-2, 0.5], rtol=1e-9)
    assert not np.allclose(fit_relative(features, measured), [1e-3, 1e-2, 0.5], rtol=1e-3)


def test_fitted_cost_model_replaces_only_the_fitted_coefficients():
    base = analytic_cost_model("llama-7b")
    refitted = fitted_cost_model((1e-9, 2e-6, 3e-4), base=base)
    assert (refitted.a1, refitted.b1, refitted.g) == (1e-9, 2e-6, 3e-4)
    assert dataclasses.replace(refitted, a1=base.a1, b1=base.b1, g=base.g) == base
    fresh = fitted_cost_model((1e-9, 2e-6, 3e-4), (100.0, 0.0), num_layers=2, ring_bandwidth=1e9,
                              kv_bytes_per_token=16.0, d2h_bandwidth=1e9, h2d_bandwidth=1e9)
    assert (fresh.a2, fresh.b2, fresh.num_layers) == (100.0, 0.0, 2)
    with pytest.raises(ValueError):
        fitted_cost_model((-1.0, 0.0, 0.0), base=base)  # the cost model's own check still applies


def test_fit_of_noisy_times_stays_near_the_truth():
    """5% multiplicative noise on 8 lengths (seeded): each coefficient within 15% of the truth and every
    fitted time within 6% of the noiseless one, where a fit that only "tracks the points" by 50% could be
    anything."""
    a1, b1, g = 3e-9, 2e-6, 4e-4
    rng = np.random.default_rng(0)
    lengths = (128, 256, 512, 768, 1024, 2048, 3072, 4096)
    seconds = [(a1 * s * s + b1 * s + g) * (1 + 0.05 * rng.standard_normal()) for s in lengths]
    fitted = fit_compute(lengths, seconds)
    assert fitted == pytest.approx((a1, b1, g), rel=0.15)
    for s in lengths:
        truth = a1 * s * s + b1 * s + g
        assert fitted[0] * s * s + fitted[1] * s + fitted[2] == pytest.approx(truth, rel=0.06)


def test_fit_jitter_recovers_the_spread_of_normal_times_from_their_leads():
    """Monte Carlo reference: members' times drawn as mean x (1 + sigma N(0, 1)) on rings of 2, 4 and 8;
    the fit inverts the expected lead of the slowest member (a numerical integral, not these draws)."""
    rng = np.random.default_rng(0)
    sigma = 0.08
    phases = [1.0 + sigma * rng.standard_normal(k) for k in (2, 4, 8) for _ in range(4000)]
    assert fit_jitter(phases) == pytest.approx(sigma, rel=0.03)
    assert fit_jitter([[2.0, 2.0], [1.0, 1.0, 1.0, 1.0]]) == 0.0  # equal members: no lead


def test_fit_jitter_is_fitted_to_the_lead_not_the_spread():
    """Heavy tails (one member of eight 30 % slow, the rest equal): the standard deviation over members is
    0.096 of the mean, but the slowest leads the mean by 0.253, which the fitted jitter must reproduce
    through E[max of 8 normals] (0.178, not 0.096)."""
    slow = [1.3] + [1.0] * 7
    lead = max(slow) / np.mean(slow) - 1.0
    expected_max_of_8 = 1.4236  # E[max of 8 standard normals], tabulated
    assert fit_jitter([slow] * 3) == pytest.approx(lead / expected_max_of_8, rel=1e-3)
    assert fit_jitter([slow]) > np.std(slow) / np.mean(slow) * 1.5


def test_fit_jitter_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least one coupled phase"):
        fit_jitter([[1.0], []])
    with pytest.raises(ValueError, match="> 0"):
        fit_jitter([[1.0, 0.0]])


def test_fit_alltoall_rate_recovers_a_planted_rate_and_what_the_cost_model_charges_with_it():
    """Calls of 64-4,096 tokens' routed copies (512 B each, 3/4 crossing in an EP 4 group) timed as a planted
    80 us + crossing bytes / 2.5 GB/s with +-2% noise give rate and latency back within 3%; the cost model
    with that rate charges what the planted rate gives, written out by hand: 4 transfers a layer of 3/4 of
    512 B per token of the fullest member, 2 layers."""
    rate, latency = 2.5e9, 80e-6
    crossing = np.repeat([64, 256, 1024, 4096], 3) * 512 * 3 / 4
    noise = np.random.default_rng(0).uniform(-0.02, 0.02, crossing.size)
    fitted_rate, fitted_latency = fit_alltoall_rate(crossing, (latency + crossing / rate) * (1 + noise))
    assert fitted_rate == pytest.approx(rate, rel=0.03) and fitted_latency == pytest.approx(latency, rel=0.03)
    model = CostModel(a1=0.0, b1=1e-5, g=0.0, a2=0.0, b2=0.0, kv_bytes_per_token=256.0, num_layers=2,
                      ring_bandwidth=1e12, expert_parallel_size=4, expert_alltoall_bytes_per_token=512.0,
                      expert_alltoall_bandwidth=fitted_rate)
    assert model.expert_alltoall_seconds_per_token() == pytest.approx(2 * 4 * 512 * 3 / 4 / rate, rel=0.03)
    without_rate = dataclasses.replace(model, expert_alltoall_bandwidth=None)  # the link's, as on a GPU
    assert without_rate.expert_alltoall_seconds_per_token() == pytest.approx(2 * 4 * 512 * 3 / 4 / 1e12, rel=1e-12)


def test_fit_alltoall_rate_without_a_time_per_byte_and_its_refusals():
    assert fit_alltoall_rate([1e3, 1e6], [5e-5, 5e-5]) == (None, pytest.approx(5e-5))
    with pytest.raises(ValueError, match="2 distinct sizes"):
        fit_alltoall_rate([1e3, 1e3], [5e-5, 6e-5])
    with pytest.raises(ValueError, match="2 all-to-all sizes but 1"):
        fit_alltoall_rate([1e3, 1e6], [5e-5])
    with pytest.raises(ValueError, match="expert_alltoall_bandwidth must be > 0"):
        CostModel(a1=0.0, b1=0.0, g=0.0, a2=0.0, b2=0.0, kv_bytes_per_token=1.0, num_layers=1, ring_bandwidth=1.0,
                  expert_alltoall_bandwidth=0.0)
