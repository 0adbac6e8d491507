"""CPU shims: each patch does what it says, and Megatron's schedule + optimizer then run without CUDA."""

import torch

from megatron_hdp.comm.launch import run_gloo


def _check_shims(rank, world_size):
    from megatron_hdp.megatron.cpu_shims import apply_cpu_shims

    assert apply_cpu_shims() and apply_cpu_shims()  # idempotent
    # patch 1: CUDA devices become the CPU; type() names the CUDA type for Megatron's asserts
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.ones(3)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.to(0).device.type == "cpu"
    assert x.to(torch.float64).dtype == torch.float64
    assert x.type() == "torch.cuda.FloatTensor"
    # patch 2: torch.cuda bookkeeping is a no-op
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    # ...also inside autograd backward, where torch-function modes are off (Megatron's MoE all-to-all)
    class _NewEmptyInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g.new_empty(size=list(g.shape), device=torch.cuda.current_device()).fill_(3.0)

    leaf = torch.ones(2, requires_grad=True)
    _NewEmptyInBackward.apply(leaf).sum().backward()
    assert leaf.grad.tolist() == [3.0, 3.0]
    # patch 3: Megatron's seeding works and weights come from the default CPU generator
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    with get_cuda_rng_tracker().fork():
        torch.manual_seed(0)
        a = torch.randn(4)
    torch.manual_seed(0)
    assert torch.equal(a, torch.randn(4))
    # Megatron's fp32 optimizer with grad clipping runs a step on the CPU and clips like torch does
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
            self.w = torch.nn.Parameter(torch.ones(4))

    tiny = Tiny()
    model = DistributedDataParallel(tiny.config, DistributedDataParallelConfig(), tiny)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=1.0, bf16=False), [model])
    tiny.w.main_grad.fill_(2.0)  # DDP's grad buffer; norm 4 -> clipped to 1
    ok, grad_norm, _ = opt.step()
    ps.destroy_model_parallel()
    return ok, grad_norm, tiny.w.detach().tolist()


def test_cpu_shims_patch_and_megatron_optimizer_steps():
    ok, grad_norm, weights = run_gloo(_check_shims, 1, timeout_s=120)[0]
    assert ok and abs(grad_norm - 4.0) < 1e-6
    assert all(abs(w - (1.0 - 0.5)) < 1e-6 for w in weights)  # w - lr * g * (1 / 4)
