"""The post-training door is exact: log-probs, entropy, the objective, its metrics and every gradient equal a
plain single-process forward of the same Megatron model over each sample alone.

The reference (one process, Megatron's stock local layer spec, each sample its own [1, N] batch, float64
log-softmax of the full-vocabulary logits, the loss summed sample by sample with plain `.sum()`) shares no
code with `megatron_hdp.posttrain`. The HDP side runs one 4-rank launch that goes through several meshes
in turn — HDP 4; TP 2 x HDP 2; PP 2 x HDP 2 (1F1B); PP 2 x VPP 2 x HDP 2 (Megatron's interleaved schedule,
one layer per model chunk, a 4-layer model); EP 2 across HDP 4 with a MoE model — each under a
random plan (rings of 2-4 ranks that overlap, uneven micro-batch counts, an idle rank), one 5-rank launch
with a ring of all 5 for the dense model, a model with learnable attention sinks (gpt-oss) and one with
multi-latent attention (DeepSeek), and the same batch on one rank in the reference's launch (1 rank and
4 ranks agree). The loss is a clipped
policy-gradient term, an entropy bonus, a KL-like term against a side field and a GSPO-like sequence
ratio (a per-sample sum across the sample's ring), with token-mean weights from `loss_weights`; on the HDP
side the loss mask is the response mask the plan makes from its prompt lengths (`response_masks`), and
the 4-rank launch ends with a step on one sample, where the ranks without it run a padding micro-batch.
"""

import dataclasses

import numpy as np
import pytest
import torch

from megatron_hdp.comm.launch import run_gloo

LENGTHS = [37, 5, 64, 12, 23, 50, 9, 3, 2, 30]
"""Tokens per sample (prompt + response)."""
PROMPTS = tuple(n // 3 for n in LENGTHS)
"""Prompt tokens per sample: the reference's loss mask is 1 from token n // 3 on; HDP's is the plan's response mask."""
MESHES = [("hdp4", 1, 1, 1, 1, "dense"), ("tp2", 2, 1, 1, 1, "dense"), ("pp2", 1, 2, 1, 1, "dense"),
          ("pp2-vpp2", 1, 2, 2, 1, "deep"), ("ep2-moe", 1, 1, 1, 2, "moe")]
"""(name, TP, PP, virtual stages per PP rank, EP, model kind) of each mesh the 4-rank launch runs."""
FIVE_RANK_MESHES = [("hdp5", 1, 1, 1, 1, "dense"), ("hdp5-sinks", 1, 1, 1, 1, "sinks"), ("hdp5-mla", 1, 1, 1, 1, "mla")]
"""The same for the 5-rank launch: its plans put a sample on a ring of all 5 ranks."""
KINDS = {"dense": {}, "deep": {"num_layers": 4}, "moe": {"num_moe_experts": 4}, "sinks": {"softmax_type": "learnable"},
         "mla": None}
"""Model kind -> its fields of `tiny_llama_config` (None: `tiny_mla_fields()`, multi-latent attention); "deep"
has 4 layers, one per model chunk of PP 2 x VPP 2."""


def _rollouts():
    """The batch: tokens, a response mask, advantages, old log-probs, per-sample temperatures, weights."""
    from megatron_hdp.harness.exactness import VOCAB_SIZE
    from megatron_hdp.posttrain.batch import Rollouts
    from megatron_hdp.posttrain.weights import loss_weights

    rng = np.random.default_rng(5)
    ids = tuple(f"s{i}" for i in range(len(LENGTHS)))
    tokens = {sid: rng.integers(0, VOCAB_SIZE, n) for sid, n in zip(ids, LENGTHS)}
    masks = {sid: (np.arange(n) >= p).astype(np.float32) for sid, n, p in zip(ids, LENGTHS, PROMPTS)}
    weights = loss_weights([masks[s] for s in ids], mode="token-mean")
    fields = {
        "mask": masks,
        "advantage": {sid: np.full(n, rng.normal(), dtype=np.float32) for sid, n in zip(ids, LENGTHS)},
        "old": {sid: rng.normal(-5.0, 0.3, n).astype(np.float32) for sid, n in zip(ids, LENGTHS)},
        "weights": dict(zip(ids, weights)),
    }
    temperature = {sid: float(t) for sid, t in zip(ids, rng.uniform(0.7, 1.3, len(ids)))}
    return Rollouts(sample_ids=ids, tokens=tokens, fields=fields, scalars={"temperature": temperature})


def token_losses(logprobs, entropy, fields, sample_sum):
    """The test's loss per token (the caller's code, shared by both sides): clipped PG, entropy bonus, a
    k3 KL against `old`, and a GSPO-like sequence ratio from per-sample sums."""
    mask, advantage, old = fields["mask"], fields["advantage"], fields["old"]
    ratio = torch.exp(logprobs - old)
    pg = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
    kl = torch.exp(old - logprobs) - (old - logprobs) - 1
    seq_ratio = torch.exp(sample_sum((logprobs - old) * mask) / sample_sum(mask).clamp(min=1))
    return (pg - 0.01 * entropy + 0.1 * kl + 0.05 * seq_ratio * advantage) * mask, seq_ratio


def _model(kind, *, hdp):
    """The tiny GPT of `kind` (`KINDS`: dense, 4 dense layers, MoE with 4 experts top 2, learnable sinks, or
    multi-latent attention, the reference with Megatron's own MLA layer: `exactness_cases.reference_mla_block`)
    as this rank's list of model chunks (one per virtual pipeline stage)."""
    from exactness_cases import reference_mla_block

    from megatron_hdp.harness.exactness import VOCAB_SIZE
    from megatron_hdp.harness.model import tiny_llama_config, tiny_mla_fields
    from megatron_hdp.megatron.core_api.model import build_gpt_chunks

    fields = KINDS[kind]
    config = tiny_llama_config(**(tiny_mla_fields() if fields is None else fields))
    spec = reference_mla_block(config) if kind == "mla" and not hdp else None
    return build_gpt_chunks(config, vocab_size=VOCAB_SIZE, max_sequence_length=128, hdp=hdp,
                            transformer_layer_spec=spec)


def _reference_of(model, rollouts):
    """Per sample alone: float64 log-softmax of the stock model's logits; the objective, metrics, grads."""
    results, objective, ratio_sum = {}, 0.0, 0.0
    model.zero_grad()
    for sid in rollouts.sample_ids:
        tokens = torch.as_tensor(rollouts.tokens[sid])
        logits = model(input_ids=tokens[None], position_ids=torch.arange(len(tokens))[None], attention_mask=None)
        logits = logits[0, :-1].double() / rollouts.scalars["temperature"][sid]
        logp_all = torch.log_softmax(logits, dim=-1)
        logprobs = logp_all.gather(-1, tokens[1:, None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        fields = {name: torch.as_tensor(v[sid][1:]).double() for name, v in rollouts.fields.items()}
        losses, seq_ratio = token_losses(logprobs, entropy, fields, lambda x: x.sum().expand(x.shape))
        loss = (fields["weights"] * losses).sum()
        loss.backward()
        objective += float(loss)
        ratio_sum += float(seq_ratio[0])
        zero = np.zeros(1)
        results[sid] = (np.concatenate([zero, logprobs.detach().numpy()]), np.concatenate([zero, entropy.detach().numpy()]))
    grads = {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
    return {"samples": results, "objective": objective, "seq_ratio": ratio_sum, "grads": grads}


def _posttrain_run(state, kind, init, rollouts, plan):
    """Forward (every sample, gathered) and one train step of HDP's PostTrainer on this mesh, its loss
    masked by the response mask of the plan's prompt lengths (not by the rollouts' "mask")."""
    from megatron_hdp.harness.exactness import load_full_weights, local_grads
    from megatron_hdp.megatron.core_api.model import wrap_chunks_for_training
    from megatron_hdp.posttrain.runtime import PostTrainer

    chunks = _model(kind, hdp=True)
    for chunk in chunks:
        load_full_weights(chunk, init)
    ddps, optimizer = wrap_chunks_for_training(chunks, clip_grad=0.0)
    trainer = PostTrainer(model=ddps, optimizer=optimizer, state=state)
    samples = trainer.forward(plan, rollouts, gather="all")
    own = trainer.forward(plan, rollouts, gather="own")

    plan = dataclasses.replace(plan, prompt_lengths=PROMPTS)

    def loss_fn(shard):
        fields = {**shard.fields, "mask": shard.fields["response_mask"]}
        losses, seq_ratio = token_losses(shard.logprobs, shard.entropy, fields, shard.sample_sum)
        return losses, {"seq_ratio": (seq_ratio * shard.sample_head, shard.sample_head)}

    stats = trainer.train_step(plan, rollouts, loss_fn=loss_fn)
    return {"samples": {k: (v.logprobs, v.entropy) for k, v in samples.items()}, "own": sorted(own),
            "objective": stats.objective, "seq_ratio": stats.metrics["seq_ratio"],
            "grads": {name: g for ddp in ddps for name, g in local_grads(ddp).items()}, "rings": stats.num_rings}


def _idle_ranks_step(state, init):
    """One sample (s3) over the whole HDP domain: the ranks without it run a padding micro-batch through
    `loss_fn`, which reads the plan's response mask there too. Returns the step's objective."""
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.harness.exactness import load_full_weights
    from megatron_hdp.megatron.core_api.model import wrap_for_training
    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.posttrain.batch import Rollouts
    from megatron_hdp.posttrain.planning import plan_rollouts, response_masks
    from megatron_hdp.posttrain.runtime import PostTrainer
    from megatron_hdp.posttrain.weights import loss_weights

    (model,) = _model("dense", hdp=True)
    load_full_weights(model, init)
    ddp, optimizer = wrap_for_training(model, clip_grad=0.0)
    full = _rollouts()
    plan = plan_rollouts([LENGTHS[3]], prompt_lengths=[PROMPTS[3]], num_ranks=state.hdp_size,
                         config=HDPConfig(hdp_capacity=64), cost_model=analytic_cost_model("llama-7b"))
    rollouts = Rollouts(sample_ids=("s3",), tokens={"s3": full.tokens["s3"]},
                        fields={"weights": {"s3": loss_weights(response_masks(plan), mode="token-mean")[0]}},
                        scalars={"temperature": {"s3": full.scalars["temperature"]["s3"]}})
    trainer = PostTrainer(model=ddp, optimizer=optimizer, state=state)
    stats = trainer.train_step(plan, rollouts, loss_fn=lambda shard: shard.logprobs * shard.fields["response_mask"])
    return stats.objective


def _init(tp=1, pp=1, vpp=1, ep=1):
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp

    return initialize_hdp(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                          expert_model_parallel_size=ep, seed=7)


def _reference(rank, world_size):
    """The reference of each model kind, and the same batch through PostTrainer on this one rank."""
    from megatron_hdp.harness.exactness import full_weights
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.plan.hand_plan import random_plan

    rollouts = _rollouts()
    out = {}
    for kind in KINDS:
        _init()
        (model,) = _model(kind, hdp=False)
        init = full_weights(model)
        out[kind] = {"init": init, **_reference_of(model, rollouts)}
        destroy_hdp()
    state = _init()
    plan = random_plan([n - 1 for n in LENGTHS], num_ranks=1, seed=3)
    out["one-rank"] = _posttrain_run(state, "dense", out["dense"]["init"], rollouts, plan)
    destroy_hdp()
    return out


def _hdp(rank, world_size, inits, meshes):
    from megatron_hdp.megatron.core_api.initialize import destroy_hdp
    from megatron_hdp.plan.hand_plan import random_plan

    rollouts = _rollouts()
    out = {}
    for name, tp, pp, vpp, ep, kind in meshes:
        state = _init(tp, pp, vpp, ep)
        plan = random_plan([n - 1 for n in LENGTHS], num_ranks=state.hdp_size, seed=10 + tp + 2 * pp + 3 * ep + vpp,
                           pp_size=pp)
        plan = dataclasses.replace(plan, vpp_size=vpp).validate()
        out[name] = {**_posttrain_run(state, kind, inits[kind], rollouts, plan),
                     "largest_ring": max(len(sequence.ring) for sequence in plan.sequences),
                     "counts": [len(schedule.microbatches) for schedule in plan.ranks]}
        destroy_hdp()
    if world_size == 4:
        out["idle"] = _idle_ranks_step(_init(), inits["dense"])
        destroy_hdp()
    return out


@pytest.fixture(scope="module")
def reference():
    return run_gloo(_reference, 1, timeout_s=300)[0]


def _check(got, want, what):
    from megatron_hdp.harness.exactness import expected_shard

    for sid, (logprobs, entropy) in want["samples"].items():
        np.testing.assert_allclose(got["samples"][sid][0], logprobs, rtol=0, atol=1e-6, err_msg=f"{what} {sid} log-probs")
        np.testing.assert_allclose(got["samples"][sid][1], entropy, rtol=0, atol=1e-6, err_msg=f"{what} {sid} entropy")
    assert got["objective"] == pytest.approx(want["objective"], rel=1e-5, abs=1e-7), what
    assert got["seq_ratio"][1] == len(LENGTHS) and got["seq_ratio"][0] == pytest.approx(want["seq_ratio"], rel=1e-5)
    for name, (info, grad) in got["grads"].items():
        expected = expected_shard(torch.as_tensor(want["grads"][name]), info).float()
        torch.testing.assert_close(torch.as_tensor(grad), expected, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{what}: grad of {name} (TP rank {info.tp_rank}): {m}")


def test_one_rank_matches_the_reference(reference):
    _check(reference["one-rank"], reference["dense"], "one rank")


@pytest.mark.parametrize("world_size, meshes", [(4, MESHES), (5, FIVE_RANK_MESHES)], ids=["4-ranks", "5-ranks"])
def test_many_ranks_match_the_reference_on_every_mesh(reference, world_size, meshes):
    inits = {kind: reference[kind]["init"] for kind in KINDS}
    results = run_gloo(_hdp, world_size, inits, tuple(meshes), timeout_s=400)
    for name, tp, pp, vpp, ep, kind in meshes:
        want = reference[kind]
        if world_size == 5:
            assert results[0][name]["largest_ring"] == 5, f"{name}: no sample on a ring of 5"
        if vpp > 1:  # the interleaved schedule runs each pipeline's own count (2 and 3: the ring rule holds)
            assert len(set(results[0][name]["counts"])) > 1, f"{name}: the pipelines run one count"
        owners = set()
        for rank, result in enumerate(results):
            _check(result[name], want, f"{name} rank {rank}")
            owners.update(result[name]["own"])
            assert result[name]["rings"] > 0, f"{name}: the plan split no sample"
        assert owners == set(want["samples"]), f"{name}: gather='own' does not cover each sample"
    if world_size == 4:  # reference: the mean log-prob of s3's response predictions (t >= its prompt)
        logprobs = reference["dense"]["samples"]["s3"][0]
        want = float(np.mean(logprobs[max(PROMPTS[3], 1):]))
        assert [r["idle"] for r in results] == pytest.approx([want] * 4, rel=1e-5), "a rank without samples"
