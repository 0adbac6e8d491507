"""sim layer of megatron_hdp."""
