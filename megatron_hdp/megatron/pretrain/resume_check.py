"""install()'s check of what an --hdp resume changes (`megatron_hdp.data.resume`), where Megatron reads it.

`load_checkpoint` (megatron/training/checkpointing.py, 0.19 and 0.20) first reads the checkpoint's saved
arguments through `_load_base_checkpoint`, before any sharded tensor is read. Wrapped there, a TP, PP,
EP, ETP or virtual-stage change stops every rank with a one-line ValueError naming the flag (Megatron's own later refusal with
the distributed optimizer names none); the arguments are kept for the loader's check of the documents'
lengths. A --finetune load starts a new run and is not checked (Megatron does not check it either).
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_hdp.data.resume import model_parallel_changes


def wrap_load_base_checkpoint(runtime: Any) -> None:
    """Wrap Megatron's `checkpointing._load_base_checkpoint` (once: a second install wraps the original)
    to check the saved arguments and keep them in `runtime.checkpoint_args`."""
    from megatron.training import checkpointing, get_args

    current = checkpointing._load_base_checkpoint
    original = getattr(current, "_hdp_original", current)

    @functools.wraps(original)
    def load_base_checkpoint(*args: Any, **kwargs: Any):
        result = original(*args, **kwargs)
        state_dict = result[0]
        if state_dict and "args" in state_dict and not get_args().finetune:
            problems = model_parallel_changes(state_dict["args"], get_args())
            if problems:
                raise ValueError("; ".join(problems))
            runtime.checkpoint_args = state_dict["args"]
        return result

    load_base_checkpoint._hdp_original = original  # type: ignore[attr-defined]
    checkpointing._load_base_checkpoint = load_base_checkpoint
