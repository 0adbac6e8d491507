"""attention layer of megatron_hdp."""
