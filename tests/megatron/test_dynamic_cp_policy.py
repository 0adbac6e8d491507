"""Policy megatron-dynamic-cp: Megatron-LM dev's DefaultDynamicCPScheduler, converted to a valid StepPlan.

The reference is the scheduler's own answer, asked by this test in its own process (the checkout on
PYTHONPATH, the class imported by name and called directly), not through the policy's worker: each plan
micro-batch j must hold exactly the sequences Megatron put in micro-batch j on that rank, in its order,
each on a ring of the ranks that share it. Needs MEGATRON_LM_DIR (a Megatron-LM dev checkout); without it
only the refusal tests run.
"""

import json
import os
import random
import subprocess
import sys

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.megatron.comparison.dynamic_cp import plan_megatron_dynamic_cp
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies

COST = analytic_cost_model("llama-7b", tp_size=8)
CHECKOUT = os.environ.get("MEGATRON_LM_DIR")
needs_checkout = pytest.mark.skipif(not CHECKOUT, reason="set MEGATRON_LM_DIR to a Megatron-LM dev checkout")

REFERENCE = """
import json, sys
from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler
answers = []
for case in json.loads(sys.stdin.read()):
    scheduler = DefaultDynamicCPScheduler(case["capacity"], 1, case["num_ranks"], case["group"])
    try:
        answers.append(scheduler.get_groups_and_subsamples(list(enumerate(case["lengths"]))))
    except AssertionError as error:  # e.g. a sequence needs a power-of-two CP group larger than the pool
        answers.append(str(error))
print(json.dumps(answers))
"""


def _cases():
    rng = random.Random(11)
    capacity = 1000
    for num_ranks in (1, 2, 4, 8, 16, 6):
        for _ in range(4):
            n = rng.randint(1, 40)
            lengths = [max(1, min(int(rng.paretovariate(0.9) * 150), capacity * num_ranks)) for _ in range(n)]
            yield {"lengths": lengths, "num_ranks": num_ranks, "capacity": capacity, "group": None}
    for num_ranks in (4, 8):  # VPP with PP 2: micro-batch count a multiple of microbatch_group_size_per_vp_stage
        lengths = [rng.randint(50, 3000) for _ in range(30)]
        yield {"lengths": lengths, "num_ranks": num_ranks, "capacity": capacity, "group": 2}


CASES = list(_cases())


@pytest.fixture(scope="module")
def megatron_answers():
    """Megatron's raw sample_id_groups for every case, from one process that imports the checkout."""
    env = {**os.environ, "PYTHONPATH": CHECKOUT}
    done = subprocess.run([sys.executable, "-c", REFERENCE], input=json.dumps(CASES), env=env, cwd=CHECKOUT,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plan(case):
    config = HDPConfig(hdp_capacity=case["capacity"], hdp_policy="megatron-dynamic-cp")
    if case["group"]:
        return plan_megatron_dynamic_cp(case["lengths"], num_ranks=case["num_ranks"], config=config, cost_model=COST,
                                        pp_size=case["group"], vpp_size=2).validate()
    return make_plan(case["lengths"], num_ranks=case["num_ranks"], config=config, cost_model=COST)


@needs_checkout
@pytest.mark.parametrize("index", range(len(CASES)))
def test_plan_is_megatrons_schedule(index, megatron_answers):
    case, groups = CASES[index], megatron_answers[index]
    if isinstance(groups, str):  # Megatron refused the batch: so does the policy, quoting it
        with pytest.raises(ValueError, match="Megatron's scheduler refused the batch"):
            _plan(case)
        return
    plan = _plan(case)
    num_ranks, lengths = case["num_ranks"], case["lengths"]
    # equal micro-batch counts on every rank: Megatron's count (a multiple of the VPP group when asked)
    assert [len(r.microbatches) for r in plan.ranks] == [len(groups)] * num_ranks
    if case["group"]:
        assert len(groups) % case["group"] == 0
    for j, per_rank in enumerate(groups):
        for rank, ids in enumerate(per_rank):
            assert [sh.seq for sh in plan.ranks[rank].microbatches[j].shards] == ids
    for seq in plan.sequences:
        k = len(seq.ring)
        assert k & (k - 1) == 0, f"ring size {k} is not a power of two"
        j = next(j for j, per_rank in enumerate(groups) if seq.id in per_rank[seq.ring[0]])
        assert list(seq.ring) == [r for r in range(num_ranks) if seq.id in groups[j][r]]
    # every token of every sequence exactly once, counted here from the shards' chunks
    covered = {i: [] for i in range(len(lengths))}
    for rank in plan.ranks:
        for mb in rank.microbatches:
            for shard in mb.shards:
                covered[shard.seq].extend(shard.chunks)
    for i, chunks in covered.items():
        position = 0
        for start, end in sorted(chunks):
            assert start == position and end > start
            position = end
        assert position == lengths[i]


@needs_checkout
def test_simulate_runs_it():
    spec = ClusterSpec(model="llama-7b", num_gpus=64, tp_size=8, capacity=8192)
    result = compare_policies(spec, context=32768, distribution="github", global_batch_tokens=256 * 1024,
                              policies=["static", "megatron-dynamic-cp"], progress=False)
    stats = result.stats["megatron-dynamic-cp"]
    assert stats.error is None and stats.tokens_per_second > 0


def test_without_checkout_it_says_so(monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    with pytest.raises(ValueError, match="set MEGATRON_LM_DIR"):
        make_plan([100, 2000], num_ranks=4, config=HDPConfig(hdp_capacity=1000), cost_model=COST,
                  policy="megatron-dynamic-cp")
    spec = ClusterSpec(model="llama-7b", num_gpus=64, tp_size=8, capacity=8192)
    result = compare_policies(spec, context=32768, distribution="github", global_batch_tokens=256 * 1024,
                              policies=["static", "megatron-dynamic-cp"], progress=False)
    assert "MEGATRON_LM_DIR" in result.stats["megatron-dynamic-cp"].error
    assert result.stats["static"].error is None


def test_checkout_without_the_scheduler_says_so(monkeypatch, tmp_path):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "core" / "__init__.py").write_text("")
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="cannot import DefaultDynamicCPScheduler") as error:
        make_plan([100, 2000], num_ranks=4, config=HDPConfig(hdp_capacity=1000), cost_model=COST,
                  policy="megatron-dynamic-cp")
    assert "\n" not in str(error.value)
