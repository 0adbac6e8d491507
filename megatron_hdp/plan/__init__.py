"""Hybrid Data Parallelism planner: pure Python + numpy, never imports torch or Megatron.

Entry point: `planner.make_plan(lengths, num_ranks=, config=, cost_model=, pp_size=, policy=)` -> a
validated `step_plan.StepPlan`. Modules, one job each:

- `cost_model`, `presets`: T(s), Act(s), ring traffic (the runtime's bytes per dtype), offload overlap
  (Eq. 3's windows), topology (ranks per node, link inside / between nodes); analytic coefficients.
- `timing`: the one step-time model (ring and expert-parallel coupling, the runtime's padding).
- `sharding`: D(s) and the selective-offload ratio (ByteScale Eq. 3), shard and whole-sequence times.
- `widening`: ring sizes above D(s) when a long sequence would set the step time.
- `placement`: ring placement (aligned, and by predicted time at any index) and LPT; `packing`: best-fit micro-batches; `refine`: local search
  and MILP; `assemble`: decisions -> timed StepPlan (the one timing path of every policy).
- `balance` (policy `balance`), `baselines` (`static`, `naive`, `naive-offload`); `planner` holds the
  policy registry, where the layers above register their own policies (Megatron's Hybrid-CP and the
  dev branch's Dynamic CP) when imported.
- `bounds`: a lower bound on any plan's step time, and a plan's gap to it.
- `lengths`: the shared real length lists, ByteScale-like synthetic mixes, global-batch sampling.
- `fit`: the one fit of T(s) and Act(s) to measurements, and the CostModel made from it (calibrate, the
  harnesses and the online refit use it); `online_refit`: the refit from each step's measured compute.
- `hand_plan`: a StepPlan from an explicit placement (tests and harnesses pin down the plan they run).
- `per_subsample`: a Hybrid-CP plan as Megatron executes it (a pass per sub-sample, group barriers).
"""
