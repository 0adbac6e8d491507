"""harness layer of megatron_hdp: what drives the integration for evidence, not for users' training.

- `cpu_training`: the demo's and step_bench's CPU training runs, policy against policy, timed and predicted.
- `exactness`: HDP on several ranks against ordinary single-process training of the same batch.
- `model`: the tiny Llama-style model shape the harnesses and tests build (with `megatron.core_api.model`).
- `gpu_smoke`: two training steps on the GPUs of this machine (the selftest's training run).
- `run_pretrain`: a Megatron-LM pretrain script on a CPU-only PyTorch (`python -m megatron_hdp.harness.run_pretrain`).
- `build_dataset`: Megatron indexed datasets for the demo, tests and examples.
- `calibrate`: measures a reference layer's compute and the offload link, fits the cost model.

Harnesses reach Megatron only through the integration layer's functions (`megatron_hdp.megatron`): only
that layer imports Megatron. Each module is imported by its own path; importing this package imports
none of them.
"""
