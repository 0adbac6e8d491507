"""`install(args)`: wire HDP into `megatron.training` (megatron-core 0.19.x, 0.20.x) after argument parsing.

Call it once, after `parse_and_validate_args` and before the model config is built from `args`
(`examples/pretrain_gpt_hdp.py` and the patched `pretrain_gpt.py` do). Without `--hdp` it only checks
the flags. With `--hdp` it changes ten names: `args.spec`, seven in `megatron.training.training`'s
namespace, one in `megatron.training.checkpointing`'s and one in `megatron.training.models.gpt`'s, each a
thin wrapper around Megatron's own function (the whole monkeypatch surface, in call order):

1. `args.spec`: the GPT layer spec is Megatron's with `HDPCoreAttention` as its `core_attention` leaf.
2. `setup_model_and_optimizer`: after Megatron builds (and DDP-wraps) the model, `prepare_model_for_hdp`
   moves RoPE into the HDP core attention of each chunk; with `--hdp-offload` an `ActivationOffloader`
   is attached to each chunk's transformer layers (one per virtual pipeline stage). (Not `get_model`: `pretrain` with a config container,
   as `examples/pretrain_gpt_hdp.py` calls it, builds through the model builder and never calls it.)
3. `build_train_valid_test_datasets`: the datasets provider runs with every rank building its
   datasets (`datasets_built_on_every_rank`; `pretrain_gpt.py` builds them on TP rank 0 of the first
   and last stages only, and every rank plans). `build_pretraining_data_loader`: the HDP loader (our sampler + planner + THD collation) over the same
   Megatron dataset; it yields one `HDPStep` per training step.
4. `get_forward_backward_func`: the schedule is called with this rank's micro-batches of the step,
   prepared by `data.prepare.prepare_step` exactly as the Core-API trainer prepares them (plan checked on
   every rank, padded to the count the step runs, pinned; with virtual pipeline stages each model chunk
   gets its own iterator over the same micro-batches), its own micro-batch count, and HDP's forward step
   (token-level loss; Megatron's `calculate_per_token_loss` divides by the global batch's token count,
   summed over the HDP domain; each micro-batch offloads the ratio it carries from its plan); it also
   keeps `args.consumed_train_samples` equal to the documents the loader consumed.
5. `training_log`: HDP statistics (balance, rings, ring-attention bytes, micro-batch counts, loader
   wait, offloaded bytes) and the measured telemetry of `comm/telemetry.py` in Megatron's log line and its
   TensorBoard / W&B writers, every `--hdp-log-interval` steps; with --hdp-online-refit the measured
   steps refit the cost model the loaders plan with (`HDPRuntime.learn`); with MTP, Megatron's MTP loss
   log is the token-level mean over the global batch (`mtp.log_token_level_mtp_loss`).
6. `consume_seqlen_stats_in_iteration`: the plan's real tokens and sum of s^2 for Megatron's FLOPs.
7. `save_checkpoint`: with --hdp-online-refit, the learned cost model is written next to each checkpoint.
8. `checkpointing._load_base_checkpoint` (`resume_check`): a resume may change the pool's size, not TP,
   PP, EP or the documents' lengths (`data/resume.py`).
9. `megatron.training.models.gpt.mtp_block_spec` (with --mtp-num-layers): the MTP block is built from the
   HDP layer spec (Megatron builds it from its stock specs whatever --spec says), so its layers attend
   with HDP's core attention; their rolls come from the loader (`megatron/mtp.py`).

With PP > 1 it also sets `args.variable_seq_lengths` before the model config is built from `args`
(`_pipeline_shapes_per_microbatch`): the tensors between stages take each micro-batch's length.

What the wrappers share (config, loaders, offloaders, telemetry, the current cost model and its online
refit) is one `HDPRuntime`, built by install() and closed over by each wrapper; the patch table in
`megatron.training.training` is the only process-wide state (`installed()` reads the runtime from it).

Anything else Megatron does (optimizer, DDP gradient reduction over the data-parallel group = the HDP
domain, checkpoints, LR schedule) is unchanged; an HDP model's checkpoint has plain Megatron's keys.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatron_hdp.comm.telemetry import (
    PER_RANK_FIELDS, StepTelemetry, collective_device, console_line, gather_rows, plan_seqlen_stats, summarize,
    write_stats,
)
from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader, HDPStep
from megatron_hdp.data.resume import truncation_change
from megatron_hdp.megatron.args import ring_kind_setting, token_multiple, validate_hdp_args
from megatron_hdp.megatron.resume_check import wrap_load_base_checkpoint
from megatron_hdp.megatron.training_compat import check_megatron_version, require_megatron_training
from megatron_hdp.offload import ActivationOffloader, OffloadConfig, OffloadStats
from megatron_hdp.plan.cost_model import CostModel
from megatron_hdp.plan.online_refit import OnlineRefit
from megatron_hdp.plan.presets import ModelShape
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass
class HDPRuntime:
    """What install() set up for this process, built once by it; the patch wrappers close over it."""

    config: HDPConfig
    cost_model: CostModel
    """The cost model the loaders plan the next steps with (they read it through `current_cost_model`);
    with --hdp-online-refit, `learn` replaces it by the refit's."""
    telemetry: StepTelemetry
    """Measures this rank's training steps."""
    offload_config: Optional[OffloadConfig] = None
    """What the --hdp-offload offloaders move (None: their defaults)."""
    refit: Optional[OnlineRefit] = None
    """Learns the cost model from the measured steps (--hdp-online-refit), else None."""
    loaders: list[HDPDataLoader] = field(default_factory=list)
    offloaders: list[ActivationOffloader] = field(default_factory=list)
    """Each model chunk's ActivationOffloader (--hdp-offload), built by the setup_model_and_optimizer wrapper."""
    last_step: Optional[HDPStep] = None
    last_offload: Optional[OffloadStats] = None
    """OffloadStats of the last training step on this rank."""
    plans: dict[int, StepPlan] = field(default_factory=dict)
    """Plans of measured steps the refit has not seen yet, by iteration."""
    checkpoint_args: Any = None
    """The saved arguments of the checkpoint --load read (None: none), for the loader's resume check."""

    def current_cost_model(self) -> CostModel:
        """The cost model to plan the next step with (what the loaders call)."""
        return self.cost_model

    def learn(self, measured: list[tuple[int, torch.Tensor]]) -> None:
        """Online refit: feed each measured step's per-rank compute and its plan to the refit, plan the next
        steps with its model, and log the model's coefficients. With TP or PP the step's compute is first
        averaged over the model-parallel group, so every rank of the job learns the same model and keeps
        planning the same steps."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        assert self.refit is not None
        group = parallel_state.get_model_parallel_group()
        size = dist.get_world_size(group)
        for iteration, table in measured:
            compute = table[:, PER_RANK_FIELDS.index("compute")].double()
            if size > 1:
                compute = compute.to(collective_device(group))
                dist.all_reduce(compute, group=group)
                compute = compute.cpu() / size
            self.cost_model = self.refit.observe(self.plans.pop(iteration), compute.tolist())
        coefficients = {f"hdp/cost-model/{name}": getattr(self.cost_model, name) for name in ("a1", "b1", "g")}
        write_stats(get_args().curr_iteration + 1, coefficients, writer=get_tensorboard_writer(),
                    wandb_writer=get_wandb_writer())

    def statistics(self) -> dict[str, float]:
        """Statistics of the last HDP step on this rank (empty before the first step)."""
        step = self.last_step
        if step is None:
            return {}
        summary = step.plan.summary(self.cost_model)
        stats = {
            "hdp/balance": float(summary.balance),
            "hdp/rings": float(summary.num_rings),
            "hdp/latent-rings": float(summary.latent_rings),
            "hdp/ring-attention-GB": summary.attention_bytes / 1e9,
            "hdp/microbatches-max": float(summary.max_microbatches),
            "hdp/microbatches-min": float(summary.min_microbatches),
            "hdp/microbatches-this-rank": float(len(step.microbatches)),
            "hdp/tokens": float(summary.num_tokens),
            "hdp/sequences": float(summary.num_sequences),
            "hdp/est-step-time-s": float(summary.est_step_time),
            "hdp/plan-s": float(step.plan_seconds),
            "hdp/loader-wait-s": float(sum(loader.wait_seconds for loader in self.loaders)),
        }
        if self.last_offload is not None:  # this rank's activation offloading (--hdp-offload)
            stats.update({
                "hdp/offload-GB": self.last_offload.bytes_offloaded / 1e9,
                "hdp/prefetch-GB": self.last_offload.bytes_prefetched / 1e9,
                "hdp/offload-exposed-s": float(self.last_offload.exposed_wait_s),
            })
        return stats


def hdp_layer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """`--spec` target: the GPT layer spec Megatron-LM builds for `config` (a GPTModelConfig) with HDP's
    attention: for `--num-experts` its decoder block spec (dense and MoE layers by --moe-layer-freq)."""
    from megatron_hdp.megatron.layer_spec import get_gpt_decoder_block_with_hdp_spec, get_gpt_layer_with_hdp_spec

    transformer = config.transformer
    te = transformer.transformer_impl == "transformer_engine"
    if transformer.num_moe_experts:
        return get_gpt_decoder_block_with_hdp_spec(transformer, use_transformer_engine=te, vp_stage=vp_stage)
    common = dict(qk_layernorm=transformer.qk_layernorm, multi_latent_attention=transformer.multi_latent_attention)
    if te:
        return get_gpt_layer_with_hdp_spec(backend="transformer_engine", **common)
    return get_gpt_layer_with_hdp_spec(backend="local", normalization=transformer.normalization, **common)


def _cost_model(args: Namespace, config: HDPConfig) -> CostModel:
    """The planner's cost model of this run's mesh (`plan.mesh_cost.mesh_cost_model`, the one builder):
    the model's shape on the named or detected hardware (`_hardware`), or --hdp-cost-model completed from
    it, with this run's TP, EP and expert TP (the HDP ranks an MoE all-to-all couples: the groups Megatron
    will build, checked against them when the data loader is built, `_build_data_loader`), ranks per node
    (--hdp-ranks-per-node, else the hardware's NVLink domain / TP), recompute and ring kind
    (`args.ring_kind_setting`)."""
    from megatron_hdp.plan.mesh_cost import mesh_cost_model

    return mesh_cost_model(
        model=_model_shape(args), hardware=_hardware(config), tp_size=args.tensor_model_parallel_size,
        ep_size=args.expert_model_parallel_size, etp_size=getattr(args, "expert_tensor_parallel_size", None),
        ranks_per_node=config.hdp_ranks_per_node, ring_kind=ring_kind_setting(args, config),
        recompute_granularity=getattr(args, "recompute_granularity", None) or "none", measured=config.hdp_cost_model,
    )


def _hardware(config: HDPConfig) -> Optional[str]:
    """--hdp-hardware, else the preset of this rank's CUDA device (`plan.mesh_cost.resolve_hardware`: a
    CPU run plans as an H100 or with --hdp-cost-model's figures alone, an unknown GPU is refused unless
    --hdp-cost-model measured it)."""
    from megatron_hdp.plan.mesh_cost import resolve_hardware

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return resolve_hardware(flag=config.hdp_hardware, device_name=device, measured=config.hdp_cost_model is not None)


def _dense_layers(args: Namespace) -> int:
    """Decoder layers whose MLP is dense under --moe-layer-freq (Megatron's rule: an int k makes layer i MoE
    when i % k == 0, a list marks MoE layers with 1); 0 without experts. The cost model needs only their
    number (it averages the MLP over the layers)."""
    if not args.num_experts:
        return 0
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return sum(1 for layer in range(args.num_layers) if layer % freq)
    return sum(1 for moe in freq if not moe)


def _model_shape(args: Namespace) -> ModelShape:
    """The model's shape from Megatron's flags (what the analytic cost model counts)."""
    return ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size or args.vocab_size or 32000,
        num_experts=args.num_experts or 0,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        num_dense_layers=_dense_layers(args),
        gated_mlp=args.swiglu or getattr(args, "quick_geglu", False),
        head_dim=args.kv_channels or 0,
        mtp_num_layers=args.mtp_num_layers or 0,
        **(_mla_shape(args) if getattr(args, "multi_latent_attention", False) else {}),
    )


def _mla_shape(args: Namespace) -> dict:
    """`ModelShape`'s multi-latent attention fields from Megatron's MLA flags (the latent ring's cost)."""
    return dict(kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim)


def _online_refit(args: Namespace, config: HDPConfig, cost_model: CostModel) -> OnlineRefit:
    """--hdp-online-refit: a refit of `cost_model` (this run's), which with --load resumes what the
    checkpoint's refit learned (its a1, b1, g; `plan.online_refit.load_refit`) and nothing else: ring kind,
    ranks per node, the expert unit and the rest stay this run's."""
    from megatron_hdp.plan.online_refit import RefitSettings, load_refit

    settings = RefitSettings(warmup_steps=config.hdp_refit_warmup_steps)
    resumed = load_refit(args.load, model=cost_model, settings=settings) if args.load else None
    return resumed or OnlineRefit(cost_model, settings)


# --- the wrappers (see the module docstring for what each replaces) ----------------------------------
def _setup_model_and_optimizer(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any):
        from megatron.core.utils import unwrap_model

        from megatron_hdp.megatron.layer_spec import prepare_model_for_hdp

        model, optimizer, scheduler = original(*args, **kwargs)
        for chunk in model:
            prepare_model_for_hdp(unwrap_model(chunk))
        chunk_layers = [unwrap_model(chunk).decoder.layers for chunk in model]  # one chunk per virtual stage
        if runtime.config.hdp_offload and all(len(layers) for layers in chunk_layers):
            runtime.offloaders = [ActivationOffloader(layers=layers, config=runtime.offload_config)
                                  for layers in chunk_layers]
        return model, optimizer, scheduler

    return setup_model_and_optimizer


@contextlib.contextmanager
def datasets_built_on_every_rank():
    """Within it, every BlendedMegatronDatasetBuilder builds its datasets on every rank.

    HDP plans from document lengths on every rank of the domain, every tensor-parallel rank and pipeline
    stage included (each stage needs the plan's lengths for its attention), but Megatron-LM's
    `pretrain_gpt.py` builds the datasets on tensor-parallel rank 0 of the first and last stages only
    (its `is_dataset_built_on_rank`) and hands the others None. Building costs a rank only the mmap'd
    index: tokens are read by the rank that trains them.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    original = BlendedMegatronDatasetBuilder.__init__

    @functools.wraps(original)
    def on_every_rank(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.is_built_on_rank = lambda: True

    BlendedMegatronDatasetBuilder.__init__ = on_every_rank
    try:
        yield
    finally:
        BlendedMegatronDatasetBuilder.__init__ = original


def _build_datasets(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def build_train_valid_test_datasets(*args: Any, **kwargs: Any):
        with datasets_built_on_every_rank():
            return original(*args, **kwargs)

    return build_train_valid_test_datasets


def _build_data_loader(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def build_pretraining_data_loader(dataset: Any, consumed_samples: int):
        from megatron.training import get_args

        from megatron_hdp.megatron.datasets import build_hdp_data_loader
        from megatron_hdp.megatron.initialize import hdp_state

        coupled = hdp_state().ep_size  # Megatron's groups, now built
        if coupled != runtime.cost_model.expert_parallel_size:
            raise ValueError(
                f"Megatron's expert-parallel groups couple {coupled} HDP ranks, but the planner was set up for "
                f"{runtime.cost_model.expert_parallel_size} from --expert-model-parallel-size and "
                "--expert-tensor-parallel-size: initialize Megatron with its default rank order"
            )
        loader = build_hdp_data_loader(dataset, consumed_samples, cost_model=runtime.current_cost_model,
                                       max_length=get_args().seq_length)
        if loader is not None:
            problem = truncation_change(loader, runtime.checkpoint_args)
            if problem:
                raise ValueError(problem)
            runtime.loaders.append(loader)
        return loader

    return build_pretraining_data_loader


def _account_consumed_samples(step: Any) -> None:
    """Make Megatron's `args.consumed_train_samples` equal the loader's count once this training step ends.

    Megatron's train() adds dp x micro-batch size x micro-batches (= --global-batch-size) to it right after
    each train_step (megatron/training/training.py 0.19: `args.consumed_train_samples +=
    iteration_sequences`), but an HDP step consumes `step.consumed_samples` - (previous count) documents:
    a token budget (--hdp-global-batch-tokens) or the short last batch of an epoch. Setting the counter
    here, before that increment, to the loader's count minus exactly what Megatron is about to add leaves
    it equal to `step.consumed_samples` after every step: the value Megatron logs, checkpoints and passes
    back to build_pretraining_data_loader on resume, so a resumed run continues with the same documents.
    The other way, patching the increment itself, would mean replacing train()'s whole loop. The
    increment is computed as Megatron's LR-scheduler step computes it (same file, train_step).
    """
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    args = get_args()
    dp = args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1)
    increment = get_num_microbatches() * args.micro_batch_size * dp
    args.consumed_train_samples = step.consumed_samples - increment


def _forward_backward(schedule: Callable, runtime: HDPRuntime) -> Callable:
    """Megatron's schedule, run on one HDP step: this rank's micro-batches (`data.prepare.prepare_step`, as
    the Core-API trainer prepares them), its own count, HDP's forward."""
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    from megatron_hdp.data.prepare import chunk_iterators, prepare_step
    from megatron_hdp.megatron.forward_step import make_forward_step
    from megatron_hdp.megatron.initialize import hdp_state
    from megatron_hdp.megatron.saved_plans import save_training_step_plan
    from megatron_hdp.megatron.step import step_group_size
    from megatron_hdp.offload.offloader import pop_offload_stats

    def forward_backward(*, forward_step_func, data_iterator, num_microbatches, **kwargs: Any):
        if isinstance(data_iterator, list):  # virtual pipeline stages: Megatron built one loader per chunk
            data_iterator = data_iterator[0]  # the others plan the same steps; never iterated, they never start
        if data_iterator is None:
            raise ValueError(
                "HDP needs its data loader on every rank, but this rank got none: the datasets provider "
                "returned no training dataset here (build it on every rank; install() makes Megatron's "
                "BlendedMegatronDatasetBuilder do so)"
            )
        step = next(data_iterator)
        training = not kwargs.get("forward_only", False)  # evaluation consumes validation documents
        if training:
            _account_consumed_samples(step)
            save_training_step_plan(step, runtime.config.hdp_save_plans)  # --hdp-save-plans (rank 0)
        state = hdp_state()
        chunks = kwargs["model"]
        config = get_model_config(chunks[0])
        microbatches = prepare_step(  # ValueError on every rank alike for a plan this domain cannot run
            step.plan, state=state, device=next(chunks[0].parameters()).device,
            pad_to_multiple=token_multiple(get_args()), group_size=step_group_size(step.plan, config),
            microbatches=step.microbatches, mtp_depth=config.mtp_num_layers or 0,
        )
        offloaders = runtime.offloaders if training else []
        runtime.last_step = step
        forward = make_forward_step(hdp_global_ranks=state.hdp_global_ranks, offloaders=offloaders,
                                    backend=runtime.config.hdp_attention_backend)
        measure = contextlib.nullcontext()
        if training:
            measure = runtime.telemetry.measure(get_args().curr_iteration + 1, model_config=config)
            if runtime.refit is not None:
                runtime.plans[get_args().curr_iteration + 1] = step.plan
        with measure as marks:
            result = schedule(
                forward_step_func=forward,
                data_iterator=chunk_iterators(microbatches, len(chunks)),
                num_microbatches=len(microbatches),
                **kwargs,
            )
            if offloaders:  # every backward of the step has run when the schedule returns
                runtime.last_offload = pop_offload_stats(offloaders)
                marks.offload_exposed = float(runtime.last_offload.exposed_wait_s)
        return result

    return forward_backward


def _get_forward_backward_func(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any):
        return _forward_backward(original(*args, **kwargs), runtime)

    return get_forward_backward_func


def installed() -> Optional[HDPRuntime]:
    """The runtime the installed wrappers close over (None before install() with --hdp), read from the
    patch table in `megatron.training.training`: the only place it is kept."""
    from megatron.training import training

    return getattr(training.get_forward_backward_func, "_hdp_runtime", None)


def hdp_statistics() -> dict[str, float]:
    """`HDPRuntime.statistics` of the installed runtime (empty before install() or the first step)."""
    runtime = installed()
    return runtime.statistics() if runtime is not None else {}


def log_telemetry(telemetry: StepTelemetry, iteration: int) -> list[tuple[int, torch.Tensor]]:
    """Gather, summarise and write the measured steps up to `iteration` (up to the one before on CUDA:
    its events are read one step late); return them as `gather_rows` does. Called on every rank at the
    same iterations (a collective)."""
    from megatron.core import parallel_state
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    from megatron.training.utils import print_rank_last

    lag = 1 if telemetry.use_cuda else 0
    rows = telemetry.read(iteration - lag)
    measured = gather_rows(rows, group=parallel_state.get_data_parallel_group())
    for step, table in measured:
        stats = summarize(table)
        write_stats(step, stats, writer=get_tensorboard_writer(), wandb_writer=get_wandb_writer())
        print_rank_last(console_line(step, stats))
    return measured


def _training_log(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any):
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        from megatron.training.utils import print_rank_last

        from megatron_hdp.megatron.mtp import log_token_level_mtp_loss

        log_token_level_mtp_loss()  # before Megatron's MTP log line reads the tracker
        result = original(*args, **kwargs)
        iteration = get_args().curr_iteration + 1
        stats = runtime.statistics()
        if stats and iteration % runtime.config.hdp_log_interval == 0:
            write_stats(iteration, stats, writer=get_tensorboard_writer(), wandb_writer=get_wandb_writer())
            line = " | ".join(f"{name[4:]}: {value:.4g}" for name, value in stats.items())
            print_rank_last(f" [HDP] iteration {iteration:8d} | {line}")
            measured = log_telemetry(runtime.telemetry, iteration)
            if runtime.refit is not None:
                runtime.learn(measured)
        return result

    return training_log


def _pipeline_shapes_per_microbatch(args: Namespace) -> None:
    """With PP > 1, let the tensors between pipeline stages take each micro-batch's own length.

    Megatron sizes them by --seq-length (`variable_seq_lengths`, which validate_args resets to False),
    but an HDP micro-batch holds the tokens its plan packs (at most --hdp-capacity, often fewer), so the
    receiving stage would get the wrong shape (a RoPE size mismatch, or gloo's "Received data size doesn't
    match"; on NCCL a hang or corrupted activations). With `variable_seq_lengths` each send is preceded by
    its 3-integer shape (`P2PCommunicator._communicate_shapes`), as in the Core-API path
    (`megatron_hdp.harness.model.tiny_llama_config`); benchmarks/pp_shapes_bench.py measures that against
    padding every micro-batch to the step's longest. The model config is built from `args` after
    install(), so setting the flag here reaches the schedule.

    TransformerConfig rejects `variable_seq_lengths` with the allgather MoE dispatcher, Megatron's default
    even for a dense model: a dense model gets `alltoall` (it has no dispatcher, the name is only checked);
    a MoE model with allgather is refused, naming the flag to change.
    """
    if args.pipeline_model_parallel_size == 1:
        return
    if args.moe_token_dispatcher_type == "allgather":
        if args.num_experts:
            raise ValueError(
                f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} with --hdp needs the tensors "
                "between stages sized per micro-batch (variable_seq_lengths), which Megatron's allgather MoE "
                "dispatcher does not support: use --moe-token-dispatcher-type alltoall"
            )
        args.moe_token_dispatcher_type = "alltoall"
    args.variable_seq_lengths = True


def _save_checkpoint(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any):
        """Megatron's checkpoint, plus the learned cost model next to it (--hdp-online-refit)."""
        import torch.distributed as dist
        from megatron.training import get_args

        from megatron_hdp.plan.online_refit import save_refit

        result = original(iteration, *args, **kwargs)
        if runtime.refit is not None and get_args().save and dist.get_rank() == 0:
            save_refit(runtime.refit, get_args().save, iteration=iteration)
        return result

    return save_checkpoint


def _consume_seqlen_stats(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def consume_seqlen_stats_in_iteration():
        """The real tokens and sum of squared document lengths of the last HDP step, for Megatron's FLOPs
        (its own per-rank count would take each ring member's shard as a document of its own)."""
        original()  # drains Megatron's own counters (issues its all-reduce only when something filled them)
        return plan_seqlen_stats(runtime.last_step.plan) if runtime.last_step is not None else (None, None)

    return consume_seqlen_stats_in_iteration


def _mtp_block_spec(original: Callable, runtime: HDPRuntime) -> Callable:
    from megatron_hdp.megatron.mtp import with_mtp_layer_spec

    return with_mtp_layer_spec(original, hdp_layer_spec)


_PATCHES = {
    "setup_model_and_optimizer": _setup_model_and_optimizer,
    "build_train_valid_test_datasets": _build_datasets,
    "build_pretraining_data_loader": _build_data_loader,
    "get_forward_backward_func": _get_forward_backward_func,
    "training_log": _training_log,
    "consume_seqlen_stats_in_iteration": _consume_seqlen_stats,
    "save_checkpoint": _save_checkpoint,
}
"""Wrappers of names in `megatron.training.training`."""
_MODEL_PATCHES = {"mtp_block_spec": _mtp_block_spec}
"""Wrappers of names in `megatron.training.models.gpt` (the config-container model builder)."""


def _wrap(module: Any, name: str, wrap: Callable, runtime: HDPRuntime) -> Callable:
    """Replace `module.name` by `wrap(Megatron's own function, runtime)` (never a wrapper around a wrapper)."""
    current = getattr(module, name)
    original = getattr(current, "_hdp_original", current)
    wrapped = wrap(original, runtime)
    wrapped._hdp_original = original  # type: ignore[attr-defined]
    setattr(module, name, wrapped)
    return wrapped


def install(args: Optional[Namespace] = None) -> Optional[HDPConfig]:
    """Check the HDP flags and, with `--hdp`, wire HDP into megatron.training (module docstring).

    `args` defaults to Megatron's `get_args()`. Returns the HDPConfig, or None when HDP is off. Raises
    ValueError for flags HDP cannot run with and, with --hdp only, RuntimeError on a megatron-core release
    not in `training_compat.SUPPORTED_MCORE` (without --hdp it only warns). Builds the one `HDPRuntime`
    the wrappers close over (`installed()` finds it). Calling it again in the same process re-reads the
    flags and wraps Megatron's own functions again, around a new runtime (never a wrapper around a wrapper).
    """
    require_megatron_training()
    from megatron.training import training

    if args is None:
        from megatron.training import get_args

        args = get_args()
    config = validate_hdp_args(args)
    if config is None:
        return None
    check_megatron_version(hdp=True)
    _pipeline_shapes_per_microbatch(args)
    if args.spec is not None and tuple(args.spec) != (__name__, "hdp_layer_spec"):
        raise ValueError(
            f"--spec {' '.join(args.spec)} with --hdp: HDP supplies the layer spec (Megatron's GPT layer with "
            "HDP core attention); drop --spec"
        )
    args.spec = [__name__, "hdp_layer_spec"]
    from megatron_hdp.megatron.cpu_shims import apply_cpu_shims, apply_training_cpu_shims

    if apply_cpu_shims():
        apply_training_cpu_shims()
    cost_model, refit = _cost_model(args, config), None
    if config.hdp_online_refit:
        refit = _online_refit(args, config, cost_model)
        cost_model = refit.model
    offload = None
    if config.hdp_offload_min_tensor_bytes is not None:
        offload = OffloadConfig(min_tensor_bytes=config.hdp_offload_min_tensor_bytes)
    node = cost_model.ranks_per_node and cost_model.ranks_per_node * args.tensor_model_parallel_size
    runtime = HDPRuntime(config=config, cost_model=cost_model, telemetry=StepTelemetry(ranks_per_node=node),
                         offload_config=offload, refit=refit)
    from megatron.training.models import gpt

    for name, wrap in _PATCHES.items():
        _wrap(training, name, wrap, runtime)
    for name, wrap in _MODEL_PATCHES.items():
        _wrap(gpt, name, wrap, runtime)
    training.get_forward_backward_func._hdp_runtime = runtime  # type: ignore[attr-defined]
    wrap_load_base_checkpoint(runtime)
    logger.info("HDP installed into megatron.training: %s", config)
    return config
