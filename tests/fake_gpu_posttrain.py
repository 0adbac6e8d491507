"""The post-training door's fake-GPU scenario (`fake_gpu_scenarios.posttrain_door` runs it; see
`tests/fake_gpu.py` for the harness and its rules).

`PostTrainer` is what an RL framework's worker calls on a GPU: per micro-batch it turns the model's
vocabulary-parallel logits into log-probs and entropy inside Megatron's schedule, hands `loss_fn` the
plan's response mask and a per-sample sum across rings, and gathers results to the host. Here it runs on
CUDA tensors under NCCL's rules, as one played rank of 2.
"""

from __future__ import annotations

import numpy as np

POSTTRAIN_PLANS = (
    dict(lengths=[24, 10, 8], rings=[(0, 1), (0,), (1,)], slots=[0, 1, 0], prompts=[20, 3, 2]),
    dict(lengths=[10], rings=[(0,)], slots=[0], prompts=[4]),
)
"""Plan lengths, rings, micro-batch slots and prompt tokens of the scenario's two batches: a sample on a
ring over both ranks (most of it prompt) beside whole samples (rank 0 runs two micro-batches, rank 1 one),
then one whole sample on rank 0, so that rank 1 is idle and runs a padding micro-batch."""


def posttrain_door(rank: str, log_path: str) -> None:
    """For each of `POSTTRAIN_PLANS`, as HDP rank `rank` of 2: `PostTrainer.forward` (every sample
    gathered to every rank), then a train step of a bf16 GPTModel with the HDP spec (torch varlen
    attention, Megatron DDP and optimizer) whose `loss_fn` reads the field "response_mask" the plan's
    prompt lengths make, takes a GSPO-like sequence ratio by `sample_sum` (P2P on the sample's ring) and
    returns a metric. No host sync or blocking copy inside a layer, no blocking copy between a
    micro-batch's transfer and its backward; writes this rank's P2P and collective logs as JSON for the
    test to match across both ranks (the idle rank posts what the busy one does)."""
    import dataclasses
    import json

    import torch
    import fake_gpu
    from fake_gpu_scenarios import VOCAB, WORLD, _assert_no_blocking_transfer_copies, _assert_no_pageable_copies_in_layers

    mode = fake_gpu.install(world_size=WORLD, rank=int(rank))
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.megatron.core_api.model import build_gpt
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.posttrain.batch import Rollouts
    from megatron_hdp.posttrain.planning import response_masks
    from megatron_hdp.posttrain.runtime import PostTrainer
    from megatron_hdp.posttrain.weights import loss_weights

    state = initialize_hdp()
    config = dataclasses.replace(tiny_llama_config(num_layers=2), bf16=True, params_dtype=torch.bfloat16,
                                 pipeline_dtype=torch.bfloat16, use_cpu_initialization=False)
    with torch.device("cuda"):
        model = build_gpt(config, vocab_size=VOCAB, max_sequence_length=64)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0), [ddp])
    trainer = PostTrainer(model=ddp, optimizer=optimizer, state=state, backend="torch_varlen")

    def loss_fn(shard):
        mask = shard.fields["response_mask"]
        ratio = (shard.logprobs - shard.fields["old"]).exp()
        seq_ratio = (shard.sample_sum((shard.logprobs - shard.fields["old"]) * mask)
                     / shard.sample_sum(mask).clamp(min=1)).exp()
        losses = -(ratio * shard.fields["advantage"]) * mask + 0.01 * seq_ratio * mask - 0.01 * shard.entropy * mask
        return losses, {"ratio": (ratio * mask, mask)}

    for number, layout in enumerate(POSTTRAIN_PLANS):
        plan = plan_from_rings(layout["lengths"], layout["rings"], layout["slots"], num_ranks=WORLD, capacity=32)
        plan = dataclasses.replace(plan, prompt_lengths=tuple(layout["prompts"])).validate()
        ids = tuple(f"b{number}s{i}" for i in range(len(layout["lengths"])))
        tokens = {sid: (np.arange(n + 1) * 7 + i) % VOCAB for i, (sid, n) in enumerate(zip(ids, layout["lengths"]))}
        temperature = {"temperature": {sid: 0.9 for sid in ids}}
        old = trainer.forward(plan, Rollouts(sample_ids=ids, tokens=tokens, scalars=temperature), gather="all")
        assert list(old) == list(ids) and all(len(old[s].logprobs) == len(tokens[s]) for s in ids), "forward's results"
        fields = {"old": {s: old[s].logprobs for s in ids},
                  "advantage": {s: np.full(len(tokens[s]), 0.5, dtype=np.float32) for s in ids},
                  "weights": dict(zip(ids, loss_weights(response_masks(plan), mode="token-mean")))}
        stats = trainer.train_step(plan, Rollouts(sample_ids=ids, tokens=tokens, fields=fields, scalars=temperature),
                                   loss_fn=loss_fn)
        assert set(stats.metrics) == {"ratio"} and stats.num_rings == int(number == 0), stats
    assert mode.backward_ops, "the backward ran on autograd's device thread"
    _assert_no_pageable_copies_in_layers(mode)
    _assert_no_blocking_transfer_copies(mode)
    batch_copies = [c for c in mode.h2d if "collate.py" in c["where"]]
    assert batch_copies and all(c["pinned"] and c["non_blocking"] for c in batch_copies), batch_copies
    with open(log_path, "w") as out:
        json.dump({"p2p": fake_gpu.p2p_log(), "collectives": fake_gpu.collective_log()}, out)
    print(f"post-training door: {len(batch_copies)} micro-batch copies (pinned, non-blocking), "
          f"{sum(map(len, fake_gpu.p2p_log().values()))} P2P group calls")
