"""HDP inside Megatron-Core is exact: loss and every gradient equal ordinary training of the same batch.

One reference launch (one process, Megatron's stock attention and RoPE, each document its own batch)
trains a tiny dense and a tiny MoE Llama-style GPT for two steps; each HDP launch loads the same initial
weights, trains the same two global batches under random plans (whole documents, rings of 2..D ranks
that overlap, uneven micro-batch counts) and must match loss and gradients after each step — the second
step after the optimizer update. Layouts: HDP=4; TP=2 x HDP=2 (no sequence parallelism: Megatron's
torch norms reject it without TE/Apex); PP=2 x HDP=2 (1F1B); EP=2 across HDP=4 with MoE layers.
"""

import pytest
import torch

from megatron_hdp.comm.launch import run_gloo

BATCHES = [(11, [37, 5, 64, 12, 23, 50, 9, 3, 1]), (12, [70, 2, 31, 17, 44, 8, 26])]
NUM_EXPERTS = 4


def _init(tp=1, pp=1, ep=1):
    from megatron_hdp.megatron.initialize import initialize_hdp

    return initialize_hdp(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, seed=7
    )


def _reference(rank, world_size):
    from megatron_hdp.megatron.exactness import VOCAB_SIZE, full_weights, reference_steps
    from megatron_hdp.megatron.initialize import destroy_hdp
    from megatron_hdp.megatron.model import build_gpt, tiny_llama_config, wrap_for_training

    out = {}
    for kind, experts in (("dense", None), ("moe", NUM_EXPERTS)):
        _init()
        model = build_gpt(tiny_llama_config(num_moe_experts=experts), vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False)
        init = full_weights(model)
        ddp, opt = wrap_for_training(model)
        out[kind] = {"init": init, "steps": reference_steps(ddp, opt, BATCHES)}
        destroy_hdp()
    return out


def _hdp(rank, world_size, tp, pp, ep, init, plan_seed):
    from megatron_hdp.megatron.exactness import VOCAB_SIZE, load_full_weights, local_grads, token_reader
    from megatron_hdp.megatron.hand_plan import random_plan
    from megatron_hdp.megatron.model import build_gpt, tiny_llama_config, wrap_for_training
    from megatron_hdp.megatron.step import HDPTrainer

    state = _init(tp, pp, ep)
    config = tiny_llama_config(num_moe_experts=NUM_EXPERTS if ep > 1 else None)
    model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128)
    load_full_weights(model, init)
    ddp, opt = wrap_for_training(model)
    trainer = HDPTrainer(model=ddp, optimizer=opt, state=state)
    steps = []
    for step, (seed, lengths) in enumerate(BATCHES):
        plan = random_plan(lengths, num_ranks=state.hdp_size, seed=plan_seed + step, pp_size=pp)
        stats = trainer.step(plan, token_reader(seed, lengths))
        steps.append({"loss": stats.loss, "grads": local_grads(ddp), "rings": stats.num_rings})
    return steps


@pytest.fixture(scope="module")
def reference():
    return run_gloo(_reference, 1, timeout_s=240)[0]


def _check(reference, results):
    for rank_steps in results:
        for step, (got, want) in enumerate(zip(rank_steps, reference["steps"])):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), f"step {step} loss"
            for name, (info, grad) in got["grads"].items():
                from megatron_hdp.megatron.exactness import expected_shard

                torch.testing.assert_close(
                    torch.as_tensor(grad), expected_shard(torch.as_tensor(want["grads"][name]), info), rtol=1e-4, atol=1e-6,
                    msg=lambda m: f"step {step} grad of {name} (TP rank {info.tp_rank}): {m}",
                )
            assert got["rings"] > 0  # the plans really split documents


@pytest.mark.parametrize(
    "tp,pp,ep,kind",
    [(1, 1, 1, "dense"), (2, 1, 1, "dense"), (1, 2, 1, "dense"), (1, 1, 2, "moe")],
    ids=["hdp4", "tp2xhdp2", "pp2xhdp2", "ep2-moe-hdp4"],
)
def test_hdp_step_matches_single_process_reference(reference, tp, pp, ep, kind):
    ref = reference[kind]
    results = run_gloo(_hdp, 4, tp, pp, ep, ref["init"], 100 * tp + 10 * pp + ep, timeout_s=240)
    _check(ref, results)
