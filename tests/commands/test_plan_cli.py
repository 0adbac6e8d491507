"""`megatron-hdp plan`: the side-by-side table and the plan JSON, through the real CLI entry point."""

import json

import numpy as np

import pytest

from megatron_hdp.cli import main
from megatron_hdp.commands.arguments import parse_count
from megatron_hdp.plan.lengths import lengths_dir
from megatron_hdp.plan.step_plan import StepPlan


def test_plan_command_writes_a_valid_plan(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [9000, 3000, 200, 200, 1500, 700, 4096, 4097]) + "\n")
    out = tmp_path / "plan.json"
    code = main(["plan", "--lengths", str(lengths), "--ranks", "8", "--capacity", "4K", "--compare",
                 "balance,naive,static", "--policy", "naive", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    for policy in ("balance", "naive", "static"):
        assert f"\n{policy} " in text
    assert "ring MB" in text  # the transient ring memory (`commands.plan.peak_ring_buffer_bytes`)
    plan = StepPlan.from_dict(json.loads(out.read_text())).validate()
    assert plan.policy == "naive" and plan.num_ranks == 8 and plan.capacity == 4096
    assert plan.lengths == [9000, 3000, 200, 200, 1500, 700, 4096, 4097]


@pytest.mark.skipif(not lengths_dir().is_dir(), reason=f"shared length lists (the wlbllm mix) not found at {lengths_dir()}")
def test_plan_command_reports_a_refusing_policy(tmp_path, capsys):
    # 6 ranks: static DP x CP needs a power-of-two CP group dividing the rank count; this mix cannot have one
    code = main(["plan", "--dist", "wlbllm", "--tokens", "64K", "--ranks", "6", "--capacity", "4K", "--compare",
                 "balance,static", "--pp", "2"])
    assert code == 0
    text = capsys.readouterr().out
    assert "static              n/a:" in text and "\nbalance " in text


def test_parse_count():
    assert parse_count("32M") == 32 << 20 and parse_count("16k") == 16384 and parse_count("100") == 100
    with pytest.raises(Exception, match="not a count"):
        parse_count("lots")


def _balance_plan(num_ranks: int, lengths: list[int], capacity: int = 4096):
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.cost.presets import analytic_cost_model

    config = HDPConfig(hdp=True, hdp_capacity=capacity, hdp_offload=False)
    return make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=analytic_cost_model("llama-7b"),
                     policy="balance")


def test_plan_picture_of_64_ranks_draws_every_rank_and_every_ring(tmp_path):
    from megatron_hdp.plan.lengths import sample_global_batch
    from megatron_hdp.sim.plots import plan_grid, plot_plans

    # one 48-rank-ish document and many short ones: the layout issue 17 found, where the first 32 ranks
    # showed only the long ring and none of the ranks running many micro-batches
    lengths = [180_000] + sample_global_batch("github", num_tokens=400_000, seed=3, max_length=4096)
    plan = _balance_plan(64, lengths)
    grid = plan_grid(plan)
    assert grid.ring_seq.shape[0] == grid.fill.shape[0] == len(grid.rank_time) == 64
    rings = {seq.id for seq in plan.sequences if len(seq.ring) > 1}
    assert rings and rings == set(grid.ring_seq[grid.ring_seq >= 0].tolist())
    for schedule in plan.ranks:  # every rank's micro-batches are cells, and no more
        assert (~np.isnan(grid.fill[schedule.rank])).sum() == len(schedule.microbatches)
    busiest = max(range(64), key=lambda r: plan.ranks[r].est_time)
    assert f"all 64 ranks (busiest {busiest}," in grid.describe()
    # what the first-32-ranks picture missed: ranks beyond 32 that run the most micro-batches
    deepest = max(len(r.microbatches) for r in plan.ranks)
    assert any(len(plan.ranks[r].microbatches) == deepest for r in range(32, 64))
    out = tmp_path / "plans.png"
    plot_plans({"balance": plan}, str(out))
    assert out.stat().st_size > 10_000


def test_gantt_of_many_ranks_draws_the_busiest_and_idlest():
    from megatron_hdp.sim.plots import ranks_to_draw

    busy = np.random.default_rng(0).random(4096)
    ranks, which = ranks_to_draw(busy, limit=64)
    assert len(ranks) == 64 and ranks == sorted(ranks)
    assert set(np.argsort(busy)[-16:].tolist()) <= set(ranks) and set(np.argsort(busy)[:16].tolist()) <= set(ranks)
    assert which.startswith("64 of 4096 ranks")
    assert ranks_to_draw(busy[:40])[0] == list(range(40))


def _saved_plans(directory, steps: int):
    """Plans as `--hdp-save-plans` writes them: StepPlan JSON, each sequence with its source."""
    directory.mkdir()
    paths = []
    for step in range(1, steps + 1):
        plan = _balance_plan(8, [9000, 3000, 200, 200 * step, 1500, 700, 4096])
        data = plan.to_dict()
        for entry in data["sequences"]:
            entry["source"] = {"dataset": f"/data/corpus_{entry['id'] % 2}", "document": 10 * step + entry["id"],
                               "offset": 0}
        path = directory / f"iter_{step:07d}.json"
        path.write_text(json.dumps(data))
        paths.append(path)
    return paths


def test_step_plan_from_dict_tolerates_the_saved_source(tmp_path):
    path = _saved_plans(tmp_path / "plans", 1)[0]
    data = json.loads(path.read_text())
    plan = StepPlan.from_dict(data).validate()
    for entry in data["sequences"]:
        del entry["source"]
    assert plan == StepPlan.from_dict(data)


def test_plan_from_saved_file_and_directory(tmp_path, capsys):
    paths = _saved_plans(tmp_path / "plans", 3)
    picture = tmp_path / "step.png"
    assert main(["plan", "--from", str(paths[0]), "--plot", str(picture)]) == 0
    text = capsys.readouterr().out
    assert "iter_0000001" in text and "2 datasets, 7 documents" in text and picture.stat().st_size > 10_000
    strip = tmp_path / "steps.png"
    assert main(["plan", "--from", str(tmp_path / "plans"), "--plot", str(strip), "--plot-steps", "2"]) == 0
    text = capsys.readouterr().out
    assert all(f"iter_000000{i}" in text for i in (1, 2, 3)) and "(2 of 3 steps)" in text
    assert strip.stat().st_size > picture.stat().st_size  # two panels side by side


def test_plan_from_a_file_that_is_not_a_plan_is_one_line(tmp_path, capsys):
    broken = tmp_path / "iter_0000001.json"
    broken.write_text(json.dumps({"policy": "balance", "num_ranks": 2}))
    assert main(["plan", "--from", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(broken) in err and "--from" in err
