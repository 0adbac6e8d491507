"""Two HDP training steps of a tiny bf16 GPT on this rank's GPU, over NCCL: the selftest's training run.

    python -m megatron_hdp.harness.gpu_smoke                                   # one GPU
    torchrun --nproc-per-node N -m megatron_hdp.harness.gpu_smoke              # every local GPU

`megatron-hdp selftest` runs both. The model, its DDP and optimizer come from the integration layer
(`megatron_hdp.megatron.core_api.model`: only `megatron_hdp/megatron/` imports Megatron).
"""

import os

import numpy as np
import torch
import torch.distributed as dist

from megatron_hdp.harness.model import tiny_llama_config
from megatron_hdp.megatron.core_api.initialize import initialize_hdp
from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training
from megatron_hdp.megatron.core_api.step import HDPTrainer
from megatron_hdp.plan.hand_plan import plan_from_rings


def main() -> None:
    """Two HDP steps of a tiny bf16 GPT on this rank's GPU."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    state = initialize_hdp()
    config = tiny_llama_config(num_layers=2)  # bf16: the GPU attention kernels take fp16/bf16
    config.bf16, config.params_dtype, config.pipeline_dtype, config.use_cpu_initialization = (
        True, torch.bfloat16, torch.bfloat16, False)
    with torch.device("cuda"):
        model = build_gpt(config, vocab_size=256, max_sequence_length=4096)
    ddp, optimizer = wrap_for_training(model, lr=1e-4, weight_decay=0.01, bf16=True)
    trainer = HDPTrainer(model=ddp, optimizer=optimizer, state=state)
    rings = [tuple(range(world)), (0,)] if world > 1 else [(0,), (0,)]
    plan = plan_from_rings([2048, 512], rings, [0, 0], num_ranks=world, capacity=4096)
    for _ in range(2):
        stats = trainer.step(plan, lambda seq, a, b: (np.arange(a, b) * 31 + seq) % 256)
    if rank == 0:
        print(f"loss {stats.loss:.4f} step {stats.step_time:.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
