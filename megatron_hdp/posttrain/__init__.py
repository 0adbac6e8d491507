"""The door for RL and SFT frameworks: in-memory ragged batches in, exact log-probs, entropy and gradients out.

Planning (`posttrain.planning`, `posttrain.weights`) is pure and imports without torch or Megatron, so a
driver can plan and ship the plan; running (`posttrain.runtime.PostTrainer`) uses the Core-API step.
Names resolve lazily, so importing this package imports neither. See docs/posttrain.md.
"""

from __future__ import annotations

from megatron_hdp.lazy_exports import lazy_exports

_NAMES = {
    "plan_rollouts": "megatron_hdp.posttrain.planning",
    "samples_of_rank": "megatron_hdp.posttrain.planning",
    "response_masks": "megatron_hdp.posttrain.planning",
    "loss_weights": "megatron_hdp.posttrain.weights",
    "Rollouts": "megatron_hdp.posttrain.batch",
    "PostTrainer": "megatron_hdp.posttrain.runtime",
    "LocalShard": "megatron_hdp.posttrain.runtime",
}

__all__, __getattr__ = lazy_exports(__name__, _NAMES)
