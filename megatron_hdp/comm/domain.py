"""`HDPState`: one rank's place in the HDP domain and the mesh around it, as plain data.

The Megatron layer reads it off Megatron's parallel_state (`megatron.core_api.initialize.hdp_state`); the step
preparation (`data.step_input`) and everything below Megatron take it as an argument, so they run, and
are tested, without Megatron's globals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HDPState:
    """This rank's place in the HDP domain and the mesh around it."""

    hdp_rank: int
    """This rank's index in the HDP domain (= Megatron's data-parallel rank); the plan's rank id."""
    hdp_global_ranks: tuple[int, ...]
    """Global rank of HDP rank i at this rank's (PP stage, TP rank): ring members are addressed by them."""
    tp_size: int
    pp_size: int
    pp_rank: int
    vpp_size: int
    """Model chunks per pipeline stage (virtual pipeline stages; 1: no interleaving)."""
    ep_size: int
    """HDP ranks per expert-parallel group: the consecutive HDP ranks an MoE all-to-all couples (EP when
    expert TP is TP; `plan.cost.experts.expert_unit_size`)."""
    ep_hdp_ranks: tuple[int, ...]
    """HDP ranks of this rank's expert-parallel group (they exchange tokens in every MoE layer)."""

    @property
    def hdp_size(self) -> int:
        """D: ranks in the HDP domain."""
        return len(self.hdp_global_ranks)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1
