"""`--repeat N` of the benchmarks (benchmarks/repeats.py): every run kept, each figure as median and range
over the runs, checked against values worked by hand; and one benchmark's `--repeat 2` end to end on a
tiny size, its figures recomputed here from the runs it kept."""

import json
import statistics

import pytest



@pytest.fixture
def repeats(benchmark_script):
    return benchmark_script("repeats")


def _run(seconds: float, cpu: float, index: int) -> dict:
    return {"rows": [{"k": 1, "cpu_s": cpu, "wall_s": seconds, "kind": "ring"},
                     {"k": 2, "cpu_s": 2 * cpu, "wall_s": 3.0, "kind": "ring"}],
            "note": f"run {index}", "conditions": {"date": f"d{index}"}}  # loads set by the test


def test_medians_and_ranges_of_hand_made_runs(repeats):
    runs = [_run(4.0, 1.0, 0), _run(1.0, 3.0, 1), _run(2.0, 2.0, 2), _run(10.0, 0.5, 3)]
    loads = [(2.0, 9.0), (3.0, 1.5), (4.0, 4.0), (2.5, 3.0)]
    for run, (before, after) in zip(runs, loads):
        run["conditions"].update(load_average_before=[before, 0, 0], load_average_after=[after, 0, 0])
    combined = repeats.over_runs(runs)
    assert combined["repeat"] == 4 and combined["runs"] == runs
    first, second = combined["rows"]
    # medians of 4 values: the mean of the middle two, by hand
    assert first["wall_s"] == 3.0 and first["cpu_s"] == 1.5 and second["cpu_s"] == 3.0
    # a figure equal in every run stays a plain value; a label stays; `conditions` is not a figure
    assert first["k"] == 1 and second["wall_s"] == 3.0 and first["kind"] == "ring" and "conditions" not in combined
    assert combined["load_average_range"] == [1.5, 9.0]
    assert combined["note"] == ["run 0", "run 1", "run 2", "run 3"]  # differing text is listed run by run
    spread = combined["spread"]["rows"]
    assert spread[0]["wall_s"] == {"median": 3.0, "min": 1.0, "max": 10.0, "runs": 4}
    assert spread[1]["cpu_s"] == {"median": 3.0, "min": 1.0, "max": 6.0, "runs": 4}
    assert spread[0]["k"] == 1 and spread[1]["wall_s"] == 3.0


def test_odd_count_keys_missing_in_a_run_and_formatting(repeats):
    load = {"load_average_before": [1.0, 0, 0], "load_average_after": [1.0, 0, 0]}
    runs = [{"a": 5.0, "only_first": 1.0, "conditions": load}, {"a": 1.0, "conditions": load},
            {"a": 2.0, "conditions": load}]
    combined = repeats.over_runs(runs)
    assert combined["a"] == 2.0 and "only_first" not in combined
    assert repeats.format_spread(combined["spread"]["a"], "{:.2f}") == "2.00 [1.00, 5.00]"
    assert repeats.format_spread({"median": 0.5, "min": 0.25, "max": 1.0}, "{:.0f}", scale=1e3) == "500 [250, 1000]"
    assert repeats.format_spread(7.0, "{:.1f}") == "7.0"


def test_repeat_measurement_keeps_each_run_with_its_conditions(repeats):
    values = iter([3.0, 1.0, 2.0])
    reported = []
    runs = repeats.repeat_measurement(lambda: {"t": next(values)}, 3, report=lambda i, r: reported.append((i, r)))
    assert [r["t"] for r in runs] == [3.0, 1.0, 2.0]
    assert reported == [(0, {"t": 3.0}), (1, {"t": 1.0}), (2, {"t": 2.0})]
    for run in runs:
        assert set(run["conditions"]) == {"date", "load_average_before", "load_average_after"}
    low, high = repeats.load_range(runs)
    assert 0 <= low <= high


def test_repeat_below_one_is_refused(repeats, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    repeats.add_repeat_argument(parser)
    assert parser.parse_args(["--repeat", "3"]).repeat == 3
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--repeat", "0"])
    assert exit_info.value.code == 2 and "--repeat must be >= 1, got 0" in capsys.readouterr().err


def test_offload_bench_repeat_2_keeps_both_runs(repeats, tmp_path, capsys):
    """A tiny CPU offload_bench with --repeat 2: the JSON keeps two runs; each slowdown is taken inside
    its run; the top-level rows are the medians of the runs' rows and `spread` their range; selftest's
    target reads the medians."""
    import offload_bench

    from megatron_hdp.commands import selftest

    output = tmp_path / "offload.json"
    assert offload_bench.main(["--device", "cpu", "--seq-len", "64", "--hidden-size", "32",
                               "--num-attention-heads", "2", "--ffn-hidden-size", "64", "--num-layers", "2",
                               "--steps", "1", "--repeat", "2", "--output", str(output)]) == 0
    assert "over 2 runs: median [min, max]" in capsys.readouterr().out
    result = json.loads(output.read_text())
    assert result["repeat"] == 2 and len(result["runs"]) == 2
    for run in result["runs"]:
        base = run["rows"][0]
        assert base["ratio"] == 0.0
        for row in run["rows"]:
            assert row["slowdown"] == pytest.approx(row["step_time_s"] / base["step_time_s"] - 1)
    for i, row in enumerate(result["rows"]):
        times = [run["rows"][i]["step_time_s"] for run in result["runs"]]
        assert row["step_time_s"] == pytest.approx(statistics.median(times))
        figure = result["spread"]["rows"][i]["step_time_s"]
        if times[0] != times[1]:
            assert (figure["min"], figure["max"]) == (min(times), max(times))
        slowdowns = [run["rows"][i]["slowdown"] for run in result["runs"]]
        assert row["slowdown"] == pytest.approx(statistics.median(slowdowns))
        # memory and bytes moved do not depend on the run: plain values
        assert result["spread"]["rows"][i]["bytes_offloaded"] == row["bytes_offloaded"]
    half = next(r for r in result["rows"] if r["ratio"] == 0.5)
    ok, detail = selftest.offload_target(output)
    assert f"slowdown {half['slowdown']:.1%}" in detail


def test_step_bench_prints_its_spreads_as_before(repeats):
    """step_bench now takes `spread` and the formatting from repeats.py; its printed figures keep their form."""
    import step_bench

    figure = repeats.spread([2.53, 2.17, 2.30, 2.41, 2.20])
    assert figure == {"median": 2.30, "min": 2.17, "max": 2.53, "runs": 5}
    assert step_bench.format_spread("vs static", figure, unit="x") == "vs static 2.30x [2.17x, 2.53x]"
    assert step_bench.format_spread("median |error|", {"median": 0.089, "min": 0.052, "max": 0.328}) == \
        "median |error| 8.9% [5.2%, 32.8%]"
