"""Digests of the plans of a fixed set of batches, per policy: a refactor must leave them identical.

    python benchmarks/plan_digests.py                       # print {case: digest} as JSON
    python benchmarks/plan_digests.py --compare OLD.json    # exit 1 and name the cases that changed

Every case is (mix, seed, pool, capacity, pp, offload, policy) with the analytic LLaMA3-8B / H100 model;
`StepPlan.digest()` hashes the whole plan JSON (rings, chunks, micro-batches, estimated times). Run it
on the commit before a refactor and on the one after: equal digests mean the planner's behaviour (every
policy, offload and pipeline included) did not move. Needs Megatron-Core for `megatron-hybrid-cp`.
"""

from __future__ import annotations

import argparse
import json
import sys

CASES = [
    (mix, seed, pool, capacity, pp, offload)
    for mix in ("byted", "github")
    for seed in (0, 1)
    for pool, capacity, pp, offload in ((8, 4096, 1, False), (16, 8192, 1, True), (8, 4096, 2, False))
]
POLICIES = ("balance", "naive", "static", "megatron-hybrid-cp")


def digests() -> dict[str, str]:
    """{case name: plan digest} over CASES x POLICIES (a policy that refuses a case records its error)."""
    import megatron_hdp.megatron  # noqa: F401  (registers the Megatron policies where they register)
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.plan.lengths import sample_global_batch
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.cost.presets import analytic_cost_model

    cost = analytic_cost_model("llama3-8b")
    out = {}
    for mix, seed, pool, capacity, pp, offload in CASES:
        lengths = sample_global_batch(mix, num_tokens=pool * capacity * 2, seed=seed, max_length=pool * capacity)
        config = HDPConfig(hdp=True, hdp_capacity=capacity, hdp_offload=offload)
        for policy in POLICIES:
            name = f"{mix}/seed{seed}/pool{pool}/C{capacity}/pp{pp}/offload{int(offload)}/{policy}"
            try:
                out[name] = make_plan(lengths, num_ranks=pool, config=config, cost_model=cost, pp_size=pp,
                                      policy=policy).digest()
            except ValueError as error:
                out[name] = f"ValueError: {error}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", help="JSON written by an earlier run; exit 1 if any digest differs")
    args = parser.parse_args()
    now = digests()
    if not args.compare:
        print(json.dumps(now, indent=1))
        return
    with open(args.compare) as f:
        before = json.load(f)
    changed = [name for name in sorted(set(before) | set(now)) if before.get(name) != now.get(name)]
    for name in changed:
        print(f"changed: {name}: {before.get(name)} -> {now.get(name)}")
    print(f"{len(now) - len(changed)}/{len(set(before) | set(now))} plans identical")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
