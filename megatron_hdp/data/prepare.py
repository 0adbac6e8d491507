"""`prepare_step`: one step's micro-batches made ready for Megatron's schedule, for both drivers.

The Core-API trainer (`megatron.core_api.step.HDPTrainer`) and the Megatron-LM driver (`megatron.pretrain.install`)
hand a step to Megatron's schedule the same way, through this one function; in order (every check that
can fail comes before the first collective that could hang):

1. check the plan (`check_plan`): valid, sized for this HDP domain, its micro-batch counts runnable, and
   identical on every rank (`comm.plan_agreement`: an all-gather of its digest over every rank — the
   first collective, and one every rank reaches, also a rank that rejects the plan);
2. collate this rank's micro-batches from the plan, unless the data loader already did (each carries the
   offload ratio its plan gives, `PackedMicroBatch.offload_ratio`);
3. pad with empty micro-batches to the count the step runs (`pad_microbatches`: the counts of
   `plan.timeline.timing.runtime_microbatch_counts`, the one idle-micro-batch rule, which the planner times too);
4. pin them in host memory when the model is on a GPU (the forward step copies each one asynchronously).

`chunk_iterators` then gives each model chunk (virtual pipeline stage) its own iterator over them. No
Megatron import: the rank's place in the mesh comes in as an `HDPState`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from megatron_hdp.comm.domain import HDPState
from megatron_hdp.comm.plan_agreement import check_plan_agreement
from megatron_hdp.data.collate import MaskReader, PackedMicroBatch, TokenReader, collate_microbatch, empty_microbatch
from megatron_hdp.plan.timeline.interleaved import megatron_constraint_error, satisfies_ring_rule
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.timing import runtime_microbatch_counts


def check_plan(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None,
               check_inputs: Optional[Callable[[StepPlan], None]] = None) -> None:
    """ValueError on every rank unless `plan` is valid for this domain and the same on every rank.

    The comm layer's `check_plan_agreement` over all ranks (every TP rank and PP stage must run the same
    plan too), with this domain's checks as its local check: a rank that rejects the plan still joins the
    digest all-gather, so no peer hangs in it. The local check includes the counts the pipelines will run
    (`check_pipeline_counts`; `group_size`: microbatch_group_size_per_vp_stage). `check_inputs(plan)`, when
    given, checks this rank's inputs against the plan inside the same local check (a ValueError from it
    fails every rank alike, before any ring message)."""

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
        if check_inputs is not None:
            check_inputs(plan)

    check_plan_agreement(plan, check=fits_domain)


def ring_slots(plan: StepPlan) -> list[tuple[int, tuple[int, ...]]]:
    """(micro-batch index, member HDP ranks) of every ring of `plan` (a validated plan puts all members of
    a ring at one index): the `rings` of `plan.timeline.interleaved`, whose pipelines are the HDP ranks."""
    index_of = {}
    for schedule in plan.ranks:
        for index, mb in enumerate(schedule.microbatches):
            for shard in mb.shards:
                index_of[shard.seq] = index
    return [(index_of[seq.id], tuple(seq.ring)) for seq in plan.sequences if len(seq.ring) > 1]


def pipeline_counts(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None) -> list[int]:
    """Micro-batches each HDP rank (with PP: each pipeline) runs for `plan` on this mesh: exactly
    `plan.timeline.timing.runtime_microbatch_counts`, the counts the planner times: its own count (1F1B pipelines
    need no padding for rings, `plan.timeline.interleaved`), with virtual pipeline stages the least counts
    Megatron's interleaved schedule runs that keep THE RING RULE written there, raised to its EP group's
    largest, and at least one (`group_size`: microbatch_group_size_per_vp_stage, None: the PP size)."""
    return runtime_microbatch_counts(
        [len(r.microbatches) for r in plan.ranks], pp_size=state.pp_size, ep_size=state.ep_size,
        vpp_size=state.vpp_size, rings=[members for _, members in ring_slots(plan)], group_size=group_size,
    )


def check_pipeline_counts(plan: StepPlan, *, state: HDPState, group_size: Optional[int] = None) -> list[int]:
    """`pipeline_counts`, checked against Megatron's interleaved-schedule constraints and THE RING RULE
    (plan.timeline.interleaved) before any micro-batch runs: ValueError naming the broken constraint, raised alike
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
            "(plan.timeline.interleaved); pad with plan.timeline.interleaved.padded_counts"
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
    mtp_depth: int = 0,
) -> list[PackedMicroBatch]:
    """`batches` (this rank's collated micro-batches of `plan`) followed by the empty micro-batches that
    make up the count `num_microbatches_to_run` asks for: an idle rank runs one, an EP group's ranks run
    the same count, with virtual pipeline stages the ring rule's count (with `mtp_depth` D, padding
    carries D depths of multi-token prediction inputs, all 0).

    A padding micro-batch is a real forward and backward through the whole model, with a loss mask of
    zeros: its loss is exactly 0 and adds nothing to the token-level sum, yet every parameter gets a
    (zero) gradient from it. So on every rank Megatron DDP's per-parameter gradient hooks fire once in
    the last micro-batch, as `--overlap-grad-reduce` needs before it issues each bucket's reduction, the
    rank joins the gradient reduction, and with MoE it joins every layer's expert all-to-all.
    """
    num_padding = num_microbatches_to_run(plan, state=state, group_size=group_size) - len(batches)
    assert num_padding >= 0, f"{len(batches)} micro-batches for a rank the plan gives fewer"
    padding = [empty_microbatch(rank=state.hdp_rank, num_tokens=pad_to_multiple, mtp_depth=mtp_depth)
               for _ in range(num_padding)]
    return batches + padding


def pinned_for(batches: list[PackedMicroBatch], device: torch.device) -> list[PackedMicroBatch]:
    """`batches` in pinned host memory when the model is on a GPU (the forward step copies each one
    non-blocking: asynchronous only from pinned memory), else unchanged."""
    return [b.pin_memory() for b in batches] if device.type == "cuda" else batches


def prepare_step(
    plan: StepPlan,
    *,
    state: HDPState,
    device: torch.device,
    pad_to_multiple: int = 1,
    group_size: Optional[int] = None,
    microbatches: Optional[Sequence[PackedMicroBatch]] = None,
    read_tokens: Optional[TokenReader] = None,
    read_loss_mask: Optional[MaskReader] = None,
    mtp_depth: int = 0,
) -> list[PackedMicroBatch]:
    """This rank's micro-batches of `plan`, ready for the schedule (module docstring): plan checked on
    every rank, collated (`microbatches` when the loader collated them, else from `read_tokens` and
    `read_loss_mask`), padded to the count the step runs, pinned when `device` is a GPU. `pad_to_multiple`:
    the token multiple of every micro-batch (sequence parallelism, FP8); `group_size`: Megatron's
    microbatch_group_size_per_vp_stage; `mtp_depth`: the model's multi-token prediction depth D, which
    micro-batches the loader collated must carry (ValueError, on every rank alike, when they do not)."""
    check_plan(plan, state=state, group_size=group_size)
    if microbatches is None:
        if read_tokens is None:
            raise ValueError("prepare_step needs the collated micro-batches or a read_tokens to collate them")
        microbatches = [
            collate_microbatch(plan, mb, read_tokens, pad_to_multiple=pad_to_multiple, read_loss_mask=read_loss_mask,
                               rank=state.hdp_rank, mtp_depth=mtp_depth)
            for mb in plan.microbatches(state.hdp_rank)
        ]
    depths = {batch.mtp_depth for batch in microbatches} - {mtp_depth}
    if depths:
        raise ValueError(f"the model predicts {mtp_depth} extra tokens (mtp_num_layers) but the data loader collated "
                         f"micro-batches for {sorted(depths)}: build the loader with mtp_depth={mtp_depth}")
    batches = pad_microbatches(plan, list(microbatches), state=state, pad_to_multiple=pad_to_multiple,
                               group_size=group_size, mtp_depth=mtp_depth)
    return pinned_for(batches, device)


def chunk_iterators(batches: list[PackedMicroBatch], num_chunks: int) -> Iterator[PackedMicroBatch] | list:
    """The `data_iterator` argument of Megatron's schedule: an iterator over `batches`, or with several
    model chunks (virtual pipeline stages) a list of them, one per chunk, each over all of `batches`: the
    interleaved schedule calls forward_step(data_iterator[c], model[c]) for micro-batch m of chunk c in
    increasing m, so each chunk's iterator hands it the same micro-batch m, with all its HDP metadata."""
    return iter(batches) if num_chunks == 1 else [iter(batches) for _ in range(num_chunks)]
