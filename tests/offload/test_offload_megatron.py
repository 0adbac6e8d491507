"""Activation offloading on a Megatron-Core GPTModel (CPU, one gloo rank) driven by Megatron's own
forward_backward_no_pipelining: each micro-batch's forward runs inside `offloader.microbatch(ratio=...)`,
its backward runs later in the schedule, and loss and gradients equal those without offloading. Then the
same inside a whole HDP step (HDPTrainer on 4 gloo ranks, ring attention, the plan's per-sequence ratios)."""

from megatron_hdp.comm.launch import run_gloo

SEQ, VOCAB, MICROBATCHES = 32, 128, 3


def _gpt():
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gated_linear_unit=True, normalization="RMSNorm",
        add_bias_linear=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
    )
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def _train_step(model, offloader, ratios):
    """One step of MICROBATCHES micro-batches through Megatron's no-pipelining schedule."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gen = torch.Generator().manual_seed(3)
    batches = iter([torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen) for _ in range(MICROBATCHES)])
    plan_ratios = iter(ratios)
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked (future tokens)

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        with offloader.microbatch(ratio=next(plan_ratios)):  # what the HDP step driver does
            losses = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return losses, loss_func

    model.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=batches, model=model, num_microbatches=MICROBATCHES,
        seq_length=SEQ, micro_batch_size=2, forward_only=False,
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return [x["lm loss"] for x in losses], grads, offloader.pop_step_stats()


def _offload_vs_reference(rank, world_size):
    import torch
    from megatron.core import parallel_state as ps

    from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims
    from megatron_hdp.offload import ActivationOffloader, OffloadConfig

    apply_cpu_shims()
    ps.initialize_model_parallel(1, 1)
    model = _gpt()
    offloader = ActivationOffloader(layers=model.decoder.layers, config=OffloadConfig(min_tensor_bytes=0))
    ref_losses, ref_grads, ref_stats = _train_step(model, offloader, [0.0] * MICROBATCHES)
    losses, grads, stats = _train_step(model, offloader, [1.0, 0.0, 0.5])
    ps.destroy_model_parallel()
    same_grads = all(torch.equal(grads[name], grad) for name, grad in ref_grads.items())
    return {
        "same_losses": all(torch.equal(a, b) for a, b in zip(losses, ref_losses)),
        "same_grads": same_grads,
        "ref_stats": ref_stats,
        "stats": stats,
    }


def test_megatron_gpt_offload_matches_reference_under_megatron_schedule():
    result = run_gloo(_offload_vs_reference, 1, timeout_s=240)[0]
    assert result["same_losses"] and result["same_grads"]
    assert result["ref_stats"].num_microbatches == MICROBATCHES and result["ref_stats"].bytes_offloaded == 0
    stats = result["stats"]
    assert stats.num_microbatches == MICROBATCHES and stats.num_tensors > 0
    assert stats.bytes_offloaded == stats.bytes_prefetched > 0
    assert stats.num_late_fetches == 0  # Megatron's layer outputs carry the prefetch hooks


# --- inside an HDP step ------------------------------------------------------------------------------
# Sequence 0 is split over a ring of 3 ranks, the others stay whole; rank 1 and rank 3 run two micro-batches.
LENGTHS, RINGS, SLOTS = [40, 24, 9, 13], [(0, 1, 2), (3,), (3,), (1,)], [0, 0, 1, 1]
RATIOS = [0.5, 1.0, 0.0, 0.25]


def _hdp_step_offload_vs_plain(rank, world_size):
    from megatron_hdp.harness.exactness import VOCAB_SIZE, full_weights, load_full_weights, local_grads, token_reader
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer
    from megatron_hdp.offload import ActivationOffloader, OffloadConfig

    state = initialize_hdp(seed=5)
    plan = plan_from_rings(
        LENGTHS, RINGS, SLOTS, num_ranks=4, capacity=sum(LENGTHS), offload_ratios=RATIOS
    )
    out = {}
    init = None
    for name in ("plain", "offload"):
        # own TransformerConfig per model: a trainer hooks its finalize/no_sync functions into the config
        model = build_gpt(tiny_llama_config(num_layers=4), vocab_size=VOCAB_SIZE, max_sequence_length=64)
        init = init or full_weights(model)
        load_full_weights(model, init)
        ddp, opt = wrap_for_training(model)
        offloader = None
        if name == "offload":
            offloader = ActivationOffloader(layers=model.decoder.layers, config=OffloadConfig(min_tensor_bytes=0))
        trainer = HDPTrainer(model=ddp, optimizer=opt, state=state, offloader=offloader)
        stats = trainer.step(plan, token_reader(9, LENGTHS))
        out[name] = {"loss": stats.loss, "grads": local_grads(ddp), "offload": stats.offload, "rings": stats.num_rings}
    return out


def test_offload_inside_hdp_step_matches_the_step_without_offload():
    import numpy as np

    results = run_gloo(_hdp_step_offload_vs_plain, 4, timeout_s=240)
    for rank, out in enumerate(results):
        plain, offload = out["plain"], out["offload"]
        assert plain["rings"] == offload["rings"] == 1 and plain["offload"] is None
        assert offload["loss"] == plain["loss"] and np.isfinite(plain["loss"])
        for name, (_, grad) in plain["grads"].items():
            np.testing.assert_array_equal(offload["grads"][name][1], grad, err_msg=f"rank {rank} grad of {name}")
        stats = offload["offload"]
        assert stats.num_microbatches == (2 if rank in (1, 3) else 1)
        assert stats.bytes_offloaded == stats.bytes_prefetched > 0, f"rank {rank}: {stats}"
        assert stats.num_late_fetches == 0
    # rank 3 offloads all of sequence 1 (ratio 1.0, 24 tokens), rank 2 half of its 40 / 3 share of sequence 0
    assert results[3]["offload"]["offload"].bytes_offloaded > results[2]["offload"]["offload"].bytes_offloaded
