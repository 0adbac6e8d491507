"""The planner's own policies: `balance` (ByteScale's data-aware sharding and balance scheduler, with ring
widening and expert units) and the baselines (`static` DP x CP, `naive`, `naive-offload`). Each is a
function (lengths, num_ranks, config, cost_model, pp_size, ...) -> StepPlan that `plan.planner` registers.
"""
