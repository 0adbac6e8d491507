"""The HDP training step: this rank's own micro-batches through Megatron's schedule, then DDP and optimizer.

One step, on every rank:
1. `data.prepare.prepare_step`, the step preparation the Megatron-LM driver (`pretrain.wrappers`) shares:
   the plan checked on every rank (valid, sized for this domain, runnable counts, the same digest
   everywhere), this rank's micro-batches collated, padded to the count the step runs, pinned for a GPU;
   with virtual pipeline stages the step runs the micro-batch group size its plan carries (`step_group_size`);
2. Megatron's `get_forward_backward_func()` (no pipelining, 1F1B, or the interleaved schedule over
   several model chunks, with `variable_seq_lengths`) runs them, each chunk reading the same micro-batches
   in order from its own iterator (`chunk_iterators`); `finalize_model_grads` all-reduces the gradients
   over the data-parallel group (= HDP domain) and divides them by the global loss-token count
   (`calculate_per_token_loss`);
3. the optimizer steps; the statistics of the step are gathered (loss, times, balance, ring bytes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hdp.comm.collectives import all_gather_flat
from megatron_hdp.comm.domain import HDPState
from megatron_hdp.comm.traffic import count_traffic
from megatron_hdp.data.collate import MaskReader, TokenReader
from megatron_hdp.data.prepare import chunk_iterators, prepare_step
from megatron_hdp.megatron.core_api.forward_step import make_forward_step
from megatron_hdp.megatron.core_api.initialize import planner_cost_model
from megatron_hdp.offload.offloader import ActivationOffloader, pop_offload_stats
from megatron_hdp.data import quantization
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one HDP step did, identical on every rank."""

    loss: float
    """Token-level loss of the global batch (sum of token losses / loss tokens)."""
    num_loss_tokens: int
    step_time: float
    """Wall seconds of the step (slowest rank), plan check to optimizer step."""
    compute_times: list[float]
    """Seconds each global rank spent in its micro-batches before the gradient reduction."""
    balance: float
    """max / mean of `compute_times` (1.0: every rank reached the all-reduce together)."""
    num_microbatches: list[int]
    """Micro-batches each global rank ran (padding included)."""
    num_rings: int
    attention_bytes: int
    """Ring-attention bytes sent by all ranks in the step (measured)."""
    predicted_step_time: float
    """The plan's predicted step time (cost model), for comparison with `step_time`."""
    grad_norm: float
    offload: Any = None
    """Offload statistics of this rank (`OffloadStats`) when an offloader is attached."""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BusyTimes:
    """CPU seconds this rank spent in each phase of its last step (process time: the compute thread and
    gloo's threads; a rank blocked in a gloo wait uses none, measured). On a host whose ranks share cores,
    this is what each phase would take with a core of its own; `megatron_hdp.sim.replay` composes them
    into the step time of such a cluster."""

    before: float
    """Plan check and collation, before the first micro-batch."""
    forward: tuple[float, ...]
    """Each micro-batch's forward (with its loss), in run order (padding included)."""
    backward: tuple[float, ...]
    """Each micro-batch's backward (and Megatron's work up to the next forward)."""
    after: float
    """Gradient reduction (finalize_model_grads) and the optimizer step."""


def _busy_times(stamps: list[float]) -> BusyTimes:
    """BusyTimes from process-time stamps: start, [forward entry, loss done] per micro-batch, finalize
    start, end."""
    assert len(stamps) % 2 == 1 and len(stamps) >= 5, f"{len(stamps)} stamps"
    marks = stamps[1:-1]  # F0 entry, F0 end, F1 entry, ..., finalize start
    return BusyTimes(
        before=marks[0] - stamps[0],
        forward=tuple(marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)),
        backward=tuple(marks[i + 2] - marks[i + 1] for i in range(0, len(marks) - 1, 2)),
        after=stamps[-1] - marks[-1],
    )


def _stamped(forward_step: Callable, stamps: list[float]) -> Callable:
    """`forward_step` that stamps the process time when it starts and when its loss is computed."""

    def timed_forward_step(data_iterator, model):
        stamps.append(time.process_time())
        output, loss_func = forward_step(data_iterator, model)

        def timed_loss(output_tensor):
            result = loss_func(output_tensor)
            stamps.append(time.process_time())
            return result

        return output, timed_loss

    return timed_forward_step


def check_model_config(config: TransformerConfig, *, state: HDPState) -> None:
    """ValueError for Megatron settings HDP cannot train with (checked on every rank, before any collective)."""
    if not config.calculate_per_token_loss:
        raise ValueError(
            "HDP needs calculate_per_token_loss=True: ranks run different numbers of micro-batches, so "
            "only a token-level loss is exact"
        )
    if config.context_parallel_size != 1:
        raise ValueError(f"context_parallel_size={config.context_parallel_size}: HDP replaces it; set it to 1")
    if state.pp_size > 1 and not config.variable_seq_lengths:
        raise ValueError("HDP with pipeline parallelism needs variable_seq_lengths=True (micro-batch sizes vary)")
    if config.sequence_parallel and state.tp_size == 1:
        raise ValueError("sequence_parallel=True needs tensor_model_parallel_size > 1")
    refused = quantization.problems(config)
    if refused:
        raise ValueError(refused[0])


def step_group_size(plan: StepPlan, config: Any) -> Optional[int]:
    """The microbatch_group_size_per_vp_stage G this step runs: the plan's when it carries one (the planner
    chose and timed it), else the one configured before the first step. Written into Megatron's `config`,
    which forward_backward_pipelining_with_interleaving reads at every call (its G checks, warm-up and
    schedule table), so each step's schedule runs the G its counts were padded for."""
    configured = config.__dict__.setdefault("_hdp_configured_group_size", config.microbatch_group_size_per_vp_stage)
    group = configured if plan.group_size is None else plan.group_size
    config.microbatch_group_size_per_vp_stage = group
    return group


def sync_grads_at_schedule_end(
    chunks: Sequence[torch.nn.Module], *, finalize: Callable = finalize_model_grads
) -> None:
    """Have Megatron's schedule reduce the gradients of `chunks` (in Megatron DDP) as Megatron-LM's train()
    does: no gradient sync in the micro-batches before the last (`no_sync_func`), then `finalize`
    (finalize_model_grads: the all-reduce over the data-parallel group, divided by the loss-token count
    under calculate_per_token_loss) once the schedule ends; no per-bucket sync hook."""
    config = chunks[0].config
    config.finalize_model_grads_func = finalize
    no_sync = [chunk.no_sync for chunk in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_sync_func = None


def forward_backward(chunks: Sequence[torch.nn.Module], forward_step: Callable, data_iterator: Any, *,
                     num_microbatches: int, seq_length: int, forward_only: bool = False) -> list[dict]:
    """Forward and backward (only the forward with `forward_only`) of `num_microbatches` micro-batches
    (one sequence each) over `chunks` by Megatron's schedule (`get_forward_backward_func`: none, 1F1B or
    interleaved, as parallel_state was initialized); the loss dictionaries the last pipeline stage collected."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=list(chunks),
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )


class HDPTrainer:
    """Runs HDP steps for a model wrapped in Megatron DDP (one chunk, or with virtual pipeline stages a
    list of chunks in stage order), with a Megatron optimizer."""

    def __init__(
        self,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: Any,
        state: HDPState,
        backend: str = "auto",
        offloader: ActivationOffloader | Sequence[ActivationOffloader] | None = None,
    ) -> None:
        self.model = model
        self.chunks: list[torch.nn.Module] = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(self.chunks) != state.vpp_size:
            raise ValueError(
                f"{len(self.chunks)} model chunks for {state.vpp_size} virtual pipeline stages per PP rank: "
                "pass one chunk per virtual stage (build_gpt_chunks)"
            )
        self.optimizer = optimizer
        self.state = state
        self.backend = backend
        self.offloaders: list[ActivationOffloader] = [] if offloader is None else (
            list(offloader) if isinstance(offloader, (list, tuple)) else [offloader])
        """One ActivationOffloader per model chunk (its layers), or none."""
        if self.offloaders and len(self.offloaders) != len(self.chunks):
            raise ValueError(f"{len(self.offloaders)} offloaders for {len(self.chunks)} model chunks: give one per chunk")
        self.config: TransformerConfig = self.chunks[0].config
        check_model_config(self.config, state=state)
        self.pad_to_multiple = quantization.token_multiple(self.config)
        self.device = next(self.chunks[0].parameters()).device
        """Where the model lives: micro-batches are moved there, the step's statistics reduced there."""
        self._finalize_start = 0.0
        self._stamps: list[float] = []
        self.last_busy: Optional[BusyTimes] = None
        """This rank's `BusyTimes` of the last step (local, not gathered)."""
        sync_grads_at_schedule_end(self.chunks, finalize=self._finalize)

    def planning_cost_model(self, cost_model: CostModel) -> CostModel:
        """`cost_model` as the planner needs it for this trainer's mesh: with the HDP ranks an MoE
        all-to-all couples, read off Megatron's groups (`initialize.planner_cost_model`), so that plans
        for `step` run EP groups together instead of padding them."""
        return planner_cost_model(cost_model, self.state)

    def _finalize(self, *args: Any, **kwargs: Any) -> None:
        self._finalize_start = time.perf_counter()
        self._stamps.append(time.process_time())
        finalize_model_grads(*args, **kwargs)

    def step(
        self, plan: StepPlan, read_tokens: TokenReader, *, read_loss_mask: Optional[MaskReader] = None
    ) -> StepStats:
        """One training step of the global batch `plan` describes (the same plan on every rank)."""
        start = time.perf_counter()
        self._stamps = [time.process_time()]
        batches = prepare_step(plan, state=self.state, device=self.device, pad_to_multiple=self.pad_to_multiple,
                               group_size=step_group_size(plan, self.config),
                               read_tokens=read_tokens, read_loss_mask=read_loss_mask,
                               mtp_depth=self.config.mtp_num_layers or 0)
        forward_step = make_forward_step(hdp_global_ranks=self.state.hdp_global_ranks, backend=self.backend,
                                         offloaders=self.offloaders)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with count_traffic() as traffic:
            losses = forward_backward(self.chunks, _stamped(forward_step, self._stamps),
                                      chunk_iterators(batches, len(self.chunks)), num_microbatches=len(batches),
                                      seq_length=max(b.num_tokens for b in batches))
        compute_time = self._finalize_start - start
        ok, grad_norm, _ = self.optimizer.step()
        assert ok, "the fp32 optimizer step cannot be skipped"
        step_time = time.perf_counter() - start
        self._stamps.append(time.process_time())
        # With PP only the last stage computes losses (no second stamp) and 1F1B interleaves micro-batches:
        # the forward/backward phases are defined for the no-pipelining schedule only.
        self.last_busy = _busy_times(self._stamps) if self.state.pp_size == 1 else None
        return self._gather_stats(plan, batches, losses, compute_time, step_time, traffic.bytes_sent, grad_norm)

    def _gather_stats(self, plan, batches, losses, compute_time, step_time, bytes_sent, grad_norm) -> StepStats:
        """The step's statistics, identical on every rank: two collectives on the model's device (the
        process group's device: CUDA under NCCL), then one read back to the host."""
        world = dist.get_world_size()
        counts_loss = torch.zeros(2, dtype=torch.float64, device=self.device)
        if losses and self.state.is_last_stage and self._is_tp_rank0():
            counts_loss += torch.stack([x["lm loss"].double() for x in losses]).sum(0).to(self.device)
        dist.all_reduce(counts_loss)
        mine = torch.tensor(
            [compute_time, step_time, float(len(batches)), float(bytes_sent)], dtype=torch.float64, device=self.device
        )
        gathered = torch.empty(world * mine.numel(), dtype=mine.dtype, device=self.device)
        all_gather_flat(gathered, mine)
        table = torch.cat([gathered.view(world, -1), counts_loss.expand(world, 2)], dim=1).cpu()
        counts_loss = table[0, 4:]
        times = table[:, 0].tolist()
        summary = plan.summary()
        return StepStats(
            loss=float(counts_loss[0] / counts_loss[1]) if counts_loss[1] > 0 else float("nan"),
            num_loss_tokens=int(counts_loss[1]),
            step_time=float(table[:, 1].max()),
            compute_times=times,
            balance=max(times) / (sum(times) / len(times)) if sum(times) > 0 else 1.0,
            num_microbatches=[int(x) for x in table[:, 2].tolist()],
            num_rings=summary.num_rings,
            attention_bytes=int(table[:, 3].sum()),
            predicted_step_time=plan.est_step_time,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            offload=pop_offload_stats(self.offloaders),
        )

    @staticmethod
    def _is_tp_rank0() -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0
