"""The MoE all-to-all's rate fitted alone on gloo against the dispatcher's own calls inside a CPU MoE step.

    python benchmarks/alltoall_in_step.py                 # EP 2 and 4 on 4 ranks, 3 runs each

`cpu_fit.measure_alltoall` fits the cost model's all-to-all term (a rate per crossing byte and a
per-call latency, which the fit leaves in g) from `all_to_all_single` timed alone. This checks it inside
the runtime's own step: the tiny MoE model of step_bench (4 experts, top-2), every rank one document of
t tokens (256, then 1,024), each of the hidden states' all-to-alls Megatron's alltoall dispatcher makes
(dispatch and combine, forward and backward: 8 in 2 layers) timed in CPU seconds by a wrapper around
`torch.distributed.all_to_all_single`, fewest over 3 steps. Reported per run: how much more the calls
took at 1,024 tokens than at 256 against what the standalone rate predicts for the bytes each rank sent
(the slope ratio: 1 where the per-byte term holds), and how much more each call took at 256 tokens than
the standalone latency plus bytes (the per-call cost the fit leaves in g), medians over ranks.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.harness import cpu_fit, cpu_training
from output import finish

TOKENS = (256, 1024)


def _rank(rank: int, world_size: int, ep_size: int) -> dict:
    """(measured s, predicted s) of this rank's hidden-state all-to-alls of one step per t of `TOKENS`."""
    from megatron_hdp.harness.exactness import token_reader
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.plan.hand_plan import plan_from_rings

    cpu_training.silence_megatron_warnings()
    spec = cpu_training.CpuRunSpec(num_experts=4, ep_size=ep_size, capacity=max(TOKENS), max_length=max(TOKENS))
    trainer = cpu_training._build(spec, initialize_hdp(seed=0, expert_model_parallel_size=ep_size))
    rate, latency = cpu_fit.measure_alltoall(trainer, spec)
    calls = []
    original = torch.distributed.all_to_all_single

    def timed(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        start = time.process_time()
        work = original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        seconds = time.process_time() - start
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        me, n = dist.get_rank(group), dist.get_world_size(group)
        splits = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
        if row_bytes > 16:  # the hidden states, not the routing probabilities (one value a copy)
            calls.append((seconds, latency + sum(s for i, s in enumerate(splits) if i != me) * row_bytes / rate))
        return work

    torch.distributed.all_to_all_single = timed
    out = {}
    try:
        for tokens in TOKENS:
            plan = plan_from_rings([tokens] * world_size, [(r,) for r in range(world_size)], [0] * world_size,
                                   num_ranks=world_size, capacity=tokens)
            best = None
            for repeat in range(4):  # one untimed step, then the fewest of 3
                calls.clear()
                trainer.step(plan, token_reader(0, plan.lengths))
                measured, predicted = map(sum, zip(*calls))
                if repeat and (best is None or measured < best[0]):
                    best = (measured, predicted, len(calls))
            out[tokens] = best
    finally:
        torch.distributed.all_to_all_single = original
    return {"rate": rate, "latency": latency, "calls": out}


def summarize(ranks: list[dict], ep_size: int) -> dict:
    """The run's figures (module doc), medians over ranks."""
    small, big = TOKENS
    measured = {t: statistics.median(r["calls"][t][0] for r in ranks) for t in TOKENS}
    predicted = {t: statistics.median(r["calls"][t][1] for r in ranks) for t in TOKENS}
    num_calls = ranks[0]["calls"][small][2]
    return {"ep": ep_size, "rate": ranks[0]["rate"], "latency": ranks[0]["latency"], "calls_per_step": num_calls,
            "measured_s": measured, "predicted_s": predicted,
            "slope_ratio": (measured[big] - measured[small]) / (predicted[big] - predicted[small]),
            "per_call_excess_s": (measured[small] - predicted[small]) / num_calls}


def table(rows: list[dict]) -> str:
    """The runs as a markdown table."""
    lines = ["| EP | run | rate GB/s | latency us | calls | slope ratio | per-call excess us |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['ep']} | {r['run']} | {r['rate'] / 1e9:.2f} | {r['latency'] * 1e6:.0f} | {r['calls_per_step']} | "
              f"{r['slope_ratio']:.2f} | {r['per_call_excess_s'] * 1e6:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", default="2,4", help="expert-parallel sizes")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", default="benchmarks/results/alltoall_in_step.json")
    args = parser.parse_args(argv)
    rows = []
    for run in range(args.runs):
        for ep in map(int, args.ep.split(",")):
            rows.append({"run": run + 1, **summarize(run_gloo(_rank, args.ranks, ep, timeout_s=600), ep)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    result = {"command": "python benchmarks/alltoall_in_step.py " + " ".join(argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": rows}
    finish(table(rows), result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
