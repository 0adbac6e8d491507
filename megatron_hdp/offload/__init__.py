"""offload layer of megatron_hdp."""
