"""The expert-parallel unit: which HDP ranks one MoE all-to-all couples, and how it spreads expert work.

Megatron lays the expert grid out so that an expert-TP x EP group binds a block of consecutive HDP ranks
(`expert_unit_size`, `expert_groups`); with uniform routing every member of a group runs the group's mean
of the routed expert work at each micro-batch index (`spread_expert_work`). The planner, the simulator,
the online refit and the Megatron layer all read these facts from here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def expert_unit_size(*, tp_size: int, ep_size: int, etp_size: int | None = None) -> int:
    """HDP ranks one MoE all-to-all couples, for TP, EP and expert TP (ETP; None: Megatron's default, TP).

    Megatron lays out, inside one pipeline stage, the dense grid as tp-dp (TP fastest: global rank
    t + TP d is HDP rank d) and the expert grid as etp-ep-edp, so an expert-TP x EP group is a block of
    ETP x EP consecutive global ranks (`parallel_state.initialize_model_parallel`, order tp-cp-ep-dp-pp).
    Its all-to-all and the TP collectives of the HDP ranks it touches bind blocks of lcm(TP, ETP x EP)
    global ranks together: lcm(TP, ETP x EP) / TP consecutive HDP ranks (EP with ETP = TP; 1 when a block
    of ETP x EP ranks fits inside one HDP rank's TP group)."""
    etp = tp_size if etp_size is None else etp_size
    if min(tp_size, ep_size, etp) < 1:
        raise ValueError(f"parallel sizes must be >= 1, got TP={tp_size}, EP={ep_size}, ETP={etp}")
    return math.lcm(tp_size, etp * ep_size) // tp_size


def expert_groups(num_ranks: int, ep_size: int) -> list[range]:
    """The expert-parallel groups of an HDP domain: consecutive blocks of `ep_size` HDP ranks (Megatron
    orders EP inside DP), whose MoE all-to-all couples micro-batch i of every member."""
    if ep_size < 1 or num_ranks % ep_size:
        raise ValueError(f"expert_parallel_size {ep_size} does not divide the {num_ranks} HDP ranks")
    return [range(start, start + ep_size) for start in range(0, num_ranks, ep_size)]


def spread_expert_work(times: Sequence[Sequence[float]], tokens: Sequence[Sequence[float]], *, ep_size: int,
                       seconds_per_token: float, alltoall_seconds_per_token: float = 0.0) -> list[list[float]]:
    """`times[r][i]` with every expert-parallel group's routed expert work shared out at each index, and
    the all-to-all that shares it: the all-to-all sends each token to the members holding its experts, so
    with uniform routing member m of a group at index i runs seconds_per_token * (mean over the group of
    tokens[.][i]) of expert work instead of seconds_per_token * tokens[m][i] (the group's total work is
    unchanged), and every member waits alltoall_seconds_per_token * (max over the group of tokens[.][i])
    for the all-to-all itself, which ends with its largest sender. `times` and `tokens` (tokens each rank
    holds in each micro-batch, 0 for a padding one) are padded as the runtime runs them (equal counts
    inside a group). `seconds_per_token`, `alltoall_seconds_per_token`: `CostModel.expert_seconds_per_token`,
    `CostModel.expert_alltoall_seconds_per_token`."""
    if ep_size <= 1 or not (seconds_per_token or alltoall_seconds_per_token):
        return [list(map(float, t)) for t in times]
    groups = expert_groups(len(times), ep_size)
    counts = [len(t) for t in times]
    depth = max(counts, default=0)
    held = np.zeros((len(groups), ep_size, depth))
    own = np.zeros((len(groups), ep_size, depth))
    for rank, (rank_times, rank_tokens) in enumerate(zip(times, tokens)):
        held[rank // ep_size, rank % ep_size, : counts[rank]] = rank_tokens
        own[rank // ep_size, rank % ep_size, : counts[rank]] = rank_times
    out = spread_grid(own, held, seconds_per_token=seconds_per_token,
                      alltoall_seconds_per_token=alltoall_seconds_per_token)
    return [out[rank // ep_size, rank % ep_size, : counts[rank]].tolist() for rank in range(len(times))]


def spread_grid(own: np.ndarray, held: np.ndarray, *, seconds_per_token: float,
                alltoall_seconds_per_token: float) -> np.ndarray:
    """`spread_expert_work` on [group, member, index] arrays of times and tokens (zeros past a group's
    count, where the result is 0 too), so every group and index is one numpy step; the members are summed
    one after the other (as Python's sum would), so each value is the same float as a loop over them."""
    ep_size = own.shape[1]
    total = held[:, 0]
    for member in range(1, ep_size):
        total = total + held[:, member]
    mean, largest = total / ep_size, held.max(axis=1)
    return own + (seconds_per_token * (mean[:, None] - held) + alltoall_seconds_per_token * largest[:, None])
