"""Scenarios the fake-GPU harness runs, each in a fresh interpreter (`tests/fake_gpu.py`).

Each builds what a GPU user builds (Megatron GPTModel with the HDP spec on "cuda", DDP, optimizer, the
torch varlen attention backend, activation offloading) inside a world whose default process group
follows NCCL's rules, and runs our code path; any device mismatch, CPU tensor in a collective or host
sync inside a layer raises.
"""

from __future__ import annotations

import numpy as np

WORLD = 2
VOCAB = 64
PP_TOKENS = 12
"""Tokens of every micro-batch of the PP=2 scenario (one length: see `_peer_stage_sends_shape`)."""


def _peer_stage_sends_shape(shape: tuple[int, int, int]) -> None:
    """Megatron's variable-length pipeline first exchanges activation shapes (3 int64 values); in a
    one-process world no value arrives, so the harness supplies the one shape the other stage would send
    (every micro-batch of the scenario has `PP_TOKENS` tokens). The exchange itself still goes through
    the NCCL-rules group."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    original = p2p.P2PCommunicator._communicate_shapes

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        return list(shape), list(shape)

    p2p.P2PCommunicator._communicate_shapes = communicate_shapes


def _read_tokens(seq: int, start: int, end: int) -> np.ndarray:
    return (np.arange(start, end, dtype=np.int64) * 7 + seq) % VOCAB



def hdp_step(pp_size: str = "1", rank: str = "0") -> None:
    """Two HDP steps (collate -> forward -> backward -> finalize -> optimizer -> stats) of a tiny bf16
    GPTModel with the HDP spec, torch varlen attention and offloading, as HDP rank `rank` of 2 (PP=1:
    a ring between both ranks plus whole documents) or as PP stage `rank` of 2 (PP=2)."""
    import torch
    import fake_gpu

    pp, me = int(pp_size), int(rank)
    mode = fake_gpu.install(world_size=WORLD, rank=me)
    from megatron_hdp.megatron.hand_plan import plan_from_rings
    from megatron_hdp.megatron.initialize import initialize_hdp
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_hdp.megatron.model import build_gpt, tiny_llama_config
    from megatron_hdp.megatron.step import HDPTrainer
    from megatron_hdp.offload import ActivationOffloader

    state = initialize_hdp(pipeline_model_parallel_size=pp)
    if pp > 1:
        _peer_stage_sends_shape((PP_TOKENS, 1, 64))
    config = tiny_llama_config(num_layers=4)
    config.bf16, config.params_dtype, config.pipeline_dtype = True, torch.bfloat16, torch.bfloat16
    config.use_cpu_initialization = False
    with torch.device("cuda"):  # Megatron's own layers init on the GPU; torch's norms need the default device
        model = build_gpt(config, vocab_size=VOCAB, max_sequence_length=64)
    assert next(model.parameters()).device.type == "cuda", "the model must be built on the (fake) GPU"
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0), [ddp])
    offloader = ActivationOffloader(layers=list(model.decoder.layers))
    trainer = HDPTrainer(model=ddp, optimizer=optimizer, state=state, backend="torch_varlen", offloader=offloader)
    if pp == 1:  # a ring over both HDP ranks, whole documents on each, offloading on the ring's sequence
        plan = plan_from_rings(
            [24, 10, 8], [(0, 1), (0,), (1,)], [0, 1, 0], num_ranks=2, capacity=32, offload_ratios=[0.5, 0, 0]
        )
    else:
        plan = plan_from_rings([PP_TOKENS] * 2, [(0,), (0,)], [0, 1], num_ranks=1, capacity=16, pp_size=2)
    trainer.step(plan, _read_tokens)  # the first step builds the ring plans (cached for equal lengths)
    mode.h2d.clear()
    stats = trainer.step(plan, _read_tokens)
    assert len(stats.compute_times) == WORLD  # values are placeholders: fake tensors hold none
    pageable = [c for c in mode.h2d if c["layer"] and not (c["pinned"] and c["non_blocking"])]
    assert not pageable, f"blocking host-to-device copies inside layers (one per layer per micro-batch): {pageable[:3]}"
    batch_copies = [c for c in mode.h2d if "collate.py" in c["where"]]
    assert batch_copies and all(c["pinned"] and c["non_blocking"] for c in batch_copies), batch_copies
    print(f"host-to-device copies of the step: {len(batch_copies)} of micro-batch tensors (pinned, non-blocking), "
          f"{len(mode.h2d) - len(batch_copies)} others; host syncs outside layers: {len(mode.host_syncs)}")


def first_p2p(world_size: str = "4") -> None:
    """initialize_hdp on a world of 4, then a ring among ranks 0 and 1 (its first NCCL operation on the
    default group must not be the ring's P2P)."""
    import torch
    import fake_gpu

    fake_gpu.install(world_size=int(world_size), rank=0)
    from megatron_hdp.attention import ring_attention
    from megatron_hdp.megatron.initialize import initialize_hdp

    initialize_hdp()
    q = torch.randn(6, 2, 16, device="cuda", dtype=torch.bfloat16)
    ring_attention(q, q, q, seqlens=[12], ring=[0, 1], backend="torch_varlen")


def harness_rules() -> None:
    """The harness itself: each rule it enforces raises where a GPU/NCCL run would fail."""
    import pytest
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    import fake_gpu

    fake_gpu.install(world_size=4, rank=0)
    host = torch.ones(3)
    with pytest.raises(fake_gpu.NcclRuleError, match="first operation"):
        dist.send(torch.ones(3, device="cuda"), dst=1)
    with pytest.raises(fake_gpu.NcclRuleError, match="on cpu"):
        dist.all_reduce(host)
    dist.all_reduce(host.to("cuda"))
    with pytest.raises(FakeTensorDeviceMismatchError):
        torch.ones(3, device="cuda") + host
    assert (host + 1).tolist() == [2.0, 2.0, 2.0], "host work stays real"
