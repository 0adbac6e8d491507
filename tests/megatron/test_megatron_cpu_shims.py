"""CPU shims: each patch does what it says, and Megatron's schedule + optimizer then run without CUDA."""

import torch

from megatron_hdp.comm.launch import run_gloo


def _check_shims(rank, world_size):
    from megatron.core.tensor_parallel.inference_layers import HAVE_TE
    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims

    def isinstance_over_mocks(module):  # Megatron-LM main's check without TE (0.19 has none)
        raise TypeError("isinstance() arg 2 must be a type, a tuple of types, or a union")

    mtp.is_inference_column_parallel_linear = isinstance_over_mocks
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer.moe import router

    from megatron_hdp.megatron.compat.versions import require_megatron_training

    require_megatron_training()
    from megatron.training import initialize  # imported Megatron's compiled swiglu under its own name

    compiled = (fused_bias_swiglu.swiglu, initialize.bias_swiglu, vars(router.TopKRouter)["_apply_expert_bias"])
    assert all(hasattr(function, "_torchdynamo_orig_callable") for function in compiled)
    assert apply_cpu_shims() and apply_cpu_shims()  # idempotent
    # patch 7: Megatron's fused functions are the plain ones they wrapped, wherever they are named, and so
    # are those of modules imported later; the values are the formula's
    assert (fused_bias_swiglu.swiglu, initialize.bias_swiglu, vars(router.TopKRouter)["_apply_expert_bias"]) == tuple(
        function._torchdynamo_orig_callable for function in compiled)
    from megatron.core.fusions import fused_weighted_squared_relu  # not loaded before the shims

    assert not hasattr(fused_weighted_squared_relu.weighted_squared_relu, "_torchdynamo_orig_callable")
    y = torch.linspace(-2.0, 2.0, 8).reshape(2, 4)
    torch.testing.assert_close(fused_bias_swiglu.bias_swiglu_impl(y, None), torch.nn.functional.silu(y[:, :2]) * y[:, 2:])
    # patch 6: without TE no module is TE's inference linear, so main's MTP layer can be built
    assert HAVE_TE or mtp.is_inference_column_parallel_linear(torch.nn.Linear(2, 2)) is False
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


def _resume_distributed_optimizer(rank, world_size, directory):
    """Two Adam steps with Megatron's distributed optimizer, a checkpoint in both formats (`torch_dist`:
    Megatron's dist_checkpointing with the sharding type `megatron.training` saves; `torch`: the state
    dict plus the parameter-state file), each loaded into a fresh model and optimizer (other initial
    weights), then one more step everywhere with the same gradient. Returns, per format, the names of the
    tensors (weights, Adam's moments and step) that differ from the uninterrupted optimizer's after it."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    ps.initialize_model_parallel(1, 1)

    class Tiny(MegatronModule):
        def __init__(self, start):
            super().__init__(TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1))
            self.w = torch.nn.Parameter(torch.arange(7.0) + start)
            self.b = torch.nn.Parameter(torch.arange(5.0) - start)
            self.c = torch.nn.Parameter(torch.arange(3.0) * start)  # DDP aligns each to 64: b, c on rank 0

    def build(start):
        tiny = Tiny(start)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
        model = DistributedDataParallel(tiny.config, ddp, tiny)
        config = OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.01, bf16=False, clip_grad=0.0,
                                 use_distributed_optimizer=True)
        return tiny, model, get_megatron_optimizer(config, [model])

    def step(tiny, model, optimizer, scale):
        for param in (tiny.w, tiny.b, tiny.c):  # the same gradient on every rank: DP-averaged, it stays this one
            param.main_grad.copy_(torch.linspace(-1.0, 1.0, param.numel()) * scale + torch.arange(param.numel()) * 0.1)
        model.finish_grad_sync()
        optimizer.step()

    def state(tiny, optimizer):
        inner = optimizer.chained_optimizers[0].optimizer
        tensors = {name: param.detach().clone() for name, param in tiny.named_parameters()}
        for index, param in enumerate(p for group in inner.param_groups for p in group["params"]):
            for key, value in inner.state[param].items():
                tensors[f"{index}.{key}"] = value.detach().clone().reshape(-1)
        return tensors

    tiny, model, optimizer = build(0.0)
    step(tiny, model, optimizer, 1.0)
    step(tiny, model, optimizer, -2.0)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    sharded = {"model": tiny.sharded_state_dict()}
    sharded["optimizer"] = optimizer.sharded_state_dict(sharded["model"], metadata=metadata)
    dist_checkpointing.save(sharded, f"{directory}/torch_dist")
    plain = {"model": tiny.state_dict(), "optimizer": optimizer.state_dict()}
    optimizer.save_parameter_state(f"{directory}/distrib_optim.pt")
    torch.distributed.barrier()

    resumed = {}
    for checkpoint in ("torch_dist", "torch"):
        tiny2, model2, optimizer2 = build(10.0)
        if checkpoint == "torch_dist":
            sharded = {"model": tiny2.sharded_state_dict()}
            sharded["optimizer"] = optimizer2.sharded_state_dict(sharded["model"], is_loading=True, metadata=metadata)
            loaded = dist_checkpointing.load(sharded, f"{directory}/torch_dist")
            tiny2.load_state_dict(loaded["model"])
            optimizer2.load_state_dict(loaded["optimizer"])
        else:
            tiny2.load_state_dict(plain["model"])
            optimizer2.load_state_dict(plain["optimizer"])
            optimizer2.load_parameter_state(f"{directory}/distrib_optim.pt")
        resumed[checkpoint] = (tiny2, model2, optimizer2)

    step(tiny, model, optimizer, 3.0)
    expected = state(tiny, optimizer)
    differences = {}
    for checkpoint, (tiny2, model2, optimizer2) in resumed.items():
        step(tiny2, model2, optimizer2, 3.0)
        got = state(tiny2, optimizer2)
        assert got.keys() == expected.keys(), (checkpoint, got.keys(), expected.keys())
        differences[checkpoint] = sorted(key for key in expected if not torch.equal(got[key], expected[key]))
    ps.destroy_model_parallel()
    return differences


def test_the_distributed_optimizer_resumes_exactly_from_both_checkpoint_formats(tmp_path):
    """Without patch 5 the `torch_dist` load stops at `assert len(steps) == 1` and the `torch` one at an
    in-place copy into a view of a leaf; without its step handling the resumed Adam steps from step 0
    (`torch_dist`) or stops at `KeyError: 'step'` (`torch`), or counts one step per parameter."""
    (tmp_path / "torch_dist").mkdir()
    for rank_differences in run_gloo(_resume_distributed_optimizer, 2, str(tmp_path), timeout_s=300):
        assert rank_differences == {"torch_dist": [], "torch": []}
