"""data layer of megatron_hdp."""
