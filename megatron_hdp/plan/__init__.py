"""Hybrid Data Parallelism planner: pure Python + numpy, never imports torch or Megatron.

Entry point: `planner.make_plan(lengths, num_ranks=, config=, cost_model=, pp_size=, policy=)` -> a
validated `step_plan.StepPlan`. Sub-packages, bottom to top (tests/test_layers.py holds the order):

- the contract: `step_plan` (StepPlan and its JSON, `RING_KINDS`), `zigzag` (the per-document zigzag),
  `hand_plan` (a StepPlan from an explicit placement: tests and harnesses pin down the plan they run);
  `lengths` (real length lists, synthetic mixes, global-batch sampling) beside it;
- `cost/`: what a sequence costs on a mesh (the cost model, presets, the mesh's one builder, the fit and
  the online refit, D(s) and offload ratios, ring sizes for a target, the EP unit);
- `timeline/`: the time of a plan (the one step-time model, pipelines, decisions -> timed plan, bounds);
- `search/`: the steps policies compose (widening, placement, packing, refinement, expert units);
- `policies/`: `balance` and the baselines (`static`, `naive`, `naive-offload`);
- `planner`: `make_plan` and the policy registry, where the layers above register their own policies
  (Megatron's Hybrid-CP and the dev branch's Dynamic CP) when imported.

docs/architecture.md is the map of every module.
"""
