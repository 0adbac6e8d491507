"""The packed-sequence parameters every HDP layer reads: Megatron's THD `PackedSeqParams` plus the HDP
metadata of the micro-batch. A leaf of the layer spec: the core attention, MLA and the forward step all
import it, and it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.packed_seq_params import PackedSeqParams

from megatron_hdp.attention.core_attention import HDPBatchMeta
from megatron_hdp.data.mtp_shift import MTPRolls


@dataclass
class HDPPackedSeqParams(PackedSeqParams):
    """Megatron's THD parameters plus the HDP metadata of the micro-batch (rings, positions) and, for a
    model with multi-token prediction, what each of its rolls gives (`megatron/layers/mtp.py`)."""

    hdp: Optional[HDPBatchMeta] = None
    mtp_rolls: Optional[MTPRolls] = None


def batch_meta(packed_seq_params: Optional[PackedSeqParams], module: str) -> HDPBatchMeta:
    """The HDP metadata `packed_seq_params` carries; ValueError naming `module` when it carries none."""
    meta = getattr(packed_seq_params, "hdp", None)
    if meta is None:
        raise ValueError(
            f"{module} needs HDPPackedSeqParams with HDP metadata (build batches with "
            f"megatron_hdp.megatron.core_api.forward_step), got packed_seq_params={type(packed_seq_params).__name__}"
        )
    return meta
