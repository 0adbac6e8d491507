"""The Megatron-LM integration: `--hdp` flags (`args`), `install()` and the Megatron-LM functions it wraps
(`install`, `wrappers`, `runtime`, `cost_setup`), the resume rules (`resume_check`) and saved plans
(`saved_plans`). What `pretrain_gpt.py` reaches through `import megatron_hdp.megatron as hdp`."""
