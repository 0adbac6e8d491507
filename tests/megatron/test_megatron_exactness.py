"""HDP inside Megatron-Core is exact: loss and every gradient equal ordinary training of the same batch.

One reference launch (one process, Megatron's stock attention and RoPE, each document its own batch)
trains a tiny dense and a tiny MoE Llama-style GPT for two steps; each HDP launch loads the same initial
weights, trains the same two global batches under random plans (whole documents, rings of 2..D ranks
that overlap, uneven micro-batch counts) and must match loss and gradients after each step — the second
step after the optimizer update. Layouts: HDP=4; TP=2 x HDP=2 (no sequence parallelism: Megatron's
torch norms reject it without TE/Apex); PP=2 x HDP=2 (1F1B); EP=2 across HDP=4 with MoE layers, their
load-balancing loss and z-loss on (per document under HDP, as the reference's one-document micro-batches
compute them; the idle rank's padding micro-batches must add nothing to them). With EP the first step
runs `balance`'s EP-aware plan (the trainer's `planning_cost_model`: every member of an EP group the
same count, an empty micro-batch where a lane has nothing at an index) and must run unpadded; the second
leaves one rank of an EP group with padding micro-batches only. All but
TP=2 run Megatron DDP with overlap_grad_reduce (several buckets) and a second plan that leaves one HDP rank
(with PP: a whole pipeline) idle: it runs padding micro-batches only, whose zero loss must still fire
every parameter's gradient hook, or DDP never issues that bucket's reduction.

Further layouts of the same comparison (`CASES`): Megatron's distributed optimizer with overlapped
gradient reduce-scatter and overlapped parameter all-gather (the all-gather of step 1's update runs in
step 2's forward pre-hooks; each rank checks the gradient slice it owns, and the slices must cover every
element); full and selective activation recomputation, each with and without activation offload of a
planned ratio; sequence parallelism with TP = 2 (a test-only SP-capable RMSNorm, tests/exactness_cases.py),
dense and MoE with the load-balancing loss and z-loss (each TP rank routes its slice of the rows); MoE
with those losses under PP = 2 (1F1B: each stage's routers see the documents of the micro-batch it runs);
EP = 4 over all four HDP ranks (one expert-parallel group), balance's plan then a padding-only rank.
"""

import pytest
import torch

from megatron_hdp.comm.launch import run_gloo

BATCHES = [(11, [37, 5, 64, 12, 23, 50, 9, 3, 1]), (12, [70, 2, 31, 17, 44, 8, 26])]
NUM_EXPERTS = 4
ADAM_EPS = 1e-4
"""Adam's epsilon of every run here (reference and HDP). Step 2's gradients are taken after one Adam step,
whose update is lr * g / (|g| + eps) elementwise: with Megatron's default eps of 1e-8 an element whose
step-1 gradient is ~1e-8 moves by a fraction of lr set by its round-off (float32 sums in another order
differ by ~1e-9), which step 2's gradients then carry at ~1e-4 of their scale: the VPP case failed its
1e-6 tolerance on an AVX2 host where the sums of an AVX-512 host had passed. eps = 1e-4 bounds that gain
at lr / eps = 10, and leaves the check itself (every gradient, rtol 1e-4, atol 1e-6) as it is."""
MOE_LOSSES = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
"""The MoE router's load-balancing loss and z-loss, large enough that a packing-dependent aux loss would
move the router gradients far beyond the tolerance. The reference (one document per micro-batch) is
Megatron's own per-micro-batch loss; HDP computes it per document (megatron_hdp/megatron/layers/moe_aux_loss.py).
They lift the gradient norm above 1, so the MoE runs do not clip (`MOE_CLIP_GRAD`): clipping scales the
main_grad the check reads after the step, which the reference reads before its step. The 4-layer model of
the virtual-pipeline case has a gradient norm above 1 too, and does not clip either."""
MOE_CLIP_GRAD = 0.0
VPP_LAYERS = 4
"""Layers of the dense model the virtual-pipeline case trains: PP 2 x 2 virtual stages of one layer each."""
VPP_KIND = "dense-4-layers"


def _init(tp=1, pp=1, ep=1, vpp=None):
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp

    return initialize_hdp(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp, seed=7,
    )


def _reference(rank, world_size):
    from megatron_hdp.harness.exactness import VOCAB_SIZE, full_weights, reference_steps
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training

    out = {}
    for kind, experts, num_layers in (("dense", None, 2), ("moe", NUM_EXPERTS, 2), (VPP_KIND, None, VPP_LAYERS)):
        _init()
        config = tiny_llama_config(num_layers=num_layers, num_moe_experts=experts, **(MOE_LOSSES if experts else {}))
        model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False)
        init = full_weights(model)
        unclipped = experts or kind == VPP_KIND
        ddp, opt = wrap_for_training(model, adam_eps=ADAM_EPS, **(dict(clip_grad=MOE_CLIP_GRAD) if unclipped else {}))
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


def _with_latent_rings(plan, sizes):
    """`plan` with its rings of `sizes` ranks on the latent ring (the others keep the K/V ring; none: as is)."""
    import dataclasses

    if not sizes:
        return plan
    sequences = tuple(dataclasses.replace(s, ring_kind="latent") if len(s.ring) in sizes else s
                      for s in plan.sequences)
    assert any(s.ring_kind == "latent" for s in sequences)
    return dataclasses.replace(plan, sequences=sequences).validate()


def _case_config(config, case):
    """`config` with the case's recompute setting and micro-batch group size of virtual pipeline stages."""
    import dataclasses

    if case.get("group_size"):
        config = dataclasses.replace(config, microbatch_group_size_per_vp_stage=case["group_size"])
    recompute = case.get("recompute")
    if recompute == "full":
        return dataclasses.replace(config, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dataclasses.replace(config, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    if recompute == "mla_up_proj":
        return dataclasses.replace(config, recompute_granularity="selective",
                                   recompute_modules=["mla_up_proj", "core_attn"])
    if case.get("window"):
        config = dataclasses.replace(config, window_size=case["window"], window_attn_skip_freq=case.get("skip"))
    if case.get("sink"):
        config = dataclasses.replace(config, softmax_type=case["sink"])
    return config


class _WithoutAllReduce:
    """torch.distributed for `moe_aux_loss` with its one all-reduce (the TP sum of the document counts)
    left out: the negative control of that sum."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_reduce(*args, **kwargs):
        return None


def _plant(case):
    """Negative controls (`NEGATIVE`): Megatron's stock router instead of the per-document one, or the
    per-document router without the TP sum of its counts."""
    if case.get("stock_router"):
        from megatron_hdp.megatron.layers import spec as layer_spec

        layer_spec.with_document_aux_loss_router = lambda spec: spec
    if case.get("no_tp_sum"):
        from megatron_hdp.megatron.layers import moe_aux_loss

        moe_aux_loss.dist = _WithoutAllReduce()


def _hdp(rank, world_size, tp, pp, ep, init, plan_seed, overlap, case=None):
    from megatron_hdp.harness.exactness import VOCAB_SIZE, load_full_weights, local_grads, token_reader
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt_chunks, wrap_chunks_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer

    case = case or {}
    _plant(case)
    state = _init(tp, pp, ep, case.get("vpp"))
    is_moe = ep > 1 or case.get("moe", False)
    moe = dict(num_moe_experts=NUM_EXPERTS, **MOE_LOSSES) if is_moe else {}
    config = tiny_llama_config(num_layers=VPP_LAYERS if case.get("vpp") else 2, sequence_parallel=case.get("sp", False),
                               **moe, **case.get("fields", {}))
    config = _case_config(config, case)
    if case.get("sp"):
        from exactness_cases import build_sp_gpt

        chunks = [build_sp_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128)]
    elif case.get("block"):  # Megatron's decoder block spec (dense and MoE layers by moe_layer_freq)
        from megatron_hdp.megatron.layers.spec import get_gpt_decoder_block_with_hdp_spec
        from megatron_hdp.megatron.core_api.model import build_gpt

        chunks = [build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128,
                            transformer_layer_spec=get_gpt_decoder_block_with_hdp_spec(config))]
    else:
        chunks = build_gpt_chunks(config, vocab_size=VOCAB_SIZE, max_sequence_length=128)
    for chunk in chunks:
        load_full_weights(chunk, init)
    dist_opt = case.get("distributed_optimizer", False)
    ddps, opt = wrap_chunks_for_training(
        chunks, adam_eps=ADAM_EPS, overlap_grad_reduce=overlap, bucket_size=4000 if overlap else None,
        distributed_optimizer=dist_opt, overlap_param_gather=dist_opt and overlap,
        **(dict(clip_grad=MOE_CLIP_GRAD) if is_moe or case.get("vpp") else {}), **_optimizer(case),
    )
    assert not overlap or pp > 1 or len(ddps[0].bucket_groups) > 1  # Megatron gives later PP stages one bucket
    offloaders = None
    if case.get("offload"):
        from megatron_hdp.offload import ActivationOffloader, OffloadConfig

        offload_config = OffloadConfig(min_tensor_bytes=0, num_resident_layers=case.get("resident_layers", 1))
        offloaders = [ActivationOffloader(layers=chunk.decoder.layers, config=offload_config) for chunk in chunks]
    trainer = HDPTrainer(model=ddps, optimizer=opt, state=state, offloader=offloaders)
    steps = []
    for step, (seed, lengths) in enumerate(BATCHES):
        if "plans" in case:
            plan = case["plans"][step]
        elif ep > 1 and step == 0:  # EP-aware balance: the group's ranks run one count, nothing padded
            plan = _balance_plan(lengths, trainer, capacity=case.get("capacity", 24))
        else:
            plan = _plan(lengths, num_ranks=state.hdp_size, seed=plan_seed + step, pp_size=pp,
                         idle=overlap and step == 1, offload=case.get("offload", 0.0))
        if "latent_ring_sizes" in case:  # multi-latent attention: these steps' rings of these sizes run latent
            plan = _with_latent_rings(plan, case["latent_ring_sizes"][step])
        stats = trainer.step(plan, token_reader(seed, lengths))
        idle = [len(r.microbatches) == 0 for r in plan.ranks]
        offloaded = stats.offload.bytes_offloaded if stats.offload is not None else 0
        grads = {}
        for ddp in ddps:
            grads.update(local_grads(ddp, opt if dist_opt else None))
        steps.append({"loss": stats.loss, "grads": grads, "rings": stats.num_rings, "idle": idle,
                      "offloaded": offloaded, "num_microbatches": stats.num_microbatches,
                      "planned": [len(r.microbatches) for r in plan.ranks]})
    return steps


def _balance_plan(lengths, trainer, *, capacity):
    """`balance`'s plan of `lengths` for the trainer's mesh (`HDPTrainer.planning_cost_model`: its EP groups
    planned as units), C = `capacity` tokens so that the longer documents need rings."""
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.cost.presets import analytic_cost_model

    cost_model = trainer.planning_cost_model(analytic_cost_model("llama-7b"))
    return make_plan(lengths, num_ranks=trainer.state.hdp_size, config=HDPConfig(hdp_capacity=capacity, hdp_offload=False),
                     cost_model=cost_model, policy="balance")


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


def _check_expert_groups(results, ep):
    """EP cases: the first step ran balance's plan exactly as planned (every member of an EP group the
    group's count, no padding micro-batch), and in the second the idle HDP rank ran padding micro-batches
    only, as many as its EP group's busiest member (it joins every all-to-all)."""
    first, second = results[0][0], results[0][1]
    assert first["num_microbatches"] == first["planned"], "balance's EP plan ran padded"
    for group in range(0, len(first["planned"]), ep):
        assert len(set(first["planned"][group:group + ep])) == 1
    idle = second["idle"].index(True)
    group = second["planned"][idle - idle % ep: idle - idle % ep + ep]
    assert second["planned"][idle] == 0 and second["num_microbatches"][idle] == max(group) > 0


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
    if ep > 1:
        _check_expert_groups(results, ep)


WINDOW = dict(window=(6, 0), skip=2)
"""Sliding window of 6 keys before each query on layer 1 of 2 (`window_attn_skip_freq=2` leaves layer 2
full): shorter than most documents and than the ring chunks of the long ones, so pieces are trimmed and
skipped, and the model holds both a windowed and a full layer."""


def _megatron_window_mask_on_cpu():
    """Megatron's own `get_sliding_window_causal_mask` with its `torch.ones(..., device="cuda")` made on
    the CPU: the same function body (triu/tril of Megatron's bounds), evaluated with a torch whose `ones`
    ignores the device."""
    import types

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    original = utils.get_sliding_window_causal_mask
    shim = types.SimpleNamespace(
        ones=lambda *shape, device=None, **kw: torch.ones(*shape, **kw), triu=torch.triu, tril=torch.tril,
        bool=torch.bool,
    )
    fused_softmax.get_sliding_window_causal_mask = types.FunctionType(
        original.__code__, {**original.__globals__, "torch": shim}, original.__name__
    )


SINKS = {kind: dict(WINDOW, sink=kind, optimizer="sgd") for kind in ("learnable", "off-by-one")}
"""gpt-oss's attention on the tiny model: a sink (Megatron's `softmax_type`) on every layer, the sliding
window of `WINDOW` on alternate layers. Trained with SGD: Adam's first update, lr * g / (|g| + 1e-8), turns
the fp32 rounding (~3e-9) of a gradient element near 1e-8 into a weight change of ~1e-5 (the off-by-one
reference has such an element in layer 2's linear_proj), which moves step 2's gradients beyond the
tolerance whatever the plan; SGD's update is linear in the gradient."""
VARIANTS = {"window": WINDOW, **SINKS}
SINK_PARAM = "decoder.layers.{}.self_attention.core_attention.softmax_offset"
SINK_CHECKPOINT_KEY = "decoder.layers.self_attention.core_attention.softmax_offset"
"""The sink's key in Megatron's distributed checkpoint (the layers stacked along a first axis)."""


def _optimizer(case):
    """The case's optimizer for `wrap_chunks_for_training` (default: Megatron's Adam)."""
    return {"optimizer": case["optimizer"]} if case.get("optimizer") else {}


def _variant_references(rank, world_size):
    """The dense reference of `_reference` for each of `VARIANTS`, in one launch: Megatron's
    DotProductAttention masks the window and adds the sink's column (its `SoftmaxOne`)."""
    from megatron_hdp.harness.exactness import VOCAB_SIZE, full_weights, reference_steps
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training

    _megatron_window_mask_on_cpu()
    out = {}
    for name, case in VARIANTS.items():
        _init()
        config = _case_config(tiny_llama_config(), case)
        model = build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False)
        init = full_weights(model)
        ddp, opt = wrap_for_training(model, adam_eps=ADAM_EPS, **_optimizer(case))
        out[name] = {"init": init, "steps": reference_steps(ddp, opt, BATCHES)}
        destroy_hdp()
    return out


@pytest.fixture(scope="module")
def variant_reference():
    return run_gloo(_variant_references, 1, timeout_s=300)[0]


def test_sliding_window_matches_single_process_reference(reference, variant_reference):
    """`window_size=(6, 0)` with `window_attn_skip_freq=2` under HDP (rings of 2..4 ranks, idle rank):
    loss and gradients equal Megatron's own windowed attention on one process, and the loss differs from
    the run without the window (the option is not ignored)."""
    want = variant_reference["window"]
    assert all((w == reference["dense"]["init"][name]).all() for name, w in want["init"].items())  # same model
    for step, (windowed, full) in enumerate(zip(want["steps"], reference["dense"]["steps"])):
        assert windowed["loss"] != pytest.approx(full["loss"], rel=1e-4), f"step {step}: the window changed nothing"
    results = run_gloo(_hdp, 4, 1, 1, 1, want["init"], 777, True, WINDOW, timeout_s=240)
    _check(want, results)


def _sink_runs(rank, world_size, runs):
    """`_hdp` for each of `runs` (its arguments) in one launch, Megatron's parallel state rebuilt for each;
    then, at TP 2, the checkpoint entries of an HDP and a plain GPT with the learnable sink (`_entries`)."""
    from megatron_hdp.harness.exactness import VOCAB_SIZE
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.megatron.core_api.model import build_gpt

    results = []
    for run in runs:
        results.append(_hdp(rank, world_size, *run))
        destroy_hdp()
    _init(tp=2)
    config = _case_config(tiny_llama_config(), SINKS["learnable"])
    entries = [_entries(build_gpt(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=hdp)) for hdp in (True, False)]
    destroy_hdp()
    return results, entries


def _entries(model):
    """What a distributed checkpoint of `model` holds: key -> (global shape, this rank's offset, how many
    pieces along each axis, dtype) of every sharded tensor, the kind of any other entry (extra state)."""
    return {
        entry.key: (entry.global_shape, entry.global_offset, entry.axis_fragmentations, str(entry.dtype))
        if hasattr(entry, "axis_fragmentations") else type(entry).__name__
        for entry in model.sharded_state_dict().values()
    }


def test_sinks_match_single_process_reference(variant_reference):
    """gpt-oss's attention (`SINKS`: off-by-one or learnable sink on every layer, the window on alternate
    layers) under HDP: HDP = 4 with rings of 2..4 ranks and whole documents (and an idle rank in step 2), and
    the learnable sink at TP 2 x HDP 2 (each TP rank its heads' slice): loss and every gradient, the sink
    parameter's included, equal Megatron's own attention with the sink on one process; the sinks change
    the loss (not ignored); an HDP model's checkpoint holds the sink under Megatron's key, shape and TP
    sharding, and no other key than a plain model's."""
    window = variant_reference["window"]["steps"]
    for kind in SINKS:
        for step, (sunk, plain) in enumerate(zip(variant_reference[kind]["steps"], window)):
            # (a tiny freshly initialised model: the sink moves the loss by ~1e-5, its gradients by far more)
            assert sunk["loss"] != pytest.approx(plain["loss"], rel=1e-6), f"{kind} step {step}: the sink changed nothing"
    learnable, off_by_one = variant_reference["learnable"], variant_reference["off-by-one"]
    assert SINK_PARAM.format(0) in learnable["init"] and SINK_PARAM.format(0) not in off_by_one["init"]
    runs = [(1, 1, 1, learnable["init"], 901, True, SINKS["learnable"]),
            (1, 1, 1, off_by_one["init"], 902, True, SINKS["off-by-one"]),
            (2, 1, 1, learnable["init"], 903, False, SINKS["learnable"])]
    launched = run_gloo(_sink_runs, 4, runs, timeout_s=300)
    for r, (_, _, _, _, _, overlap, case) in enumerate(runs):
        results = [rank_results[r] for rank_results, _ in launched]
        _check(variant_reference[case["sink"]], results)
        if overlap:
            _check_idle(results)
        if case["sink"] == "learnable":  # the sink's gradient was compared, on every rank
            assert all(SINK_PARAM.format(1) in rank_steps[0]["grads"] for rank_steps in results)
    offsets = set()
    for hdp, plain in (entries for _, entries in launched):
        assert hdp == plain
        shape, offset, pieces, _ = hdp[SINK_CHECKPOINT_KEY]
        assert shape == (2, 4) and pieces == (2, 2)  # [layers, heads]: each TP rank holds 2 of the 4 heads
        offsets.add(offset[1])
    assert offsets == {0, 2}


CASES = {
    "hdp4-distopt-overlap-grad-and-param-gather-idle": dict(distributed_optimizer=True),
    "hdp4-recompute-full": dict(recompute="full"),
    "hdp4-recompute-full-offload": dict(recompute="full", offload=0.5),
    "hdp4-recompute-selective": dict(recompute="selective"),
    "hdp4-recompute-selective-offload": dict(recompute="selective", offload=0.5),
    "tp2xhdp2-sequence-parallel": dict(sp=True),
    "tp2xhdp2-sequence-parallel-moe-aux-loss": dict(sp=True, moe=True),
    "pp2xhdp2-moe-aux-loss": dict(pp=2, moe=True),
    "ep4-moe-aux-loss-hdp4-balance-plan-overlap-idle": dict(ep=4, moe=True, overlap=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_more_layouts_match_single_process_reference(reference, name):
    case = CASES[name]
    tp = 2 if case.get("sp") else 1
    overlap = case.get("distributed_optimizer", False) or case.get("overlap", False)
    ref = reference["moe" if case.get("moe") else "dense"]
    ep = case.get("ep", 1)
    results = run_gloo(_hdp, 4, tp, case.get("pp", 1), ep, ref["init"], 500 + len(name), overlap, case, timeout_s=240)
    _check(ref, results)
    if case.get("distributed_optimizer"):
        _check_covered(reference["dense"], results)
    if overlap:
        _check_idle(results)
    if ep > 1:
        _check_expert_groups(results, ep)
    if case.get("offload"):
        offloaded = [sum(rank_steps[step]["offloaded"] for rank_steps in results) for step in range(len(BATCHES))]
        if case.get("recompute") == "full":
            # full recomputation keeps only each layer's input, saved by the checkpoint outside the layer:
            # there is nothing for the offloader to move (and the recompute in the backward runs outside
            # any micro-batch context, so the offloader leaves it alone)
            assert offloaded == [0] * len(BATCHES)
        else:
            assert all(b > 0 for b in offloaded), offloaded


NEGATIVE = {
    "ep2-moe-aux-loss-hdp4-overlap-idle-stock-router": (1, 1, 2, True, dict(stock_router=True)),
    "tp2xhdp2-sequence-parallel-moe-aux-loss-without-tp-sum": (2, 1, 1, False, dict(sp=True, moe=True, no_tp_sum=True)),
}


@pytest.mark.parametrize("name", list(NEGATIVE))
def test_moe_cases_fail_with_the_stock_router_or_without_the_tp_sum(reference, name):
    """The README says Megatron's stock router fails the EP=2 x HDP=4 case and the per-document router
    fails TP=2 + SP without the TP sum of its counts: the same launches as the passing cases above
    (same plans and seeds), with that one change, must differ from the reference."""
    tp, pp, ep, overlap, case = NEGATIVE[name]
    seed = 100 * tp + 10 * pp + ep if case.get("stock_router") else 500 + len("tp2xhdp2-sequence-parallel-moe-aux-loss")
    results = run_gloo(_hdp, 4, tp, pp, ep, reference["moe"]["init"], seed, overlap, case, timeout_s=240)
    with pytest.raises(AssertionError, match="grad of"):
        _check(reference["moe"], results)


VPP_GROUP = 3
"""microbatch_group_size_per_vp_stage of the virtual-pipeline case: above PP = 2, where Megatron runs last
groups of G + r micro-batches (pp <= r < G) and the ring rule pads beyond Megatron's own constraints."""


def _vpp_plans():
    """Hand plans for HDP = 2 pipelines of PP 2, each with two rings across the pipelines and a planned
    offload ratio. Step 0: counts 6 and 5, rings at micro-batches 0 and 3. Both counts run in Megatron
    (G = 3), but together they deadlock (plan.timeline.interleaved.deadlock_cycle finds the cycle): the ring rule
    pads the second pipeline to 6. Step 1: counts 4 and 2, rings at 0 and 1: the pipelines run 5 and 3."""
    from megatron_hdp.plan.hand_plan import plan_from_rings

    (_, first), (_, second) = BATCHES
    return [
        plan_from_rings(first, [(0, 1), (0,), (1, 0), (0,), (1,), (0,), (1,), (1,), (0,)], [0, 1, 3, 2, 1, 4, 2, 4, 5],
                        num_ranks=2, capacity=sum(first), pp_size=2, vpp_size=2,
                        offload_ratios=[0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]),
        plan_from_rings(second, [(0, 1), (0,), (0,), (0,), (1, 0), (1,), (0,)], [0, 1, 2, 3, 1, 0, 3],
                        num_ranks=2, capacity=sum(second), pp_size=2, vpp_size=2, offload_ratios=[0.5] + [0.0] * 6),
    ]


def test_virtual_pipeline_matches_single_process_reference(reference):
    """VPP 2 x PP 2 x HDP 2 (Megatron's interleaved schedule, one layer per model chunk): every chunk runs
    each micro-batch with its rings, positions and offload ratio, and pipelines run the counts the ring
    rule gives them (`_vpp_plans`)."""
    from megatron_hdp.plan.timeline.interleaved import deadlock_cycle

    plans = _vpp_plans()
    assert [len(r.microbatches) for r in plans[0].ranks] == [6, 5] and [len(r.microbatches) for r in plans[1].ranks] == [4, 2]
    assert deadlock_cycle([6, 5], rings=[(0, (0, 1)), (3, (1, 0))], pp_size=2, vpp_size=2, group_size=VPP_GROUP)
    case = dict(vpp=2, group_size=VPP_GROUP, plans=plans, offload=0.5, resident_layers=0)
    results = run_gloo(_hdp, 4, 1, 2, 1, reference[VPP_KIND]["init"], 0, False, case, timeout_s=240)
    _check(reference[VPP_KIND], results)
    # global rank = stage x 2 + HDP rank: both stages of a pipeline run its count
    assert [rank_steps[0]["num_microbatches"] for rank_steps in results] == [[6, 6, 6, 6]] * 4
    assert [rank_steps[1]["num_microbatches"] for rank_steps in results] == [[5, 3, 5, 3]] * 4
    assert all(sum(rank_steps[step]["offloaded"] for rank_steps in results) > 0 for step in range(2))


def _one_f_one_b_plans():
    """Hand plans for HDP = 2 pipelines of PP 2 (1F1B, one layer per stage) with rings across the pipelines
    and unequal counts, which 1F1B runs unpadded (`plan.timeline.interleaved`: a shorter pipeline's order is the
    longer one's restricted to its micro-batches). Step 0: counts 5 and 2, rings at micro-batches 0 and 1
    (a whole document beside the second ring). Step 1: counts 1 and 4, a ring at 0."""
    from megatron_hdp.plan.hand_plan import plan_from_rings

    (_, first), (_, second) = BATCHES
    return [
        plan_from_rings(first, [(0, 1), (0,), (1, 0), (0,), (0,), (1,), (0,), (1,), (0,)], [0, 2, 1, 3, 4, 1, 2, 0, 4],
                        num_ranks=2, capacity=sum(first), pp_size=2),
        plan_from_rings(second, [(0, 1), (1,), (1,), (1,), (1,), (0,), (1,)], [0, 1, 2, 3, 0, 0, 1],
                        num_ranks=2, capacity=sum(second), pp_size=2),
    ]


def test_1f1b_pipelines_of_unequal_counts_match_single_process_reference(reference):
    """PP 2 x HDP 2 with rings and unequal 1F1B counts (`_one_f_one_b_plans`): each pipeline runs exactly its
    own count (no padding to the largest), and loss and every gradient equal the reference."""
    plans = _one_f_one_b_plans()
    assert [[len(r.microbatches) for r in plan.ranks] for plan in plans] == [[5, 2], [1, 4]]
    results = run_gloo(_hdp, 4, 1, 2, 1, reference["dense"]["init"], 0, False, dict(plans=plans), timeout_s=240)
    _check(reference["dense"], results)
    # global rank = stage x 2 + HDP rank: both stages of a pipeline run its own count
    assert [rank_steps[0]["num_microbatches"] for rank_steps in results] == [[5, 2, 5, 2]] * 4
    assert [rank_steps[1]["num_microbatches"] for rank_steps in results] == [[1, 4, 1, 4]] * 4


def test_virtual_pipeline_runs_each_plans_group_size(reference):
    """The planner's G per step (`StepPlan.group_size`): the model is configured with Megatron's default
    G = PP = 2. Step 0's plan (counts 4 and 2, rings at micro-batches 0 and 1) carries G = 3, under which
    the ring rule pads it to 5 and 3 (under G = 2 it would run 4 and 2, and Megatron refuses 5 with G = 2);
    step 1's plan (`_vpp_plans`, counts 4 and 2) carries none, so it runs the configured G = 2 again,
    unpadded. Loss and every gradient equal the reference, so each step's schedule ran the G its counts
    were padded for."""
    import dataclasses

    from megatron_hdp.plan.hand_plan import plan_from_rings

    (_, first), _ = BATCHES
    grouped = plan_from_rings(first, [(0, 1), (0,), (1, 0), (0,), (1,), (0,), (1,), (0,), (0,)],
                              [0, 1, 1, 2, 0, 3, 1, 3, 2], num_ranks=2, capacity=sum(first), pp_size=2, vpp_size=2,
                              offload_ratios=[0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    plans = [dataclasses.replace(grouped, group_size=VPP_GROUP).validate(), _vpp_plans()[1]]
    assert [[len(r.microbatches) for r in plan.ranks] for plan in plans] == [[4, 2], [4, 2]]
    case = dict(vpp=2, plans=plans, offload=0.5, resident_layers=0)
    results = run_gloo(_hdp, 4, 1, 2, 1, reference[VPP_KIND]["init"], 0, False, case, timeout_s=240)
    _check(reference[VPP_KIND], results)
    assert [rank_steps[0]["num_microbatches"] for rank_steps in results] == [[5, 3, 5, 3]] * 4
    assert [rank_steps[1]["num_microbatches"] for rank_steps in results] == [[4, 2, 4, 2]] * 4
