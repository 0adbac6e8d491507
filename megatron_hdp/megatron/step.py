"""The HDP training step: this rank's own micro-batches through Megatron's schedule, then DDP and optimizer.

One step, on every rank (the order matters; every check that can fail comes before the first collective
that could hang):
1. check the plan: valid, sized for this HDP domain, and identical on every rank (the data layer's
   `check_plan_agreement`: an all-gather of its SHA-256 digest — the first collective, and one every
   rank reaches);
2. collate this rank's micro-batches from the plan; pad with empty micro-batches where collectives bind
   ranks together: the ranks of one expert-parallel group run the same count (MoE all-to-all in every
   layer); with PP pipelines run different counts (ring members share a micro-batch index, and 1F1B's
   order of a shorter pipeline is the longer one's restricted to its micro-batches), padded only where
   Megatron's interleaved schedule or the ring rule of `plan.interleaved` needs it (`pipeline_counts`,
   checked before any P2P), with the plan's microbatch group size when it carries one (`step_group_size`);
3. Megatron's `get_forward_backward_func()` (no pipelining, 1F1B, or the interleaved schedule over
   several model chunks, with `variable_seq_lengths`) runs them, each chunk reading the same micro-batches
   in order from its own iterator (`chunk_iterators`); `finalize_model_grads` all-reduces the gradients
   over the data-parallel group (= HDP domain) and divides them by the global loss-token count
   (`calculate_per_token_loss`);
4. the optimizer steps; the statistics of the step are gathered (loss, times, balance, ring bytes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hdp.comm.collectives import all_gather_flat
from megatron_hdp.comm.plan_agreement import check_plan_agreement
from megatron_hdp.comm.traffic import count_traffic
from megatron_hdp.data.collate import MaskReader, PackedMicroBatch, TokenReader, collate_microbatch, empty_microbatch
from megatron_hdp.megatron.forward_step import make_forward_step
from megatron_hdp.megatron import quantization
from megatron_hdp.megatron.initialize import HDPState
from megatron_hdp.plan.interleaved import megatron_constraint_error, satisfies_ring_rule
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timing import runtime_microbatch_counts

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


def check_plan(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None) -> None:
    """ValueError on every rank unless `plan` is valid for this domain and the same on every rank.

    The comm layer's `check_plan_agreement` over all ranks (every TP rank and PP stage must run the same
    plan too), with this domain's checks as its local check: a rank that rejects the plan still joins the
    digest all-gather, so no peer hangs in it. With virtual pipeline stages the local check includes the
    counts the pipelines will run against Megatron's constraints and the ring rule
    (`check_pipeline_counts`; `group_size`: microbatch_group_size_per_vp_stage)."""

    def fits_domain(plan: StepPlan) -> None:
        plan.validate()
        if plan.num_ranks != state.hdp_size:
            raise ValueError(f"the plan is for {plan.num_ranks} HDP ranks but the HDP domain has {state.hdp_size}")
        if plan.pp_size != state.pp_size:
            raise ValueError(f"the plan was made for pp_size={plan.pp_size} but PP is {state.pp_size}")
        if plan.vpp_size != state.vpp_size:
            raise ValueError(f"the plan was made for vpp_size={plan.vpp_size} but the model has {state.vpp_size} "
                             "virtual pipeline stages per PP rank: plan with the model's vpp_size")
        check_pipeline_counts(plan, state=state, group_size=group_size)

    check_plan_agreement(plan, check=fits_domain)


def ring_slots(plan: StepPlan) -> list[tuple[int, tuple[int, ...]]]:
    """(micro-batch index, member HDP ranks) of every ring of `plan` (a validated plan puts all members of
    a ring at one index): the `rings` of `plan.interleaved`, whose pipelines are the HDP ranks."""
    index_of = {}
    for schedule in plan.ranks:
        for index, mb in enumerate(schedule.microbatches):
            for shard in mb.shards:
                index_of[shard.seq] = index
    return [(index_of[seq.id], tuple(seq.ring)) for seq in plan.sequences if len(seq.ring) > 1]


def pipeline_counts(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None) -> list[int]:
    """Micro-batches each HDP rank (with PP: each pipeline) runs for `plan`: the counts the planner times
    (`plan.timing.runtime_microbatch_counts`, one function for both).

    Its own count (1F1B pipelines need no padding for rings, `plan.interleaved`), raised to its EP group's
    largest (the MoE all-to-all binds the group in every layer), and at least one (every rank takes part
    in the gradient reduction). With virtual pipeline stages, `plan.interleaved.padded_counts`: the least counts
    Megatron's interleaved schedule runs (`group_size` = microbatch_group_size_per_vp_stage, None: the
    PP size) that keep THE RING RULE written there, so pipelines run different counts and every ring's
    (chunk, micro-batch) is reached without a cycle of waits. An EP group is linked like a ring."""
    return runtime_microbatch_counts(
        [len(r.microbatches) for r in plan.ranks], pp_size=state.pp_size, ep_size=state.ep_size,
        vpp_size=state.vpp_size, rings=[members for _, members in ring_slots(plan)], group_size=group_size,
    )


def check_pipeline_counts(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None) -> list[int]:
    """`pipeline_counts`, checked against Megatron's interleaved-schedule constraints and THE RING RULE
    (plan.interleaved) before any micro-batch runs: ValueError naming the broken constraint, raised alike
    on every rank (same plan, same counts), so no rank enters a ring P2P that a peer never reaches."""
    counts = pipeline_counts(plan, state=state, group_size=group_size)
    if state.vpp_size == 1:
        return counts
    for rank, count in enumerate(counts):
        error = megatron_constraint_error(count, pp_size=state.pp_size, vpp_size=state.vpp_size,
                                          group_size=group_size)
        if error:
            raise ValueError(f"HDP rank {rank}'s pipeline would run {count} micro-batches: {error}; set "
                             "--microbatch-group-size-per-virtual-pipeline-stage within [pp, micro-batches]")
    rings = ring_slots(plan)
    if not satisfies_ring_rule(counts, rings=rings, pp_size=state.pp_size, vpp_size=state.vpp_size,
                               group_size=group_size):
        raise ValueError(
            f"micro-batch counts {counts} of the pipelines break the ring rule of the interleaved schedule for "
            f"rings (micro-batch, pipelines) {rings}: in each set of pipelines linked by rings every count must "
            "be the set's largest or a multiple of microbatch_group_size_per_vp_stage, or ring P2P can deadlock "
            "(plan.interleaved); pad with plan.interleaved.padded_counts"
        )
    return counts


def num_microbatches_to_run(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None) -> int:
    """Micro-batches this rank runs (`check_pipeline_counts` at its HDP rank)."""
    return check_pipeline_counts(plan, state=state, group_size=group_size)[state.hdp_rank]


def pad_microbatches(
    plan: StepPlan,
    batches: list[PackedMicroBatch],
    *,
    state: HDPState,
    pad_to_multiple: int = 1,
    group_size: Optional[int] = None,
) -> list[PackedMicroBatch]:
    """`batches` (this rank's collated micro-batches of `plan`) followed by the empty micro-batches that
    make up the count `num_microbatches_to_run` asks for: an idle rank runs one, an EP group's ranks run
    the same count, with virtual pipeline stages the ring rule's count.

    A padding micro-batch is a real forward and backward through the whole model, with a loss mask of
    zeros: its loss is exactly 0 and adds nothing to the token-level sum, yet every parameter gets a
    (zero) gradient from it. So on every rank Megatron DDP's per-parameter gradient hooks fire once in
    the last micro-batch, as `--overlap-grad-reduce` needs before it issues each bucket's reduction, the
    rank joins the gradient reduction, and with MoE it joins every layer's expert all-to-all.
    """
    num_padding = num_microbatches_to_run(plan, state=state, group_size=group_size) - len(batches)
    assert num_padding >= 0, f"{len(batches)} micro-batches for a rank the plan gives fewer"
    return batches + [empty_microbatch(rank=state.hdp_rank, num_tokens=pad_to_multiple) for _ in range(num_padding)]


def pinned_for(batches: list[PackedMicroBatch], device: torch.device) -> list[PackedMicroBatch]:
    """`batches` in pinned host memory when the model is on a GPU (the forward step copies each one
    non-blocking: asynchronous only from pinned memory), else unchanged."""
    return [b.pin_memory() for b in batches] if device.type == "cuda" else batches


def chunk_iterators(batches: list, num_chunks: int) -> Any:
    """The `data_iterator` argument of Megatron's schedule: an iterator over `batches`, or with several
    model chunks (virtual pipeline stages) a list of them, one per chunk, each over all of `batches`: the
    interleaved schedule calls forward_step(data_iterator[c], model[c]) for micro-batch m of chunk c in
    increasing m, so each chunk's iterator hands it the same micro-batch m, with all its HDP metadata."""
    return iter(batches) if num_chunks == 1 else [iter(batches) for _ in range(num_chunks)]


def chunk_offload(offloaders: Sequence[Any], ratios: list[float]) -> Optional[list[tuple[Any, Iterator[float]]]]:
    """`make_forward_step`'s `offload_ratios`: per model chunk its offloader (None: this rank offloads
    nothing) with its own iterator over the micro-batches' `ratios`."""
    if not offloaders:
        return None
    return [(offloader, iter(ratios)) for offloader in offloaders]


def offload_ratios(plan: StepPlan, *, rank: int, num_microbatches: int) -> list[float]:
    """The activation-offload ratio of each of the `num_microbatches` micro-batches rank `rank` runs: the
    largest planned ratio of its sequences (the planner sized the micro-batch with it), 0 for padding."""
    ratios = [
        max((plan.sequences[sh.seq].offload_ratio for sh in mb.shards), default=0.0) for mb in plan.microbatches(rank)
    ]
    assert len(ratios) <= num_microbatches
    return ratios + [0.0] * (num_microbatches - len(ratios))


def pop_offload_stats(offloaders: Sequence[Any]) -> Any:
    """The step's `OffloadStats` of this rank, summed over its model chunks' offloaders (None: none)."""
    if not offloaders:
        return None
    return sum((offloader.pop_step_stats() for offloader in offloaders[1:]), offloaders[0].pop_step_stats())


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
        offloader: Any = None,
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
        self.offloaders: list[Any] = [] if offloader is None else (
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
        self.config.finalize_model_grads_func = self._finalize
        no_sync = [chunk.no_sync for chunk in self.chunks]
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.config.grad_sync_func = None

    def _finalize(self, *args: Any, **kwargs: Any) -> None:
        self._finalize_start = time.perf_counter()
        self._stamps.append(time.process_time())
        finalize_model_grads(*args, **kwargs)

    def collate(
        self, plan: StepPlan, read_tokens: TokenReader, read_loss_mask: Optional[MaskReader] = None
    ) -> list[PackedMicroBatch]:
        """This rank's packed micro-batches, padded to the count `num_microbatches_to_run` asks for; in
        pinned host memory when the model is on a GPU (the forward step copies each one asynchronously)."""
        rank = self.state.hdp_rank
        batches = [
            collate_microbatch(
                plan, mb, read_tokens, pad_to_multiple=self.pad_to_multiple, read_loss_mask=read_loss_mask, rank=rank
            )
            for mb in plan.microbatches(rank)
        ]
        batches = pad_microbatches(plan, batches, state=self.state, pad_to_multiple=self.pad_to_multiple,
                                   group_size=step_group_size(plan, self.config))
        return pinned_for(batches, self.device)

    def step(
        self, plan: StepPlan, read_tokens: TokenReader, *, read_loss_mask: Optional[MaskReader] = None
    ) -> StepStats:
        """One training step of the global batch `plan` describes (the same plan on every rank)."""
        start = time.perf_counter()
        self._stamps = [time.process_time()]
        check_plan(plan, state=self.state, group_size=step_group_size(plan, self.config))
        batches = self.collate(plan, read_tokens, read_loss_mask)
        ratios = offload_ratios(plan, rank=self.state.hdp_rank, num_microbatches=len(batches))
        forward_step = make_forward_step(
            hdp_global_ranks=self.state.hdp_global_ranks, backend=self.backend,
            offload_ratios=chunk_offload(self.offloaders, ratios),
        )
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with count_traffic() as traffic:
            losses = get_forward_backward_func()(
                forward_step_func=_stamped(forward_step, self._stamps),
                data_iterator=chunk_iterators(batches, len(self.chunks)),
                model=self.chunks,
                num_microbatches=len(batches),
                seq_length=max(b.num_tokens for b in batches),
                micro_batch_size=1,
                forward_only=False,
            )
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
