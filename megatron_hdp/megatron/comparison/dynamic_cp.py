"""Policy `megatron-dynamic-cp`: Megatron-LM's dev-branch Dynamic CP scheduler, expressed as a StepPlan.

Megatron-LM's dev branch schedules packed variable-length batches with
`megatron.core.datasets.data_schedule.DefaultDynamicCPScheduler` (`--dynamic-context-parallel`). Per
micro-batch it gives every rank of the DP x CP pool exactly one CP group of a power-of-two size (at least
the next power of two of L / C, larger when that lowers the slowest rank's L^2 / cp workload), packs
sequences into a group while each member holds <= C tokens, and fills idle ranks by widening groups; all
ranks run the same number of micro-batches (a pipeline schedule needs that), rounded up to a multiple
of `microbatch_group_size_per_vp_stage` under VPP (`align_sample_id_groups`). Each micro-batch is one
forward/backward pass of the packed THD batch; no barrier between micro-batches beyond the CP rings.

Its code is not in the installed megatron-core (0.19.2), and it imports parts of megatron.core newer than
that, so it cannot run in this process next to the installed `megatron`. The least invasive way found:
a child process (`dynamic_cp_worker.py`, started once per checkout and kept) whose PYTHONPATH is the
checkout named by MEGATRON_LM_DIR, so it imports the checkout's whole `megatron` package with this
environment's torch, and calls the scheduler the way Megatron's `wrap_data_iterator` does. Nothing is
re-implemented here; without MEGATRON_LM_DIR, or with a checkout that lacks the scheduler, planning
raises one ValueError saying so (`plan`, `simulate` and `plan_bench` then show the policy as n/a).

Megatron's answer, `sample_id_groups[j][rank]` -> ids, becomes rings and per-rank micro-batches as the
Hybrid-CP adapter's does (`megatron.comparison.scheduler_groups.rings_and_schedule`): micro-batch j of the plan on every
rank = Megatron's micro-batch j, rings with zigzag chunks. Times come from `assemble_plan`, like every
policy's.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.timeline.assemble import assemble_plan
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.megatron.comparison.scheduler_groups import check_pool_holds, rings_and_schedule
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)

POLICY = "megatron-dynamic-cp"
CHECKOUT_VARIABLE = "MEGATRON_LM_DIR"
WORKER = Path(__file__).with_name("dynamic_cp_worker.py")


class _Worker:
    """The child process that holds the checkout's scheduler; one JSON request and reply per line."""

    def __init__(self, checkout: str) -> None:
        env = {**os.environ, "PYTHONPATH": checkout, CHECKOUT_VARIABLE: checkout}
        # Run by path through `-c`, in the checkout: sys.path starts with the checkout, never with the
        # worker's own directory (megatron_hdp/megatron holds a datasets.py) or the caller's directory.
        command = [sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')",
                   str(WORKER)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, env=env, cwd=checkout)
        atexit.register(self.close)
        hello = self._read()
        if "error" in hello:
            self.close()
            raise ValueError(f"policy {POLICY}: cannot import DefaultDynamicCPScheduler from {CHECKOUT_VARIABLE}="
                             f"{checkout} ({hello['error']}); point {CHECKOUT_VARIABLE} at a Megatron-LM dev checkout")
        self.megatron_core: str = hello["megatron_core"]

    def _read(self) -> dict:
        line = self._process.stdout.readline()
        if not line:
            raise ValueError(f"policy {POLICY}: the scheduler process exited (code {self._process.poll()})")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=30)


@functools.cache
def _worker(checkout: str) -> _Worker:
    return _Worker(checkout)


def scheduler_checkout() -> str:
    """The Megatron-LM checkout named by MEGATRON_LM_DIR; ValueError when there is none."""
    checkout = os.environ.get(CHECKOUT_VARIABLE)
    if not checkout:
        raise ValueError(f"policy {POLICY} needs a Megatron-LM dev checkout: set {CHECKOUT_VARIABLE} "
                         f"(Megatron's DefaultDynamicCPScheduler is not in the installed megatron-core)")
    if not os.path.isdir(os.path.join(checkout, "megatron", "core")):
        raise ValueError(f"policy {POLICY}: {CHECKOUT_VARIABLE}={checkout} holds no megatron/core; "
                         f"point it at a Megatron-LM dev checkout")
    return os.path.realpath(checkout)


def megatron_dynamic_cp_schedule(
    lengths: Sequence[int],
    *,
    num_ranks: int,
    capacity: int,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    min_cp_size: int = 1,
) -> list[list[list[int]]]:
    """Megatron's raw answer: `sample_id_groups[micro-batch][rank]` -> sample ids (ids = positions in
    `lengths`), from the checkout's `DefaultDynamicCPScheduler.get_groups_and_subsamples`."""
    reply = _worker(scheduler_checkout()).ask({
        "lengths": [int(n) for n in lengths], "num_ranks": int(num_ranks), "capacity": int(capacity),
        "microbatch_group_size_per_vp_stage": microbatch_group_size_per_vp_stage, "min_cp_size": int(min_cp_size),
    })
    if "error" in reply:
        raise ValueError(f"policy {POLICY}: Megatron's scheduler refused the batch ({reply['error']})")
    return reply["groups"]


def plan_megatron_dynamic_cp(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int,
    vpp_size: int = 1,
) -> StepPlan:
    """Plan a global batch with Megatron's `DefaultDynamicCPScheduler` (see the module docstring).

    With `vpp_size` > 1 the scheduler aligns the micro-batch count as Megatron does under VPP, to a
    multiple of `microbatch_group_size_per_vp_stage`, whose Megatron default is the pipeline size.
    """
    capacity = config.hdp_capacity
    check_pool_holds(lengths, num_ranks=num_ranks, capacity=capacity)
    groups = megatron_dynamic_cp_schedule(lengths, num_ranks=num_ranks, capacity=capacity,
                                          microbatch_group_size_per_vp_stage=pp_size if vpp_size > 1 else None)
    rings, schedule = rings_and_schedule(groups, num_ranks=num_ranks, num_sequences=len(lengths))
    logger.debug("%s: %d micro-batches for %d sequences on %d ranks", POLICY, len(groups), len(lengths), num_ranks)
    return assemble_plan(policy=POLICY, lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                         vpp_size=vpp_size)
