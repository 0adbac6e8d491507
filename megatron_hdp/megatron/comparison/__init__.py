"""Megatron's own schedulers run as comparison policies of our planner: Megatron-Core's Hybrid CP
(`hybrid_cp`, with `per_subsample`, the plan as Megatron executes it) and the dev branch's Dynamic CP
(`dynamic_cp`, run in a worker process on a dev checkout: `dynamic_cp_worker`); `scheduler_groups` turns
their groups into rings; `registry` registers them with `plan.planner`. Never imports the pretrain path."""
