"""The Megatron-LM functions install() wraps, one wrapper each (what each replaces and why: the docstring
of `pretrain.install`). Each `wrap_<name>(original, runtime)` returns a function with Megatron's own
signature that closes over the process's one `HDPRuntime`."""

from __future__ import annotations

import contextlib
import functools
from argparse import Namespace
from typing import Any, Callable

from megatron_hdp.comm.telemetry import plan_seqlen_stats, write_stats
from megatron_hdp.data.quantization import token_multiple
from megatron_hdp.data.resume import truncation_change
from megatron_hdp.megatron.layers.spec import hdp_layer_spec
from megatron_hdp.megatron.pretrain.runtime import HDPRuntime, log_telemetry
from megatron_hdp.offload import ActivationOffloader


def wrap_setup_model_and_optimizer(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any):
        from megatron.core.utils import unwrap_model

        from megatron_hdp.megatron.layers.spec import prepare_model_for_hdp

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


def wrap_build_datasets(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def build_train_valid_test_datasets(*args: Any, **kwargs: Any):
        with datasets_built_on_every_rank():
            return original(*args, **kwargs)

    return build_train_valid_test_datasets


def wrap_build_data_loader(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def build_pretraining_data_loader(dataset: Any, consumed_samples: int):
        from megatron.training import get_args

        from megatron_hdp.megatron.datasets.sources import build_hdp_data_loader
        from megatron_hdp.megatron.core_api.initialize import hdp_state

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
    from megatron_hdp.megatron.core_api.forward_step import make_forward_step
    from megatron_hdp.megatron.core_api.initialize import hdp_state
    from megatron_hdp.megatron.pretrain.saved_plans import save_training_step_plan
    from megatron_hdp.megatron.core_api.step import step_group_size
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


def wrap_get_forward_backward_func(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any):
        return _forward_backward(original(*args, **kwargs), runtime)

    return get_forward_backward_func


def wrap_training_log(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any):
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        from megatron.training.utils import print_rank_last

        from megatron_hdp.megatron.layers.mtp import log_token_level_mtp_loss

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


def pipeline_shapes_per_microbatch(args: Namespace) -> None:
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


def wrap_save_checkpoint(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any):
        """Megatron's checkpoint, plus the learned cost model next to it (--hdp-online-refit)."""
        import torch.distributed as dist
        from megatron.training import get_args

        from megatron_hdp.plan.cost.online_refit import save_refit

        result = original(iteration, *args, **kwargs)
        if runtime.refit is not None and get_args().save and dist.get_rank() == 0:
            save_refit(runtime.refit, get_args().save, iteration=iteration)
        return result

    return save_checkpoint


def wrap_consume_seqlen_stats(original: Callable, runtime: HDPRuntime) -> Callable:
    @functools.wraps(original)
    def consume_seqlen_stats_in_iteration():
        """The real tokens and sum of squared document lengths of the last HDP step, for Megatron's FLOPs
        (its own per-rank count would take each ring member's shard as a document of its own)."""
        original()  # drains Megatron's own counters (issues its all-reduce only when something filled them)
        return plan_seqlen_stats(runtime.last_step.plan) if runtime.last_step is not None else (None, None)

    return consume_seqlen_stats_in_iteration


def wrap_mtp_block_spec(original: Callable, runtime: HDPRuntime) -> Callable:
    from megatron_hdp.megatron.layers.mtp import with_mtp_layer_spec

    return with_mtp_layer_spec(original, hdp_layer_spec)
