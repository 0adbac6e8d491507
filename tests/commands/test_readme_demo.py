"""The README's demo table shows the losses `make demo` (`megatron-hdp demo`) computes.

The demo's losses are deterministic (times are not): each policy trains its own model, built from the
seed, on the same global batches, and the loss is token-level, so it does not depend on the policy, the
number of ranks or the placement. The reference here trains the demo's model once on one gloo rank with
every document whole (capacity = the longest document), on the demo's corpus and global batches (read by
the HDP loader from the same flags), stepping the optimizer as the demo does: once per warm-up step, then
--timing-repeats times per reported step, whose loss is its first run's. Only the loss column is compared
(to its printed 4 decimals).
"""

import argparse
import re
from pathlib import Path

import pytest

from megatron_hdp.comm.launch import run_gloo

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_losses() -> dict[tuple[int, str], float]:
    """(step, policy) -> loss of the README's demo table."""
    text = README.read_text()
    table = text[text.index("step policy"):]
    table = table[: table.index("```")]
    rows = re.findall(r"^\s*(\d+) (\S+)\s+(\d+\.\d{4})\s", table, flags=re.MULTILINE)
    return {(int(step), policy): float(loss) for step, policy, loss in rows}


def _demo_losses(rank: int, world_size: int, spec) -> list[float]:
    """The loss of each reported step of the demo, trained on this one rank with every document whole."""
    import dataclasses

    from megatron_hdp.config import HDPConfig
    from megatron_hdp.harness.cpu_training import _build, planned_batches, silence_megatron_warnings
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.plan.cost.model import CostModel

    silence_megatron_warnings()
    state = initialize_hdp(seed=spec.seed)
    spec = dataclasses.replace(spec, capacity=spec.max_length)  # one rank: every document whole
    config = HDPConfig(hdp=True, hdp_capacity=spec.capacity, hdp_offload=False)
    cost_model = CostModel(a1=1e-8, b1=1e-5, g=3e-3, a2=1.0, b2=0.0, kv_bytes_per_token=256.0,
                           num_layers=spec.num_layers, ring_bandwidth=2e9)  # whole documents: any timing will do
    trainer = _build(spec, state)
    losses = []
    batches = planned_batches(spec, state, config, cost_model, "balance")
    for step, (plan, read_tokens) in enumerate(batches):
        runs = spec.timing_repeats if step >= spec.warmup_steps else 1
        first = [trainer.step(plan, read_tokens).loss for _ in range(runs)][0]
        if step >= spec.warmup_steps:
            losses.append(first)
    batches.close()
    return losses


@pytest.mark.timeout(600)
def test_readme_demo_losses_are_what_the_demo_computes(tmp_path):
    from megatron_hdp.commands.demo import add_arguments, demo_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data-dir", str(tmp_path)])  # the demo's defaults: what `make demo` runs
    shown = readme_losses()
    assert {policy for _, policy in shown} == set(args.policies) and len(shown) == args.steps * len(args.policies)
    losses = run_gloo(_demo_losses, 1, demo_spec(args), timeout_s=540)[0]
    for (step, policy), loss in shown.items():
        assert loss == pytest.approx(losses[step], abs=6e-5), (step, policy, losses)
