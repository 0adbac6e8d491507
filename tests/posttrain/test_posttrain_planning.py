"""The planning half of `megatron_hdp.posttrain`: token counts in, a valid deterministic JSON plan out; loss
weights of each aggregation mode against a brute-force reading of its definition; the refused modes."""

import json

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.posttrain.planning import plan_rollouts, response_masks, sample_owner, samples_of_rank
from megatron_hdp.posttrain.weights import MODES, REFUSED, loss_weights

COUNTS = [200, 12, 40, 9, 2, 150, 33, 70]
CONFIG = HDPConfig(hdp_capacity=64, hdp_offload=False)


def _plan(**kwargs):
    return plan_rollouts(COUNTS, num_ranks=4, config=CONFIG, cost_model=analytic_cost_model("llama-7b"), **kwargs)


def test_every_sample_is_placed_once_with_its_prediction_count():
    plan = _plan()
    assert plan.lengths == [n - 1 for n in COUNTS]  # N tokens: N - 1 next-token predictions
    assert any(len(seq.ring) > 1 for seq in plan.sequences)
    held = {}
    for rank in range(4):
        for mb in plan.microbatches(rank):
            for shard in mb.shards:
                held[shard.seq] = held.get(shard.seq, 0) + shard.num_tokens
    assert held == {i: n - 1 for i, n in enumerate(COUNTS)}
    assert sorted(s for r in range(4) for s in samples_of_rank(plan, r) if sample_owner(plan)[s] == r) == \
        list(range(len(COUNTS)))


def test_the_plan_is_deterministic_and_survives_json():
    first, second = _plan(), _plan()
    assert first.to_json() == second.to_json()
    assert StepPlan.from_dict(json.loads(first.to_json())).digest() == first.digest()


def test_pipelines_and_virtual_stages_plan_as_in_training():
    plan = plan_rollouts(COUNTS, num_ranks=4, config=CONFIG, cost_model=analytic_cost_model("llama-7b"),
                         pp_size=2, vpp_size=2)
    assert (plan.pp_size, plan.vpp_size) == (2, 2)


@pytest.mark.parametrize("counts, message", [([5, 1], "sample 1 has 1 tokens"), ([], "empty batch"),
                                            ([4, 2.5], "sample 1 has 2.5 tokens")])
def test_bad_counts_are_refused_in_one_line(counts, message):
    with pytest.raises(ValueError, match=message):
        plan_rollouts(counts, num_ranks=2, config=CONFIG, cost_model=analytic_cost_model("llama-7b"))


MASKS = [np.array([1, 0, 0, 1, 1, 1]), np.array([0, 0, 1]), np.array([0, 0, 0, 0]), np.array([1, 1, 1, 1, 1])]
GROUPS = ["a", "a", "b", "c"]


def _brute(mode, horizon=None):
    """Each mode's loss sum(w * l) for per-token losses l written from its definition, loop by loop."""
    rng = np.random.default_rng(0)
    losses = [rng.normal(size=len(m)) for m in MASKS]
    seqs = []
    for m, l in zip(MASKS, losses):
        tokens = [l[t] for t in range(1, len(m)) if m[t]]
        seqs.append(tokens)
    live = [s for s in seqs if s]
    if mode == "token-mean":
        value = sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    elif mode == "seq-mean-token-mean":
        value = sum(sum(s) / len(s) for s in live) / len(live)
    elif mode == "seq-mean-token-sum":
        value = sum(sum(s) for s in live) / len(live)
    elif mode == "seq-mean-token-sum-norm":
        value = sum(sum(s) for s in seqs) / horizon
    else:
        prompts = {}
        for g, s in zip(GROUPS, seqs):
            prompts.setdefault(g, []).extend(s)
        value = np.mean([np.mean(t) for t in prompts.values() if t])
    return value, losses


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_weights_give_its_definition(mode):
    want, losses = _brute(mode, horizon=7)
    weights = loss_weights(MASKS, mode=mode, horizon=7, groups=GROUPS)
    assert all(w[0] == 0 for w in weights)  # entry 0 predicts nothing
    assert sum(float((w * l).sum()) for w, l in zip(weights, losses)) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", sorted(REFUSED))
def test_modes_that_depend_on_microbatches_are_refused_naming_the_replacement(mode):
    with pytest.raises(ValueError, match=f"use {REFUSED[mode].split()[0]}"):
        loss_weights(MASKS, mode=mode)


def test_a_horizon_tied_to_padding_is_refused():
    with pytest.raises(ValueError, match="needs a fixed horizon"):
        loss_weights(MASKS, mode="seq-mean-token-sum-norm")


PROMPTS = [150, 0, 39, 3, 1, 20, 32, 69]
"""Prompt tokens of each sample of COUNTS: long, none, all but the last token, ..."""


def test_prompt_lengths_travel_with_the_plan_and_its_json():
    plan = _plan(prompt_lengths=PROMPTS)
    assert plan.prompt_lengths == tuple(PROMPTS)
    again = StepPlan.from_json(plan.to_json())
    assert again.prompt_lengths == tuple(PROMPTS) and again.digest() == plan.digest()
    assert plan.digest() != _plan().digest()  # the plan-agreement check covers the prompts
    assert "prompt_lengths" not in json.loads(_plan().to_json())  # plans without prompts read as before
    assert [(s.ring, s.length) for s in plan.sequences] == [(s.ring, s.length) for s in _plan().sequences]


def test_the_response_mask_marks_the_prediction_of_each_response_token():
    """Reference: token t of sample i (t_0..t_{N-1}) is a response token iff t >= P_i, and entry t is the
    prediction of token t, which exists only for t >= 1."""
    plan = _plan(prompt_lengths=PROMPTS)
    masks = response_masks(plan)
    for count, prompt, mask in zip(COUNTS, PROMPTS, masks):
        want = [1.0 if t >= prompt and t >= 1 else 0.0 for t in range(count)]
        assert mask.tolist() == want
    assert [m.tolist() for m in response_masks(plan, [6, 1])] == [masks[6].tolist(), masks[1].tolist()]
    with pytest.raises(ValueError, match="carries no prompt lengths"):
        response_masks(_plan())


@pytest.mark.parametrize("prompts, message", [
    ([200] + PROMPTS[1:], "sequence 0 has a prompt of 200 tokens but 200 tokens in all"),
    (PROMPTS[:3] + [-1] + PROMPTS[4:], "sequence 3 has a prompt of -1 tokens"),
    (PROMPTS[:2] + [2.5] + PROMPTS[3:], "sequence 2 has a prompt of 2.5 tokens"),
    (PROMPTS[:-1], "7 prompt lengths for 8 sequences"),
])
def test_bad_prompt_lengths_are_refused_in_one_line(prompts, message):
    with pytest.raises(ValueError, match=message):
        _plan(prompt_lengths=prompts)
    broken = json.loads(_plan().to_json()) | {"prompt_lengths": prompts}
    with pytest.raises(ValueError, match=message):
        StepPlan.from_dict(broken).validate()  # a shipped plan is checked the same way
