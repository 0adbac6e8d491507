"""Scenarios the fake-GPU harness runs, each in a process of its own (`tests/fake_gpu.py`,
`tests/fake_gpu_server.py`).

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



def _run_hdp_steps(pp: int, me: int, *, fp8_recipe: str = "", tp_only_amax_red: bool = False, mtp_depth: int = 0,
                   attention: str = ""):
    """Two HDP steps (collate -> forward -> backward -> finalize -> optimizer -> stats) of a tiny bf16
    GPTModel with the HDP spec, torch varlen attention and offloading, as HDP rank `me` of 2 (PP=1: a
    ring between both ranks plus whole documents; rank 0 runs two micro-batches, rank 1 one) or as PP
    stage `me` of 2 (PP=2). `fp8_recipe` turns on Megatron's FP8 (TE's collectives stood in for by
    `fake_te_fp8`); `mtp_depth` Megatron's multi-token prediction (its layers on the same rings, its
    rolls answered from the micro-batch); `attention` "mla": DeepSeek-style multi-latent attention with
    YaRN (`tiny_mla_fields`), a learnable sink and core-attention recompute, the ring a K/V ring in the
    first step and a latent ring in the second, "sinks": gpt-oss's learnable attention sinks. Returns the harness's `HostAndDevice` mode with the
    second step's copies."""
    import torch
    import fake_gpu

    mode = fake_gpu.install(world_size=WORLD, rank=me)
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_hdp.harness.model import tiny_llama_config, tiny_mla_fields
    from megatron_hdp.megatron.core_api.model import build_gpt
    from megatron_hdp.megatron.core_api.step import HDPTrainer
    from megatron_hdp.offload import ActivationOffloader

    state = initialize_hdp(pipeline_model_parallel_size=pp)
    if pp > 1:
        _peer_stage_sends_shape((PP_TOKENS, 1, 64))
    mla = {**tiny_mla_fields(), "softmax_type": "learnable", "recompute_granularity": "selective",
           "recompute_modules": ["core_attn"]}
    variant = {"": {}, "mla": mla, "sinks": dict(softmax_type="learnable")}[attention]
    config = tiny_llama_config(num_layers=4, **variant)
    config.bf16, config.params_dtype, config.pipeline_dtype = True, torch.bfloat16, torch.bfloat16
    config.use_cpu_initialization, config.mtp_num_layers = False, mtp_depth or None
    if fp8_recipe:
        import fake_te_fp8

        fake_te_fp8.install()
        config.fp8, config.fp8_recipe, config.tp_only_amax_red = "hybrid", fp8_recipe, tp_only_amax_red
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
    if attention == "mla" and pp == 1:  # the second step runs the ring as multi-latent attention's latent ring
        import dataclasses

        latent = dataclasses.replace(plan.sequences[0], ring_kind="latent")
        plan = dataclasses.replace(plan, sequences=(latent, *plan.sequences[1:])).validate()
    stats = trainer.step(plan, _read_tokens)
    assert len(stats.compute_times) == WORLD  # values are placeholders: fake tensors hold none
    return mode



def _assert_no_pageable_copies_in_layers(mode) -> None:
    """No host-to-device copy inside a transformer layer unless pinned and non-blocking (a pageable or
    blocking one syncs the host with the GPU in the middle of a layer)."""
    pageable = [c for c in mode.h2d if c["layer"] and not (c["pinned"] and c["non_blocking"])]
    assert not pageable, ("blocking host-to-device copies inside layers: "
                          f"{[(c['where'], c['bytes']) for c in pageable[:3]]}")


def _assert_no_blocking_transfer_copies(mode) -> None:
    """No blocking host-to-device copy between a micro-batch's transfer and its backward."""
    import fake_gpu

    blocking = fake_gpu.blocking_copies_in_microbatches(mode)
    assert not blocking, (f"{len(blocking)} blocking host-to-device copies between a micro-batch's transfer and "
                          f"its backward: {[(c['where'], c['bytes']) for c in blocking[:4]]}")

def hdp_step(pp_size: str = "1", rank: str = "0", mtp_depth: str = "0", attention: str = "") -> None:
    """`_run_hdp_steps` as global rank `rank` of 2 (with `attention` "mla" or "sinks"), then the step's
    host-to-device copies checked."""
    import fake_gpu

    mode = _run_hdp_steps(int(pp_size), int(rank), mtp_depth=int(mtp_depth), attention=attention)
    if int(mtp_depth):
        from megatron.core.transformer import multi_token_prediction

        rolls = multi_token_prediction.roll_tensor
        assert hasattr(rolls, "_hdp_original"), "the MTP block rolled with Megatron's own roll_tensor"
        print(f"multi-token prediction of depth {mtp_depth}: rolls answered from the micro-batches")
    _assert_no_pageable_copies_in_layers(mode)
    batch_copies = [c for c in mode.h2d if "collate.py" in c["where"]]
    assert batch_copies and all(c["pinned"] and c["non_blocking"] for c in batch_copies), batch_copies
    _assert_no_blocking_transfer_copies(mode)
    megatrons = fake_gpu.blocking_copies_in_microbatches(mode, code="/megatron/core/")  # e.g. PP shapes
    print(f"blocking copies in micro-batches: none of ours, {len(megatrons)} of Megatron's")
    print(f"host-to-device copies of the step: {len(batch_copies)} of micro-batch tensors (pinned, non-blocking), "
          f"{len(mode.h2d) - len(batch_copies)} others; host syncs outside layers: {len(mode.host_syncs)}")


def hdp_step_vpp(rank: str = "0") -> None:
    """Two HDP steps as PP stage `rank` of 2 with 2 virtual pipeline stages (Megatron's interleaved
    schedule, overlapped stage-to-stage P2P): a bf16 GPTModel of 4 layers built as 2 chunks per stage on
    "cuda", each chunk in its own DDP with its own offloader, one optimizer, HDPTrainer over the chunks.
    4 micro-batches of PP_TOKENS tokens (the one shape the harness answers stage-to-stage exchanges with)."""
    import torch
    import fake_gpu

    mode = fake_gpu.install(world_size=WORLD, rank=int(rank))
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt_chunks, wrap_chunks_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer
    from megatron_hdp.offload import ActivationOffloader

    state = initialize_hdp(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    _peer_stage_sends_shape((PP_TOKENS, 1, 64))
    config = tiny_llama_config(num_layers=8)
    config.bf16, config.params_dtype, config.pipeline_dtype = True, torch.bfloat16, torch.bfloat16
    config.use_cpu_initialization = False
    with torch.device("cuda"):
        chunks = build_gpt_chunks(config, vocab_size=VOCAB, max_sequence_length=64)
    assert len(chunks) == 2 and all(next(c.parameters()).device.type == "cuda" for c in chunks)
    ddps, optimizer = wrap_chunks_for_training(chunks, bf16=True)
    offloaders = [ActivationOffloader(layers=list(c.decoder.layers)) for c in chunks]
    trainer = HDPTrainer(model=ddps, optimizer=optimizer, state=state, backend="torch_varlen", offloader=offloaders)
    plan = plan_from_rings([PP_TOKENS] * 4, [(0,)] * 4, [0, 1, 2, 3], num_ranks=1, capacity=16, pp_size=2, vpp_size=2,
                           offload_ratios=[0.5, 0.0, 0.5, 0.0])
    trainer.step(plan, _read_tokens)
    mode.h2d.clear()
    stats = trainer.step(plan, _read_tokens)
    assert stats.offload.num_microbatches == 8, "each chunk's offloader saw each micro-batch"
    _assert_no_pageable_copies_in_layers(mode)
    batch_copies = [c for c in mode.h2d if "collate.py" in c["where"]]
    assert batch_copies and all(c["pinned"] and c["non_blocking"] for c in batch_copies), batch_copies
    print(f"virtual pipeline: {len(batch_copies)} micro-batch copies (pinned, non-blocking) over 2 chunks")


def fp8_collectives(rank: str, recipe: str, tp_only_amax_red: str, log_path: str) -> None:
    """`_run_hdp_steps` at PP=1 with FP8 `recipe` as HDP rank `rank` of 2 (rank 0 runs two micro-batches,
    rank 1 one); writes this rank's per-communicator collective log, or the refusal, as JSON."""
    import json

    import fake_gpu

    try:
        _run_hdp_steps(1, int(rank), fp8_recipe=recipe, tp_only_amax_red=tp_only_amax_red == "1")
    except ValueError as err:
        result = {"refused": str(err)}
    else:
        result = {"log": fake_gpu.collective_log()}
    with open(log_path, "w") as out:
        json.dump(result, out, indent=1)


WINDOW = 12
"""Sliding window of the `window_ring` scenario: 1.5 zigzag chunks of its 64-token document on 4 ranks."""
WINDOW_WORLD = 4
WINDOW_PLAN = dict(
    lengths=[64, 40, 11, 9, 13, 7],
    rings=[(0, 1, 2, 3), (2, 0, 1), (0,), (3,), (3,), (1,)],
    slots=[0, 0, 0, 0, 1, 1],
)
"""A ring over all 4 ranks (one document of 64 tokens: 8 zigzag chunks of 8, each query sees the 12
keys before it, so position 0 (chunks 0, 7) needs the K/V of positions 1 and 2 but not 3, position 3
(chunks 3, 4) those of 1 and 2 but not 0, positions 1 and 2 all three), a ring over 3 of them in
another order, whole documents, and ranks with 1 or 2 micro-batches."""


def window_ring(rank: str, log_path: str) -> None:
    """Two HDP steps of a bf16 GPTModel with gpt-oss's attention: a learnable sink on every layer
    (`softmax_type="learnable"`: Megatron's `softmax_offset` parameter, applied after each ring's merge, its
    gradient reduced by DDP) and a causal sliding window on its first layer (Megatron's
    `window_size=(WINDOW, 0)`, `window_attn_skip_freq=2`: layer 2 is full causal, so both the direct
    windowed ring and the neighbour relay run in every step), attention backend "auto" (whole documents
    and aligned ring pieces on torch varlen, ring pieces at offsets on flex), as HDP rank `rank` of
    `WINDOW_WORLD` of `WINDOW_PLAN`. Checks this rank's host-to-device copies over both steps (a ring
    plan, or a kernel's table, first made inside a layer shows up in the first) and writes its P2P and
    collective logs as JSON for the test to match across ranks (`fake_gpu.p2p_problems`)."""
    import dataclasses
    import json

    import torch
    import fake_gpu

    me = int(rank)
    mode = fake_gpu.install(world_size=WINDOW_WORLD, rank=me)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.megatron.core_api.step import HDPTrainer
    from megatron_hdp.plan.hand_plan import plan_from_rings

    state = initialize_hdp()
    config = dataclasses.replace(
        tiny_llama_config(num_layers=2), window_size=(WINDOW, 0), window_attn_skip_freq=2, softmax_type="learnable",
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=False,
    )
    with torch.device("cuda"):
        model = build_gpt(config, vocab_size=VOCAB, max_sequence_length=64)
    sinks = [p for name, p in model.named_parameters() if name.endswith("core_attention.softmax_offset")]
    assert len(sinks) == 2 and all(p.device.type == "cuda" for p in sinks), "a sink parameter per layer, on the GPU"
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0), [ddp])
    trainer = HDPTrainer(model=ddp, optimizer=optimizer, state=state, backend="auto")
    plan = plan_from_rings(**WINDOW_PLAN, num_ranks=WINDOW_WORLD, capacity=48)
    for _ in range(2):
        trainer.step(plan, _read_tokens)
    assert mode.backward_ops, "the backward ran on autograd's device thread"
    _assert_no_pageable_copies_in_layers(mode)
    _assert_no_blocking_transfer_copies(mode)
    with open(log_path, "w") as out:
        json.dump({"p2p": fake_gpu.p2p_log(), "collectives": fake_gpu.collective_log()}, out)
    print(f"windowed rings: {sum(map(len, fake_gpu.p2p_log().values()))} P2P group calls")


def first_p2p(world_size: str = "4") -> None:
    """initialize_hdp on a world of 4, then a ring among ranks 0 and 1 (its first NCCL operation on the
    default group must not be the ring's P2P)."""
    import torch
    import fake_gpu

    fake_gpu.install(world_size=int(world_size), rank=0)
    from megatron_hdp.attention import ring_attention
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp

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


def host_sync_rule() -> None:
    """The host-sync rule fires: `.item()` on a CUDA tensor inside a transformer layer's forward (a
    Megatron `TransformerLayer`, as the harness's hooks recognise it) and inside a backward raises
    `HostSyncInLayer`; the same call outside a layer returns a placeholder and is recorded. So does a
    copy to the host (`.cpu()`): inside a layer it raises, outside it gives a host tensor of zeros."""
    import pytest
    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import fake_gpu

    mode = fake_gpu.install(world_size=1, rank=0)

    class SyncingLayer(TransformerLayer):
        """A TransformerLayer whose forward reads a value back to the host (Megatron's own init skipped:
        only its class matters to the rule)."""

        __call__ = torch.nn.Module.__call__  # (MegatronModule's reads the config we skipped)

        def __init__(self) -> None:
            torch.nn.Module.__init__(self)

        def forward(self, hidden):
            if hidden.sum().item() > 0:  # a host sync: the CPU waits for the GPU in every layer
                return hidden * 2
            return hidden

    class SyncInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            grad.abs().max().item()  # e.g. a clipping norm read on the host in the middle of the backward
            return grad

    x = torch.ones(4, device="cuda", requires_grad=True)
    with pytest.raises(fake_gpu.HostSyncInLayer, match="inside a layer at forward"):
        SyncingLayer()(x)
    fake_gpu._LAYER_DEPTH[0] = 0  # the raise skipped the layer's exit hook (a real run stops here)
    with pytest.raises(RuntimeError, match="inside a layer at backward"):  # raised on the autograd thread
        SyncInBackward.apply(x).sum().backward()
    assert x.sum().item() == 0.0 and mode.host_syncs, "outside a layer: a placeholder, recorded"
    fake_gpu._LAYER_DEPTH[0] += 1  # a copy to the host is a host sync too
    with pytest.raises(fake_gpu.HostSyncInLayer, match="inside a layer at forward"):
        x.detach().cpu()
    fake_gpu._LAYER_DEPTH[0] -= 1
    assert x.detach().cpu().tolist() == [0.0] * 4, "outside a layer: a host tensor of placeholders"


INSTALL_ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 128 --max-position-embeddings 64 --seq-length 64 --micro-batch-size 1 "
    "--global-batch-size 6 --train-iters 2 --lr 1e-3 --bf16 --tokenizer-type NullTokenizer --vocab-size 64 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--transformer-impl local --calculate-per-token-loss --attention-dropout 0.0 --num-workers 0 --seed 1234 "
    "--hdp --hdp-capacity 32 --hdp-offload --hdp-offload-min-tensor-bytes 0 --hdp-attention-backend torch_varlen"
).split()
INSTALL_DOCUMENTS = [50, 9, 12, 20, 45, 8, 16, 30, 11, 40, 7, 14]
"""Document lengths (tokens) of the indexed dataset of `install_step`: the longer ones exceed
--hdp-capacity 32 and go to rings over both HDP ranks."""


def install_step(rank: str = "0") -> None:
    """The per-step code `megatron_hdp.megatron.install()` wires into megatron.training, called as
    megatron.training 0.19 calls it, as HDP rank `rank` of 2: the patched `build_pretraining_data_loader`
    (HDPDataLoader over a real indexed dataset), `setup_model_and_optimizer` (RoPE into the HDP core
    attention, the offloader), two training steps through `get_forward_backward_func()` (HDP's wrapper
    around Megatron's schedule, with the finalize/telemetry it measures) and the optimizer, then
    `training_log` (hdp_statistics, the telemetry gather over the HDP domain) and
    `consume_seqlen_stats_in_iteration`. Megatron's own model/optimizer setup and log line are stood in
    for (their originals run Megatron's full initialisation); each wrapper around them is the real one."""
    import tempfile

    import torch
    import fake_gpu

    me = int(rank)
    mode = fake_gpu.install(world_size=WORLD, rank=me)
    from megatron_hdp.megatron.compat.versions import require_megatron_training

    require_megatron_training()
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches, init_num_microbatches_calculator
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training import training
    from megatron.training.global_vars import set_args

    from megatron_hdp.megatron.pretrain import install as training_install
    from megatron_hdp.megatron.pretrain import runtime as hdp_runtime
    from megatron_hdp.megatron.pretrain import wrappers
    from megatron_hdp.megatron.pretrain.args import parse_and_check
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt

    args, _ = parse_and_check(INSTALL_ARGS, world_size=WORLD)
    set_args(args)
    init_num_microbatches_calculator(me, None, args.global_batch_size, args.micro_batch_size, WORLD)
    initialize_hdp()
    training_install.install(args)
    runtime = hdp_runtime.installed()

    prefix = tempfile.mkdtemp() + "/docs"
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for seq, length in enumerate(INSTALL_DOCUMENTS):
        builder.add_document(torch.from_numpy(_read_tokens(seq, 0, length).astype(np.int32)), [length])
    builder.finalize(prefix + ".idx")
    loader = training.build_pretraining_data_loader(prefix, 0)

    config = tiny_llama_config(num_layers=args.num_layers)
    config.bf16, config.params_dtype, config.pipeline_dtype = True, torch.bfloat16, torch.bfloat16
    config.use_cpu_initialization, config.calculate_per_token_loss = False, True
    with torch.device("cuda"):
        model = build_gpt(config, vocab_size=VOCAB, max_sequence_length=args.seq_length)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0), [ddp])
    built = lambda *a, **k: ([ddp], optimizer, None)  # noqa: E731  (Megatron's get_model + optimizer, done above)
    chunks, optimizer, _ = wrappers.wrap_setup_model_and_optimizer(built, runtime)()
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, ddp.no_sync  # as train() sets them
    config.grad_scale_func = optimizer.scale_loss
    assert runtime.offloaders, "--hdp-offload attaches an offloader"
    assert runtime.offloaders[0].config.min_tensor_bytes == 0, "--hdp-offload-min-tensor-bytes reaches it"

    data_iterator = iter(loader)
    logged = []
    for iteration in range(2):
        args.curr_iteration = iteration
        if iteration == 1:
            mode.h2d.clear()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        training.get_forward_backward_func()(  # train_step's call (megatron/training/training.py 0.19)
            forward_step_func=None, data_iterator=data_iterator, model=chunks,
            num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length, forward_only=False,
        )
        optimizer.step()
        training.consume_seqlen_stats_in_iteration()
        wrappers.wrap_training_log(lambda: logged.append(iteration), runtime)()  # Megatron's log line: stood in for
    loader.close()
    assert logged == [0, 1], logged
    assert runtime.telemetry.use_cuda, "the telemetry clocks the step with CUDA events"
    stats = runtime.statistics()
    assert stats["hdp/microbatches-this-rank"] >= 1 and stats["hdp/offload-GB"] >= 0, stats
    _assert_no_pageable_copies_in_layers(mode)
    batch_copies = [c for c in mode.h2d if "collate.py" in c["where"]]
    assert batch_copies and all(c["pinned"] and c["non_blocking"] for c in batch_copies), (
        f"micro-batches copied to the GPU from pageable memory (a synchronous copy each): {batch_copies[:3]}")
    _assert_no_blocking_transfer_copies(mode)
    print(f"install() path: {len(batch_copies)} micro-batch copies (pinned, non-blocking); "
          f"hdp statistics {sorted(stats)[:3]}...")


def moe_routers(rank: str = "0") -> None:
    """The MoE routers of three layers (`DocumentAuxLossRouter`: per-document load-balancing loss and
    z-loss) over the micro-batches of a plan with a ring over both ranks and whole documents, forward and
    backward, as HDP rank `rank` of 2. Megatron's token dispatcher and experts are left out: they read
    their split sizes on the host by design, which fake tensors cannot answer. No blocking host-to-device
    copy between a micro-batch's transfer and its backward (the lengths, the z-loss mask)."""
    import torch
    import fake_gpu

    me = int(rank)
    mode = fake_gpu.install(world_size=WORLD, rank=me)
    from megatron_hdp.data.collate import collate_microbatch
    from megatron_hdp.megatron.core_api.forward_step import packed_seq_params
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.layers.moe_aux_loss import DocumentAuxLossRouter, remember_documents

    from megatron.core.process_groups_config import ProcessGroupCollection

    initialize_hdp()
    config = tiny_llama_config(num_layers=3, num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    with torch.device("cuda"):
        routers = [DocumentAuxLossRouter(config, pg_collection=groups) for _ in range(3)]
    for number, router in enumerate(routers, start=1):
        router.set_layer_number(number)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device="cuda"))  # as Megatron's schedule sets it
    plan = plan_from_rings([24, 10, 8], [(0, 1), (0,), (1,)], [0, 1, 0], num_ranks=2, capacity=32)
    for step in range(2):  # the second step reuses the ring plans the first one built
        mode.h2d.clear()
        for microbatch in plan.ranks[me].microbatches:
            host = collate_microbatch(plan, microbatch, _read_tokens, rank=me).pin_memory()
            batch = host.to("cuda", non_blocking=True)
            params = packed_seq_params(batch, hdp_global_ranks=(0, 1), host=host)
            remember_documents(None, (), {"packed_seq_params": params})
            hidden = torch.randn(host.num_tokens, config.hidden_size, device="cuda", requires_grad=True)
            fake_gpu._LAYER_DEPTH[0] += 1  # the routers run inside their transformer layers
            probs = [router(hidden)[0] for router in routers]
            fake_gpu._LAYER_DEPTH[0] -= 1
            torch.stack([p.sum() for p in probs]).sum().backward()
    assert mode.backward_ops, "the backward ran on autograd's device thread"
    _assert_no_pageable_copies_in_layers(mode)
    _assert_no_blocking_transfer_copies(mode)
    print(f"MoE routers: {len(mode.h2d)} host-to-device copies in the last step, none blocking")


from fake_gpu_posttrain import posttrain_door  # noqa: E402,F401  (the post-training door's scenario, its own module)
