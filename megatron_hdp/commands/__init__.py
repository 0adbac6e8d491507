"""Subcommands of the `megatron-hdp` CLI, one module each."""
