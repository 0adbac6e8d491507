"""The Megatron-Core API path: `initialize` (HDP's state on Megatron's parallel_state), `model` (build and
wrap a GPT for training), `forward_step` (one micro-batch: packed sequence parameters, token-level loss)
and `step` (`HDPTrainer`: plan, collate, run Megatron's schedule, all-reduce)."""
