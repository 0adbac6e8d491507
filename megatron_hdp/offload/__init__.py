"""Selective activation offloading: saved activations go to (pinned) host memory during the forward and
come back, prefetched one layer ahead, for the backward. See `offloader.py` for what moves and why."""

from megatron_hdp.offload.offloader import ActivationOffloader, OffloadConfig
from megatron_hdp.offload.stats import OffloadStats

__all__ = ["ActivationOffloader", "OffloadConfig", "OffloadStats"]
