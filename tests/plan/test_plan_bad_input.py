"""Bad input at the planner's boundary, fuzzed: `make_plan`, `CostModel` and its JSON either refuse with a
ValueError that names the offending value (before any collective could wait on it), or return a plan whose
every document is held exactly once within the capacity — never a hang, another exception, or a silently
wrong plan (a float length truncated, a NaN coefficient turned into a NaN step time)."""

import json
import math
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from plan_reference import assert_refusal_is_justified, fits_without_offload, static_cp

CM = analytic_cost_model("llama-7b")
POLICIES = ("balance", "naive", "static")
# a deadline per example turns a hang (or an accidental blow-up) into a failure instead of a stuck suite
FUZZ = settings(max_examples=60, deadline=timedelta(seconds=20), suppress_health_check=[HealthCheck.too_slow])

BAD_NUMBERS = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, -1, 0.5, 2.5, True, "8", None])


def held_exactly_once(plan, lengths, capacity):
    """Independent check of the plan: every token of every document held once, no micro-batch over C."""
    covered = {i: [] for i in range(len(lengths))}
    for rank in plan.ranks:
        for mb in rank.microbatches:
            assert mb.num_tokens <= mb.capacity
            for shard in mb.shards:
                covered[shard.seq].extend(shard.chunks)
    for i, chunks in covered.items():
        assert sorted(t for a, b in chunks for t in range(a, b)) == list(range(lengths[i])), f"document {i}"
    assert math.isfinite(plan.est_step_time) and plan.est_step_time > 0


@FUZZ
@given(
    # half the batches well formed (else few are: a refusal of a batch that fits must be drawn to be caught)
    lengths=st.one_of(st.lists(st.integers(1, 3000), min_size=1, max_size=12),
                      st.lists(st.one_of(st.integers(-5, 3000), BAD_NUMBERS), min_size=0, max_size=12)),
    num_ranks=st.one_of(st.integers(1, 9), st.integers(-2, 9), BAD_NUMBERS),
    capacity=st.sampled_from([1, 64, 1000]),
    offload=st.booleans(),
    policy=st.sampled_from(POLICIES),
)
def test_make_plan_refuses_by_name_or_plans_correctly(lengths, num_ranks, capacity, offload, policy):
    config = HDPConfig(hdp_capacity=capacity, hdp_offload=offload)
    try:
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=CM, policy=policy)
    except ValueError as error:
        text = str(error)
        not_integers = [n for n in lengths if not integral(n)]
        below_one = [n for n in lengths if integral(n) and n < 1]
        bad_ranks = not (isinstance(num_ranks, int) and not isinstance(num_ranks, bool) and num_ranks >= 1)
        if bad_ranks:
            assert "num_ranks" in text and str(num_ranks) in text, text
        elif not lengths:
            assert "empty global batch" in text
        elif not_integers:  # the offending values themselves, not merely some number of the batch
            assert str(not_integers[:5]) in text and "integer" in text, text
        elif below_one:
            assert str(below_one[:5]) in text and ">= 1" in text, text
        else:  # well-formed input refused: only a batch that cannot be planned (computed here), named
            assert_refusal_is_justified(text, lengths, num_ranks=num_ranks, capacity=capacity, policy=policy)
        return
    # accepted: then the input was well formed, plannable, and the plan is right
    assert all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths)
    assert isinstance(num_ranks, int) and not isinstance(num_ranks, bool) and num_ranks >= 1
    if not offload:  # without offload a document longer than all ranks hold cannot be planned
        assert all(fits_without_offload(n, num_ranks=num_ranks, capacity=capacity) for n in lengths), lengths
    assert plan.lengths == list(lengths) and len(plan.ranks) == num_ranks
    held_exactly_once(plan, lengths, capacity)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_batch_that_fits_is_planned(policy):
    """The other side of "refuses by name": a planner that refused too much would pass the fuzz above
    whenever it named a length. Batches of 1-12 documents that fit the pool without offload (computed
    independently, `plan_reference.fits_without_offload`) are planned, and correctly."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        num_ranks, capacity = int(rng.choice([1, 2, 4, 8])), int(rng.choice([64, 1000]))
        lengths = [int(n) for n in rng.integers(1, capacity * num_ranks // 2 + 2, size=int(rng.integers(1, 13)))]
        lengths = [n for n in lengths if fits_without_offload(n, num_ranks=num_ranks, capacity=capacity)] or [1]
        config = HDPConfig(hdp_capacity=capacity, hdp_offload=False)
        if policy == "static":  # static needs a power-of-two CP group that divides the pool: 1, 2, 4, 8 do
            assert num_ranks % static_cp(max(lengths), capacity=capacity, num_ranks=num_ranks) == 0
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=CM, policy=policy)
        held_exactly_once(plan, lengths, capacity)


def integral(n) -> bool:
    """A count the planner must accept as an integer: int or integral float, never a bool or a string."""
    if isinstance(n, bool):
        return False
    return isinstance(n, int) or (isinstance(n, float) and math.isfinite(n) and n == int(n))


@FUZZ
@given(field=st.sampled_from(sorted(CM.to_dict())), value=BAD_NUMBERS)
def test_cost_model_refuses_non_finite_or_out_of_range_coefficients(field, value):
    data = {**CM.to_dict(), field: value}
    optional = ("host_memory_bytes", "ranks_per_node", "intra_node_bandwidth", "expert_alltoall_bandwidth")
    if field in optional and value is None:
        assert getattr(CostModel.from_dict(data), field) is None  # None: unlimited / unknown, the default
        return
    harmless = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    counts = ("num_layers", "expert_parallel_size", "ranks_per_node")
    if field in counts:  # counts must be positive integers
        harmless = harmless and isinstance(value, int) and value > 0
    if field == "activation_dtype_bytes":
        harmless = harmless and value in (1, 2, 4, 8)
    if field == "expert_share":  # a share of the micro-batch's work
        harmless = harmless and value <= 1
    if field in ("recompute_granularity", "ring_kind"):  # a name, never a number
        harmless = False
    if harmless and value >= 0:
        if not (value == 0 and field.endswith("bandwidth")):
            CostModel.from_dict(data)
            return
    with pytest.raises(ValueError, match=field):
        CostModel.from_dict(data)


@pytest.mark.parametrize("policy", POLICIES)
def test_nan_never_reaches_a_plan(policy):
    """The step that motivated the finite check: a NaN a1 used to plan, with NaN times everywhere."""
    with pytest.raises(ValueError, match="a1 must be a finite number, got nan"):
        CostModel.from_dict({**CM.to_dict(), "a1": float("nan")})
    with pytest.raises(ValueError, match=r"lengths must be integers, got \[2.5\]"):
        make_plan([2.5, 7], num_ranks=2, config=HDPConfig(hdp_capacity=8), cost_model=CM, policy=policy)
    with pytest.raises(ValueError, match="num_ranks must be an integer, got 2.5"):
        make_plan([3, 7], num_ranks=2.5, config=HDPConfig(hdp_capacity=8), cost_model=CM, policy=policy)


@FUZZ
@given(drop=st.sets(st.sampled_from(sorted(CM.to_dict())), max_size=3),
       extra=st.dictionaries(st.text(min_size=1, max_size=8), st.floats(allow_nan=True), max_size=2))
def test_cost_model_json_with_missing_or_extra_fields(tmp_path_factory, drop, extra):
    data = {k: v for k, v in CM.to_dict().items() if k not in drop}
    extra = {k: v for k, v in extra.items() if k not in CM.to_dict()}
    data.update(extra)
    path = tmp_path_factory.mktemp("cm") / "cost_model.json"
    path.write_text(json.dumps(data))
    required = {"a1", "b1", "g", "a2", "b2", "kv_bytes_per_token", "num_layers", "ring_bandwidth"}
    if extra:
        with pytest.raises(ValueError, match="unknown cost model keys") as error:
            CostModel.from_json(path)
        assert all(repr(k) in str(error.value) for k in extra)
    elif drop & required:
        with pytest.raises(ValueError, match="missing") as error:
            CostModel.from_json(path)
        assert all(k in str(error.value) for k in drop & required)
    else:  # only optional fields dropped: their documented defaults
        assert CostModel.from_json(path) == CostModel(**data)


def test_cost_model_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "cm.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object of coefficients, got list"):
        CostModel.from_json(path)


@pytest.mark.parametrize("capacity", [0, -3, 2.5, float("nan"), True])
def test_capacity_refused_by_name(capacity):
    with pytest.raises(ValueError, match="hdp_capacity"):
        HDPConfig(hdp_capacity=capacity)
