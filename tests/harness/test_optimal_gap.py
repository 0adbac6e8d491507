"""benchmarks/optimal_gap.py on a few tiny cases: every bound it records stays at or below the optimum the
exact planner proves (balance's step above it), and an unproven case's gap is capped by the highest bound
proven on it, the rigid-ring bound where the solver's dual is lower."""

import json

import pytest



@pytest.fixture
def optimal_gap(benchmark_script):
    return benchmark_script("optimal_gap")


def test_the_recorded_bounds_sit_below_the_proven_optimum(optimal_gap, tmp_path):
    out = tmp_path / "gap.json"
    assert optimal_gap.main(["--cases", "4", "--max-ranks", "4", "--max-docs", "6", "--time-limit", "20",
                             "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert all(case["optimum_s"] for case in cases)  # proven in seconds at this size
    for case in cases:
        assert case["bound_s"] <= case["optimum_s"] * (1 + 1e-9) <= case["balance_s"] * (1 + 2e-9)
        assert case["rigid_s"] <= case["optimum_s"] * (1 + 1e-9)
    assert any(case["rigid_s"] > case["bound_s"] * 1.001 for case in cases)  # the rigid bound sees more


def test_an_unproven_case_is_capped_by_its_highest_bound(optimal_gap):
    row = {"balance_s": 1.0, "dual_s": 0.9, "rigid_s": 0.95}
    assert optimal_gap.dual(row) == 0.95
    assert optimal_gap.dual({**row, "rigid_s": None}) == 0.9
