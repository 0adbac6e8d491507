"""`megatron-hdp plan`: the side-by-side table and the plan JSON, through the real CLI entry point."""

import json

import pytest

from megatron_hdp.cli import main
from megatron_hdp.commands.arguments import parse_count
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
    plan = StepPlan.from_dict(json.loads(out.read_text())).validate()
    assert plan.policy == "naive" and plan.num_ranks == 8 and plan.capacity == 4096
    assert plan.lengths == [9000, 3000, 200, 200, 1500, 700, 4096, 4097]


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
