"""Multi-token prediction under HDP is exact: loss and every gradient equal ordinary training with MTP.

The reference is tests/megatron/test_megatron_exactness.py's (one process, Megatron's stock attention, RoPE and
MTP block, each document its own micro-batch [1, L]): Megatron's MTP rolls each document's input ids,
position ids, labels and loss mask one position per depth and normalises depth d's loss by the
document's L / (L - d). Under HDP the MTP layers run on the planned micro-batches (documents whole or
zigzag-split over rings of 2..4 ranks, packed together), their rolls answered from the tokens the loader
read after each chunk (megatron_hdp/megatron/layers/mtp.py, data/mtp_shift.py). Two steps each (the second
after an optimizer update moved by the MTP gradients), in one reference launch and one HDP launch of 4
ranks that runs every variant in turn:

- dense, depth 1, HDP = 4, Megatron DDP overlapping its gradient reduce, the second plan leaving a rank
  idle (its padding micro-batch carries zero MTP inputs);
- MoE (load-balancing and z-loss, the MTP layer is a MoE layer like the decoder's last), depth 2, EP = 2
  across HDP = 4, mtp_loss_scaling_factor 0.3;
- PP = 2 x HDP = 2 (1F1B), depth 2: the MTP block on the last stage, its embedding's gradient summed
  with the first stage's;
- virtual pipeline stages (2 per PP rank) x PP = 2 x HDP = 2, depth 1: the MTP block in the last model
  chunk, the ring rule's padding micro-batches included;
- MoE, depth 2, one MTP layer repeated over both depths (mtp_use_repeated_layer) with its heads detached
  from the main model (mtp_detach_heads), HDP = 4.
"""

import dataclasses

import pytest
from test_megatron_exactness import (
    ADAM_EPS, BATCHES, MOE_CLIP_GRAD, MOE_LOSSES, NUM_EXPERTS, VPP_GROUP, _check, _check_idle, _init, _plan, _vpp_plans,
)

from megatron_hdp.comm.launch import run_gloo

VARIANTS = {
    "dense-mtp1-hdp4-overlap-idle": dict(depth=1, overlap=True),
    "moe-mtp2-ep2-hdp4-scale": dict(depth=2, moe=True, ep=2, mtp_loss_scaling_factor=0.3),
    "pp2xhdp2-mtp2": dict(depth=2, pp=2),
    "vpp2xpp2xhdp2-mtp1": dict(depth=1, pp=2, vpp=2, layers=4),
    "moe-mtp2-repeated-detached-hdp4": dict(depth=2, moe=True, mtp_use_repeated_layer=True, mtp_detach_heads=True),
}
MTP_FIELDS = ("mtp_loss_scaling_factor", "mtp_use_repeated_layer", "mtp_detach_heads")


def _config(variant: dict):
    """The variant's tiny Llama with MTP (sized by the initialized parallel_state)."""
    from megatron_hdp.harness.model import tiny_llama_config

    moe = dict(num_moe_experts=NUM_EXPERTS, **MOE_LOSSES) if variant.get("moe") else {}
    config = tiny_llama_config(num_layers=variant.get("layers", 2), **moe)
    if variant.get("vpp"):
        config = dataclasses.replace(config, microbatch_group_size_per_vp_stage=VPP_GROUP)
    mtp = {name: variant[name] for name in MTP_FIELDS if name in variant}
    return dataclasses.replace(config, mtp_num_layers=variant["depth"], **mtp)


def _unclipped(variant: dict) -> dict:
    """MoE losses and the 4-layer model lift the gradient norm above 1: no clipping (see MOE_CLIP_GRAD)."""
    return dict(clip_grad=MOE_CLIP_GRAD) if variant.get("moe") or variant.get("vpp") else {}


def _reference(rank, world_size, names=tuple(VARIANTS)):
    from megatron_hdp.harness.exactness import VOCAB_SIZE, full_weights, reference_steps
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training

    out = {}
    for name in names:
        variant = VARIANTS[name]
        _init()
        model = build_gpt(_config(variant), vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=False)
        assert len(model.mtp.layers) == (1 if variant.get("mtp_use_repeated_layer") else variant["depth"])
        init = full_weights(model)
        ddp, opt = wrap_for_training(model, adam_eps=ADAM_EPS, **_unclipped(variant))
        out[name] = {"init": init, "steps": reference_steps(ddp, opt, BATCHES)}
        destroy_hdp()
    return out


def _hdp_variant(variant: dict, init: dict, seed: int) -> list[dict]:
    """Two HDP steps of one variant on this rank: loss, reduced gradients and what the plans did."""
    from megatron_hdp.harness.exactness import VOCAB_SIZE, load_full_weights, local_grads, token_reader
    from megatron_hdp.megatron.layers.spec import HDPCoreAttention
    from megatron_hdp.megatron.core_api.model import build_gpt_chunks, wrap_chunks_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer

    pp, overlap = variant.get("pp", 1), variant.get("overlap", False)
    state = _init(pp=pp, ep=variant.get("ep", 1), vpp=variant.get("vpp"))
    chunks = build_gpt_chunks(_config(variant), vocab_size=VOCAB_SIZE, max_sequence_length=128)
    with_mtp = [chunk for chunk in chunks if getattr(chunk, "mtp_process", False)]
    assert len(with_mtp) == state.is_last_stage  # Megatron's rule: the last stage's last model chunk
    for chunk in with_mtp:  # HDP's core attention reached every MTP layer
        assert all(isinstance(layer.mtp_model_layer.self_attention.core_attention, HDPCoreAttention)
                   for layer in chunk.mtp.layers)
    for chunk in chunks:
        load_full_weights(chunk, init)
    ddps, opt = wrap_chunks_for_training(chunks, adam_eps=ADAM_EPS, overlap_grad_reduce=overlap, bucket_size=4000 if overlap else None,
                                         **_unclipped(variant))
    trainer = HDPTrainer(model=ddps, optimizer=opt, state=state)
    plans = _vpp_plans() if variant.get("vpp") else None
    steps = []
    for step, (batch_seed, lengths) in enumerate(BATCHES):
        plan = plans[step] if plans else _plan(lengths, num_ranks=state.hdp_size, seed=seed + step, pp_size=pp,
                                               idle=overlap and step == 1)
        stats = trainer.step(plan, token_reader(batch_seed, lengths))
        grads = {}
        for ddp in ddps:
            grads.update(local_grads(ddp))
        steps.append({"loss": stats.loss, "grads": grads, "rings": stats.num_rings,
                      "idle": [len(r.microbatches) == 0 for r in plan.ranks]})
    return steps


def _hdp(rank, world_size, inits):
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp

    out = {}
    for name, init in inits.items():
        out[name] = _hdp_variant(VARIANTS[name], init, seed=900 + 10 * list(VARIANTS).index(name))
        destroy_hdp()
    return out


@pytest.fixture(scope="module")
def runs():
    reference = run_gloo(_reference, 1, timeout_s=240)[0]
    results = run_gloo(_hdp, 4, {name: ref["init"] for name, ref in reference.items()}, timeout_s=400)
    return reference, results


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mtp_step_matches_single_process_reference(runs, name):
    reference, results = runs
    ranks = [rank_results[name] for rank_results in results]
    _check(reference[name], ranks)
    if VARIANTS[name].get("overlap"):
        _check_idle(ranks)

