"""The search steps the planner's policies compose, each one decision of a plan.

- `widening`: ring sizes above D(s) when a long sequence would set the step time.
- `placement`: ring placement (aligned, and by predicted time at any index) and LPT.
- `packing`: best-fit micro-batches (and pipeline-aware packing).
- `refine`: local search over a placement.
- `expert_units`: MoE expert-parallel groups planned as units.
- `cp_groups`: the static DP x CP mesh's placement (the RL frameworks' baseline) and Karmarkar-Karp.
- `packed_rings`: the sequences longer than C packed on CP groups' rings, the others whole beside them.

Reads the cost model and the timeline; never a policy.
"""
