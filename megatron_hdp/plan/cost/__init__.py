"""What a sequence costs on a mesh: the planner's cost model and everything that builds or refits it.

- `model`: `CostModel` (T(s), Act(s), ring traffic per ring kind, offload windows, links, jitter).
- `presets`: analytic coefficients of named models and GPUs (each figure cites its datasheet).
- `mesh`: the one builder of a mesh's cost model (hardware, ranks per node, a measured file completed).
- `fit`, `online_refit`: the one fit of T(s) and Act(s) to measurements, and the refit from each step.
- `sharding`: D(s), the selective-offload ratio (ByteScale Eq. 3), shard and whole-sequence times.
- `ring_sizes`: the ring sizes a step-time target implies (balance's widening and the lower bound).
- `experts`: the expert-parallel unit and how the MoE all-to-all spreads expert work.

Below the timeline, the search steps and the policies; above only the contract (`plan.step_plan`).
"""
