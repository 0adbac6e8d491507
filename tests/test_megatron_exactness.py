"""HDP inside Megatron-Core is exact: loss and every gradient equal ordinary training of the same batch.

One reference launch (one process, Megatron's stock attention and RoPE, each document its own batch)
trains a tiny dense and a tiny MoE Llama-style GPT for two steps; each HDP launch loads the same initial
weights, trains the same two global batches under random plans (whole documents, rings of 2..D ranks
that overlap, uneven micro-batch counts) and must match loss and gradients after each step — the second
step after the optimizer update. Layouts: HDP=4; TP=2 x HDP=2 (no sequence parallelism: Megatron's
torch norms reject it without TE/Apex); PP=2 x HDP=2 (1F1B); EP=2 across HDP=4 with MoE layers, their
load-balancing loss and z-loss on (per document under HDP, as the reference's one-document micro-batches
compute them; the idle rank's padding micro-batches must add nothing to them). All but
TP=2 run Megatron DDP with overlap_grad_reduce (several buckets) and a second plan that leaves one HDP rank
(with PP: a whole pipeline) idle: it runs padding micro-batches only, whose zero loss must still fire
every parameter's gradient hook, or DDP never issues that bucket's reduction.

Further layouts of the same comparison (`CASES`): Megatron's distributed optimizer with overlapped
gradient reduce-scatter and overlapped parameter all-gather (the all-gather of step 1's update runs in
step 2's forward pre-hooks; each rank checks the gradient slice it owns, and the slices must cover every
element); full and selective activation recomputation, each with and without activation offload of a
planned ratio; sequence parallelism with TP = 2 (a test-only SP-capable RMSNorm, tests/exactness_cases.py),
dense and MoE with the load-balancing loss and z-loss (each TP rank routes its slice of the rows); MoE
with those losses under PP = 2 (1F1B: each stage's routers see the documents of the micro-batch it runs).
"""

import pytest
import torch

from megatron_hdp.comm.launch import run_gloo

BATCHES = [(11, [37, 5, 64, 12, 23, 50, 9, 3, 1]), (12, [70, 2, 31, 17, 44, 8, 26])]
NUM_EXPERTS = 4
MOE_LOSSES = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
"""The MoE router's load-balancing loss and z-loss, large enough that a packing-dependent aux loss would
move the router gradients far beyond the tolerance. The reference (one document per micro-batch) is
Megatron's own per-micro-batch loss; HDP computes it per document (megatron_hdp/megatron/moe_aux_loss.py).
They lift the gradient norm above 1, so the MoE runs do not clip (`MOE_CLIP_GRAD`): clipping scales the
main_grad the check reads after the step, which the reference reads before its step."""
MOE_CLIP_GRAD = 0.0


def _init(tp=1, pp=1, ep=1):
    from megatron_hdp.megatron.initialize import initialize_hdp

    return initialize_hdp(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, seed=7
    )


def _reference(rank, world_size):
    from megatron_hdp.harness.exactness import VOCAB_SIZE, full_weights, reference_steps
    from megatron_hdp.megatron.initialize import destroy_hdp
    from megatron_hdp.harness.model import build_gpt, tiny_llama_config, wrap_for_training

    out = {}
    for kind, experts in (("dense", None), ("moe", NUM_EXPERTS)):
        _init()
        config = tiny_llama_config(num_moe_experts=experts, **(MOE_LOSSES if experts else {}))
        model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False)
        init = full_weights(model)
        ddp, opt = wrap_for_training(model, **(dict(clip_grad=MOE_CLIP_GRAD) if experts else {}))
        out[kind] = {"init": init, "steps": reference_steps(ddp, opt, BATCHES)}
        destroy_hdp()
    return out


def _plan(lengths, *, num_ranks, seed, pp_size, idle, offload=0.0):
    """A random plan (`random_plan`), or with `idle` one whose random rings avoid HDP rank seed % num_ranks;
    with `offload`, every sequence's planned offload ratio is that."""
    import dataclasses
    import random

    from megatron_hdp.plan.hand_plan import plan_from_rings, random_plan

    if not idle:
        plan = random_plan(lengths, num_ranks=num_ranks, seed=seed, pp_size=pp_size)
        if offload:
            sequences = tuple(dataclasses.replace(s, offload_ratio=offload) for s in plan.sequences)
            plan = dataclasses.replace(plan, sequences=sequences).validate()
        return plan
    rng = random.Random(seed)
    busy = [r for r in range(num_ranks) if r != seed % num_ranks]
    rings = [tuple(rng.sample(busy, rng.randint(1, len(busy)))) for _ in lengths]
    slots = [rng.randrange(3) for _ in lengths]
    return plan_from_rings(lengths, rings, slots, num_ranks=num_ranks, capacity=sum(lengths), pp_size=pp_size,
                           offload_ratios=[offload] * len(lengths))


def _case_config(config, case):
    """`config` with the case's recompute setting."""
    import dataclasses

    recompute = case.get("recompute")
    if recompute == "full":
        return dataclasses.replace(config, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dataclasses.replace(config, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    return config


def _hdp(rank, world_size, tp, pp, ep, init, plan_seed, overlap, case=None):
    from megatron_hdp.harness.exactness import VOCAB_SIZE, load_full_weights, local_grads, token_reader
    from megatron_hdp.harness.model import build_gpt, tiny_llama_config, wrap_for_training
    from megatron_hdp.megatron.step import HDPTrainer

    case = case or {}
    state = _init(tp, pp, ep)
    is_moe = ep > 1 or case.get("moe", False)
    moe = dict(num_moe_experts=NUM_EXPERTS, **MOE_LOSSES) if is_moe else {}
    config = tiny_llama_config(sequence_parallel=case.get("sp", False), **moe)
    config = _case_config(config, case)
    if case.get("sp"):
        from exactness_cases import build_sp_gpt

        model = build_sp_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128)
    else:
        model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128)
    load_full_weights(model, init)
    dist_opt = case.get("distributed_optimizer", False)
    ddp, opt = wrap_for_training(
        model, overlap_grad_reduce=overlap, bucket_size=4000 if overlap else None,
        distributed_optimizer=dist_opt, overlap_param_gather=dist_opt and overlap,
        **(dict(clip_grad=MOE_CLIP_GRAD) if is_moe else {}),
    )
    assert not overlap or pp > 1 or len(ddp.bucket_groups) > 1  # Megatron gives later PP stages one bucket
    offloader = None
    if case.get("offload"):
        from megatron_hdp.offload import ActivationOffloader, OffloadConfig

        offloader = ActivationOffloader(layers=model.decoder.layers, config=OffloadConfig(min_tensor_bytes=0))
    trainer = HDPTrainer(model=ddp, optimizer=opt, state=state, offloader=offloader)
    steps = []
    for step, (seed, lengths) in enumerate(BATCHES):
        plan = _plan(lengths, num_ranks=state.hdp_size, seed=plan_seed + step, pp_size=pp, idle=overlap and step == 1,
                     offload=case.get("offload", 0.0))
        stats = trainer.step(plan, token_reader(seed, lengths))
        idle = [len(r.microbatches) == 0 for r in plan.ranks]
        offloaded = stats.offload.bytes_offloaded if stats.offload is not None else 0
        steps.append({"loss": stats.loss, "grads": local_grads(ddp, opt if dist_opt else None), "rings": stats.num_rings,
                      "idle": idle, "offloaded": offloaded})
    return steps


@pytest.fixture(scope="module")
def reference():
    return run_gloo(_reference, 1, timeout_s=240)[0]


def _check(reference, results):
    from megatron_hdp.harness.exactness import expected_shard

    for rank_steps in results:
        for step, (got, want) in enumerate(zip(rank_steps, reference["steps"])):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), f"step {step} loss"
            for name, (info, grad) in got["grads"].items():
                grad, expected = torch.as_tensor(grad), expected_shard(torch.as_tensor(want["grads"][name]), info)
                held = ~torch.isnan(grad)  # all of it, except the slices a distributed optimizer never reduced here
                torch.testing.assert_close(
                    grad[held], expected[held], rtol=1e-4, atol=1e-6,
                    msg=lambda m: f"step {step} grad of {name} (TP rank {info.tp_rank}): {m}",
                )
        assert rank_steps[0]["rings"] > 0  # the plans really split documents


def _check_covered(reference, results):
    """Distributed optimizer: the ranks' owned gradient slices cover every element of every parameter."""
    import numpy as np

    for step, want in enumerate(reference["steps"]):
        for name, full in want["grads"].items():
            held = np.zeros(full.shape, dtype=int)
            for rank_steps in results:
                if name in rank_steps[step]["grads"]:
                    held += ~np.isnan(rank_steps[step]["grads"][name][1])
            assert (held == 1).all(), f"step {step}: {name} elements held by {sorted(set(held.ravel()))} ranks"


def _check_idle(results):
    """The second plan of an overlap case really left one HDP rank without a micro-batch."""
    for rank_steps in results:
        assert sum(rank_steps[1]["idle"]) == 1


@pytest.mark.parametrize(
    "tp,pp,ep,kind,overlap",
    [(1, 1, 1, "dense", True), (2, 1, 1, "dense", False), (1, 2, 1, "dense", True), (1, 1, 2, "moe", True)],
    ids=["hdp4-overlap-idle", "tp2xhdp2", "pp2xhdp2-overlap-idle", "ep2-moe-aux-loss-hdp4-overlap-idle"],
)
def test_hdp_step_matches_single_process_reference(reference, tp, pp, ep, kind, overlap):
    ref = reference[kind]
    results = run_gloo(_hdp, 4, tp, pp, ep, ref["init"], 100 * tp + 10 * pp + ep, overlap, timeout_s=240)
    _check(ref, results)
    if overlap:
        _check_idle(results)


CASES = {
    "hdp4-distopt-overlap-grad-and-param-gather-idle": dict(distributed_optimizer=True),
    "hdp4-recompute-full": dict(recompute="full"),
    "hdp4-recompute-full-offload": dict(recompute="full", offload=0.5),
    "hdp4-recompute-selective": dict(recompute="selective"),
    "hdp4-recompute-selective-offload": dict(recompute="selective", offload=0.5),
    "tp2xhdp2-sequence-parallel": dict(sp=True),
    "tp2xhdp2-sequence-parallel-moe-aux-loss": dict(sp=True, moe=True),
    "pp2xhdp2-moe-aux-loss": dict(pp=2, moe=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_more_layouts_match_single_process_reference(reference, name):
    case = CASES[name]
    tp = 2 if case.get("sp") else 1
    overlap = case.get("distributed_optimizer", False)
    ref = reference["moe" if case.get("moe") else "dense"]
    results = run_gloo(_hdp, 4, tp, case.get("pp", 1), 1, ref["init"], 500 + len(name), overlap, case, timeout_s=240)
    _check(ref, results)
    if case.get("distributed_optimizer"):
        _check_covered(reference["dense"], results)
        _check_idle(results)
    if case.get("offload"):
        offloaded = [sum(rank_steps[step]["offloaded"] for rank_steps in results) for step in range(len(BATCHES))]
        if case.get("recompute") == "full":
            # full recomputation keeps only each layer's input, saved by the checkpoint outside the layer:
            # there is nothing for the offloader to move (and the recompute in the backward runs outside
            # any micro-batch context, so the offloader leaves it alone)
            assert offloaded == [0] * len(BATCHES)
        else:
            assert all(b > 0 for b in offloaded), offloaded
