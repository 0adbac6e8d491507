"""sim layer of megatron_hdp: what a plan costs on a cluster nobody here has.

- `cluster.ClusterSpec`: model, GPUs = HDP ranks x TP x PP, capacity C from GPU memory, cost model
  (analytic, or a `megatron-hdp calibrate` JSON).
- `simulator.simulate_step(plan, cost_model, ...)`: per-rank timeline of one step of a StepPlan.
- `compare.compare_policies(spec, ...)`: every policy on the same sampled global batches
  (`megatron-hdp simulate`); `compare.throughput_sweep` over context lengths.
- `plots`: plans, step timelines and throughput-vs-context pictures (matplotlib, Agg).

Pure Python + numpy: never imports torch or Megatron.
"""
