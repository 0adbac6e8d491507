"""Misuse fails with a clear ValueError on every rank — never a hang — and the ranks can go on training.

One 4-rank launch: plans that differ across ranks (the data layer's digest check, which the trainer
shares), a plan for another domain size (on every rank, then on one rank only: its peers name it), a
sequence beyond what the pool can hold, and settings that cannot work together; then a valid step runs.
Then Megatron is initialized again with expert TP other than TP: the HDP ranks an expert-parallel group
couples are read off Megatron's own groups, and the planner gets them from the trainer.
"""

import pytest

from megatron_hdp.comm.launch import run_gloo


def _errors(rank, world_size):
    import dataclasses

    from megatron_hdp.config import HDPConfig
    from megatron_hdp.harness.exactness import VOCAB_SIZE, token_reader
    from megatron_hdp.plan.hand_plan import random_plan
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.megatron.layers.spec import prepare_model_for_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.cost.presets import analytic_cost_model, model_shape

    from megatron_hdp.comm.plan_agreement import PlanMismatchError

    def message(fn):
        try:
            fn()
        except ValueError as err:
            return f"{type(err).__name__}: {err}"
        return None

    out = {"bad_sizes": message(lambda: initialize_hdp(tensor_model_parallel_size=3)),
           "bad_ep": message(lambda: initialize_hdp(expert_model_parallel_size=3))}
    state = initialize_hdp(seed=3)
    model = build_gpt(tiny_llama_config(), vocab_size=VOCAB_SIZE, max_sequence_length=64)
    ddp, opt = wrap_for_training(model)
    trainer = HDPTrainer(model=ddp, optimizer=opt, state=state)
    lengths = [20, 9, 33, 4]
    reader = token_reader(0, lengths)
    mine = random_plan(lengths, num_ranks=4, seed=1 if rank == 0 else 2)
    out["mismatch"] = message(lambda: trainer.step(mine, reader))
    out["wrong_domain"] = message(lambda: trainer.step(random_plan(lengths, num_ranks=2, seed=0), reader))
    # only rank 1 holds a plan for another domain size: it says why, its peers name it as the rejecting rank
    odd = random_plan(lengths, num_ranks=2 if rank == 1 else 4, seed=0)
    out["one_rejects"] = message(lambda: trainer.step(odd, reader))
    config = HDPConfig(hdp=True, hdp_capacity=8, hdp_offload=False)
    cost = analytic_cost_model(model_shape("llama-7b"))
    out["too_long"] = message(lambda: make_plan([8 * 4 + 1], num_ranks=4, config=config, cost_model=cost))
    no_token_loss = dataclasses.replace(ddp.config, calculate_per_token_loss=False)
    out["no_token_loss"] = message(lambda: HDPTrainer(model=_Proxy(ddp, no_token_loss), optimizer=opt, state=state))
    plain = build_gpt(tiny_llama_config(), vocab_size=VOCAB_SIZE, max_sequence_length=64, hdp=False)
    out["no_hdp_spec"] = message(lambda: prepare_model_for_hdp(plain))
    stats = trainer.step(random_plan(lengths, num_ranks=4, seed=5), reader)  # still healthy afterwards
    out["loss_after"] = stats.loss
    out["ep_cost_model"] = trainer.planning_cost_model(cost).expert_parallel_size
    # TP 2, expert TP 1, EP 4: an expert group is global ranks 0-3, i.e. TP ranks 0-1 of HDP ranks 0 and 1
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp

    destroy_hdp()
    mixed = initialize_hdp(tensor_model_parallel_size=2, expert_tensor_parallel_size=1, expert_model_parallel_size=4)
    out["mixed"] = (mixed.hdp_size, mixed.ep_size, mixed.ep_hdp_ranks)
    return out


class _Proxy:
    """A DDP stand-in exposing another TransformerConfig (the trainer reads `.config` first)."""

    def __init__(self, ddp, config):
        self.config, self.no_sync = config, ddp.no_sync


def test_misuse_raises_value_error_on_every_rank_without_hanging():
    results = run_gloo(_errors, 4, timeout_s=240)
    for rank, out in enumerate(results):
        assert "not divisible by TP x PP" in out["bad_sizes"]
        assert "not divisible by the 3 HDP ranks an expert-parallel group spans (EP=3" in out["bad_ep"]
        assert out["ep_cost_model"] == 1
        assert out["mixed"] == (2, 2, (0, 1))
        # the trainer's check is comm's check_plan_agreement: same error type, message naming the ranks
        assert out["mismatch"].startswith("PlanMismatchError: step plans differ across ranks")
        assert "ranks planned different global batches" in out["mismatch"] and "[0]" in out["mismatch"]
        assert "plan is for 2 HDP ranks" in out["wrong_domain"]
        if rank == 1:
            assert out["one_rejects"].startswith("ValueError: the plan is for 2 HDP ranks")
        else:
            assert out["one_rejects"].startswith("PlanMismatchError") and "'rejected': [1]" in out["one_rejects"]
        assert out["too_long"] is not None and "33" in out["too_long"]
        assert "calculate_per_token_loss" in out["no_token_loss"]
        assert "get_gpt_layer_with_hdp_spec" in out["no_hdp_spec"]
        assert out["loss_after"] == pytest.approx(results[0]["loss_after"]) and out["loss_after"] > 0
