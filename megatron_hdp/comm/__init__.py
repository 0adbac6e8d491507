"""comm layer of megatron_hdp."""
