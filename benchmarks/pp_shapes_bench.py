"""Pipeline stages and HDP's variable micro-batch lengths: exchange each shape, or pad to the step's longest?

    python benchmarks/pp_shapes_bench.py                 # both parts, a few minutes on 2 shared cores
    python benchmarks/pp_shapes_bench.py --steps 3

An HDP micro-batch holds the tokens its plan packs, so the tensors between pipeline stages change length
from one micro-batch to the next. Megatron offers two ways to run that, compared here side by side:

- `variable`: `variable_seq_lengths=True`; every stage-to-stage send is preceded by its shape (3 int64,
  one extra small P2P exchange per transfer). What `install()` sets with PP > 1.
- `padded`: fixed shapes; every micro-batch of a pipeline padded to the step's longest micro-batch of
  that pipeline (its `seq_length`), including the empty micro-batches the runtime pads a pipeline with
  (`plan.timeline.timing.plan_runtime_counts`; each then costs a full-length forward and backward).

Part 1 (plans at scale, no timing): the LLaMA-70B PP 4 launch configuration (pool 32, --hdp-capacity 16K,
8M-token batches of the `byted` and `github` mixes, the analytic H100 cost model): per step, the tokens
every pipeline computes under `padded` over those under `variable` (the compute padding adds; attention
of a padding segment is not counted, so this is a lower bound), and the shape messages `variable` adds.
Part 2 (measured, CPU): 2 gloo ranks, PP = 2, a 4-layer GPT (hidden 256), the micro-batch lengths of
the median-padding pipeline of the first `byted` plan scaled by 1/64, Megatron's 1F1B schedule forward
and backward, both modes alternating step by step; wall seconds (slowest rank) and CPU seconds summed over the two ranks.
Results: benchmarks/results/pp_shapes_bench.json with the command and the date. `--repeat N` runs part 2
N times (a fresh pair of processes each; the ratio taken within each run) and reports median and range
over the runs (`repeats.py`); the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

from output import write_result
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement

RESULTS = Path(__file__).resolve().parent / "results" / "pp_shapes_bench.json"


def plan_padding(mix: str, *, steps: int, seed: int = 0) -> dict:
    """Part 1: padded/variable token ratio and shape messages per step, LLaMA-70B PP 4 pool 32 C 16K."""
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.plan.lengths import sample_global_batch
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.plan.timeline.timing import plan_runtime_counts

    pool, pp, capacity = 32, 4, 16384
    config = HDPConfig(hdp=True, hdp_capacity=capacity)
    cost = analytic_cost_model("llama-70b", tp_size=8)
    ratios, messages, lengths_example = [], [], None
    for step in range(steps):
        lengths = sample_global_batch(mix, num_tokens=8 * 2**20, seed=seed + step, max_length=pool * capacity)
        plan = make_plan(lengths, num_ranks=pool, config=config, cost_model=cost, pp_size=pp)
        per_rank = [[mb.num_tokens for mb in plan.microbatches(r)] for r in range(pool)]
        counts = plan_runtime_counts(plan)  # what each pipeline runs, its padding micro-batches included
        real = sum(sum(m) for m in per_rank)
        padded = sum(max(m, default=1) * count for m, count in zip(per_rank, counts))
        ratios.append(padded / real)
        messages.append(sum(counts) * 2 * (pp - 1))  # one shape message per activation and per gradient send
        if lengths_example is None:  # the pipeline of median padding, its empty micro-batches as 1 token
            order = sorted(range(pool), key=lambda r: max(per_rank[r], default=1) * counts[r] / max(sum(per_rank[r]), 1))
            median = order[pool // 2]
            lengths_example = per_rank[median] + [1] * (counts[median] - len(per_rank[median]))
    return {
        "mix": mix,
        "padded_over_variable_tokens": statistics.mean(ratios),
        "worst_step_ratio": max(ratios),
        "shape_messages_per_step": statistics.mean(messages),
        "example_pipeline_lengths": lengths_example,
    }


def _pipeline_rank(rank: int, world: int, lengths: list[int], steps: int) -> dict:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_hdp.harness.exactness import reference_forward_step
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training

    initialize_hdp(pipeline_model_parallel_size=2)
    config = tiny_llama_config(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                               ffn_hidden_size=512)
    model, _ = wrap_for_training(build_gpt(config, vocab_size=512, max_sequence_length=max(lengths) + 1, hdp=False))
    longest = max(lengths)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 512, n + 1) for n in lengths]

    def padded_forward_step(data_iterator, model):  # pad to `longest`: the padding tokens carry no loss
        from megatron_hdp.megatron.core_api.forward_step import token_loss

        raw = torch.from_numpy(next(data_iterator))
        n = len(raw) - 1
        tokens = torch.zeros(1, longest, dtype=torch.int64)
        labels = torch.zeros(1, longest, dtype=torch.int64)
        tokens[0, :n], labels[0, :n] = raw[:-1], raw[1:]
        mask = torch.zeros(longest)
        mask[:n] = 1
        output = model(input_ids=tokens, position_ids=torch.arange(longest)[None], attention_mask=None, labels=labels)
        return output, partial(token_loss, mask)

    times: dict[str, list[tuple[float, float]]] = {"variable": [], "padded": []}
    for step in range(steps + 1):  # the first round is a warm-up
        for mode in ("variable", "padded"):
            model.config.variable_seq_lengths = mode == "variable"
            torch.distributed.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            get_forward_backward_func()(
                forward_step_func=reference_forward_step if mode == "variable" else padded_forward_step,
                data_iterator=iter(docs), model=[model], num_microbatches=len(docs),
                seq_length=longest, micro_batch_size=1, forward_only=False,
            )
            if step:
                times[mode].append((time.perf_counter() - wall, time.process_time() - cpu))
            model.zero_grad_buffer()
    ps.destroy_model_parallel()
    return times


def measure(lengths: list[int], steps: int) -> dict:
    """Part 2, one run: both modes on 2 gloo ranks (PP = 2), taking turns step by step; median wall
    (slowest rank) and CPU (sum of ranks), and padded / variable CPU seconds."""
    from megatron_hdp.comm.launch import run_gloo

    ranks = run_gloo(_pipeline_rank, 2, lengths, steps, timeout_s=1200)
    out = {}
    for mode in ("variable", "padded"):
        walls = [max(r[mode][i][0] for r in ranks) for i in range(steps)]
        cpus = [sum(r[mode][i][1] for r in ranks) for i in range(steps)]
        out[mode] = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}
    out["padded_over_variable_cpu"] = out["padded"]["cpu_s"] / out["variable"]["cpu_s"]
    return out


def print_timed(timed: dict) -> None:
    """Part 2's table of one run, or of `repeats.over_runs`'s spread (median [min, max])."""
    print(f"{'mode':9} {'wall s':>24} {'cpu s':>24}")
    for mode in ("variable", "padded"):
        row = timed[mode]
        print(f"{mode:9} {format_spread(row['wall_s'], '{:.3f}'):>24} {format_spread(row['cpu_s'], '{:.3f}'):>24}")
    print(f"padded / variable CPU seconds: {format_spread(timed['padded_over_variable_cpu'], '{:.2f}')}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan-steps", type=int, default=4, help="planned global batches per mix (part 1)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mode (part 2)")
    parser.add_argument("--scale", type=int, default=64, help="part 2 divides part 1's lengths by this")
    add_repeat_argument(parser)
    args = parser.parse_args(argv)

    plans = [plan_padding(mix, steps=args.plan_steps) for mix in ("byted", "github")]
    print(f"{'mix':8} {'padded/variable tokens':>23} {'worst step':>11} {'shape msgs/step':>16}")
    for row in plans:
        print(f"{row['mix']:8} {row['padded_over_variable_tokens']:23.3f} {row['worst_step_ratio']:11.3f} "
              f"{row['shape_messages_per_step']:16.0f}")
    lengths = [max(1, n // args.scale) for n in plans[0]["example_pipeline_lengths"]]
    print(f"\nPP=2 on 2 gloo ranks, micro-batch lengths {lengths}")
    runs = repeat_measurement(lambda: measure(lengths, args.steps), args.repeat,
                              report=lambda _, timed: print_timed(timed))
    combined = over_runs(runs)
    if args.repeat > 1:
        print(f"\nover {args.repeat} runs: median [min, max]")
        print_timed(combined["spread"])
    write_result(RESULTS, {
        "command": "python benchmarks/pp_shapes_bench.py " + " ".join(argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "plans": plans,
        "measured": {"lengths": lengths, **combined},
    })


if __name__ == "__main__":
    main(sys.argv[1:])
