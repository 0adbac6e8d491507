"""The response mask a plan's prompt lengths make reaches every packed token of every rank (single process):
1 exactly on the prediction of each response token, each counted once over the ranks of its ring."""

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.posttrain.batch import RESPONSE_MASK, Rollouts, collate_rollouts
from megatron_hdp.posttrain.planning import plan_rollouts, samples_of_rank

COUNTS = [200, 12, 40, 9, 2, 150, 33, 70]
PROMPTS = [150, 0, 39, 3, 1, 20, 32, 69]
RANKS = 4


def _setup():
    plan = plan_rollouts(COUNTS, prompt_lengths=PROMPTS, num_ranks=RANKS, config=HDPConfig(hdp_capacity=64),
                         cost_model=analytic_cost_model("llama-7b"))
    ids = tuple(f"s{i}" for i in range(len(COUNTS)))
    tokens = {sid: np.arange(n) for sid, n in zip(ids, COUNTS)}
    return plan, Rollouts(sample_ids=ids, tokens=tokens)


def test_every_response_prediction_is_masked_in_once_and_nothing_else():
    plan, rollouts = _setup()
    assert any(len(seq.ring) > 1 for seq in plan.sequences)
    seen = {i: [] for i in range(len(COUNTS))}
    for rank in range(RANKS):
        samples = samples_of_rank(plan, rank)
        own = Rollouts(sample_ids=rollouts.sample_ids, tokens={rollouts.sample_ids[i]: rollouts.tokens[
            rollouts.sample_ids[i]] for i in samples})  # a rank holds only its own samples
        for batch in collate_rollouts(plan, own.with_response_mask(plan, samples), rank=rank, pad_to_multiple=8):
            mask = batch.fields[RESPONSE_MASK].numpy()
            assert not mask[~batch.is_real.numpy()].any()  # padding carries no loss
            for sample, target, value in zip(batch.sample.tolist(), batch.target.tolist(), mask.tolist()):
                if sample >= 0:
                    seen[sample].append((target, value))
    for i, (count, prompt) in enumerate(zip(COUNTS, PROMPTS)):
        # reference: token t (1 <= t < N) is predicted once over the ring, and is a response token iff t >= P
        assert sorted(seen[i]) == [(t, float(t >= prompt)) for t in range(1, count)], f"sample {i}"


def test_a_field_named_like_the_response_mask_is_refused():
    plan, rollouts = _setup()
    clash = Rollouts(sample_ids=rollouts.sample_ids, tokens=rollouts.tokens,
                     fields={RESPONSE_MASK: {sid: np.ones(len(t)) for sid, t in rollouts.tokens.items()}})
    with pytest.raises(ValueError, match="the plan's prompt lengths make it"):
        clash.check(plan, range(len(COUNTS)))
