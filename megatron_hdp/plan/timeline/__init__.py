"""The time of a plan: when every rank finishes, given each micro-batch's cost.

- `timing`: the one step-time model (ring and expert-parallel coupling, jitter, the runtime's padding).
- `pipeline`, `interleaved`: Megatron's 1F1B and interleaved (VPP) op order, timed exactly.
- `assemble`: a policy's decisions -> a timed, validated `StepPlan` (the one timing path of every policy).
- `bounds`: a lower bound on any plan's step time, and the critical-path floor of pipelines.
- `ep_floor`: a lower bound on one EP schedule's timed step without PP, far cheaper than timing it.

Reads the cost model and the contract; never the search steps or the policies.
"""
