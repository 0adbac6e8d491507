"""megatron layer of megatron_hdp."""
