"""`HDPRuntime`: what install() set up for this process (config, the cost model the loaders plan with and
its online refit, loaders, offloaders, telemetry), and the functions that read it back: `installed()`,
`hdp_statistics()` and `log_telemetry()`. The wrappers of `pretrain.wrappers` close over one runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_hdp.comm.telemetry import (
    PER_RANK_FIELDS, StepTelemetry, collective_device, console_line, gather_rows, summarize, write_stats,
)
from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader, HDPStep
from megatron_hdp.offload import ActivationOffloader, OffloadConfig, OffloadStats
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.online_refit import OnlineRefit
from megatron_hdp.plan.step_plan import StepPlan


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
