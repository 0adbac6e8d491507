"""The demo/bench driver on 2 gloo ranks: busy-time measurement premise, rows, exactness across policies."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.harness.cpu_training import CpuRunSpec, train_policies
from megatron_hdp.plan.cost.model import CostModel

SPEC = CpuRunSpec(
    policies=("balance", "static", "megatron-hybrid-cp"), steps=1, warmup_steps=0, capacity=128, tokens_per_step=1024, max_length=256,
    num_layers=1, fit_lengths=(32, 64, 128, 256), fit_repeats=1, timing_repeats=2,
)


def _rank(rank: int, world_size: int, spec: CpuRunSpec) -> dict:
    # The premise of the dedicated-core step time: a rank blocked in a gloo wait uses no CPU. Rank 0
    # waits 2 s for rank 1 in each of a recv, a batch_isend_irecv, a barrier and an all-reduce.
    buffer = torch.zeros(4)
    wait_cpu = {}
    for name in ("recv", "batch_isend_irecv", "barrier", "all_reduce"):
        dist.barrier()
        if rank == 1:
            time.sleep(2.0)
        start = time.process_time()
        if name == "recv":
            dist.send(buffer, 0) if rank == 1 else dist.recv(buffer, 1)
        elif name == "batch_isend_irecv":
            ops = [dist.P2POp(dist.isend, buffer, 1 - rank), dist.P2POp(dist.irecv, torch.zeros(4), 1 - rank)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        elif name == "barrier":
            dist.barrier()
        else:
            dist.all_reduce(buffer)
        wait_cpu[name] = time.process_time() - start
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_policies(rank, world_size, spec)
    megatron_warnings = sorted({f"{w.filename}: {w.message}" for w in caught if "/megatron/core/" in w.filename})
    return {"wait_cpu": wait_cpu, "result": result, "megatron_warnings": megatron_warnings}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_gloo(_rank, 2, SPEC, timeout_s=240)


def test_blocked_gloo_wait_uses_no_cpu(ranks) -> None:
    """benchmarks/README.md: a 2 s blocked wait costs < 25 ms of process time, about 1% of a busy wait's 2 s
    (2-3 ms measured at a load average of 58 on the 2-core host, up to 11 ms in a CI run beside other work)."""
    assert all(seconds < 0.025 for seconds in ranks[0]["wait_cpu"].values()), ranks[0]["wait_cpu"]


def test_megatron_warnings_silenced(ranks) -> None:
    assert [r["megatron_warnings"] for r in ranks] == [[], []]


def test_rows(ranks) -> None:
    rows = {row["policy"]: row for row in ranks[0]["result"]["rows"]}
    assert sorted(rows) == ["balance", "megatron-hybrid-cp", "static"] and ranks[1]["result"]["rows"] == []
    # same batch, same initial weights: the first step's token-level loss does not depend on the plan, nor
    # on Megatron's Hybrid-CP execution (one pass per sub-sample, empty slots run as padding)
    assert rows["balance"]["loss"] == pytest.approx(rows["static"]["loss"], rel=1e-5)
    assert rows["balance"]["loss"] == pytest.approx(rows["megatron-hybrid-cp"]["loss"], rel=1e-5)
    assert rows["static"]["num_rings"] > 0  # the batch has documents longer than C
    for row in rows.values():
        per_rank = row["per_rank"]
        busy = [b + c + a for b, c, a in zip(per_rank["before"], per_rank["compute"], per_rank["after"])]
        assert row["max_busy_time"] == pytest.approx(max(busy))
        # the replayed step is at least the busiest rank's own work, and rings only add waits
        assert row["step_time"] >= row["max_busy_time"] - 1e-9
        assert 0 < row["predicted_time"] and 0 < row["wall_time"]
        assert row["predicted_time"] == row["predicted_time_in_run_fit"]  # no cost model from outside
        assert row["predicted_time_without_alltoall"] == row["predicted_time"]  # dense: no all-to-all term
        assert len(per_rank["predicted_compute"]) == 2


def test_ring_probe_rescales_only_the_ring_coefficients() -> None:
    """A round whose ring probe moved 1.5x while the speed probe moved 1.2x predicts with the fit's ring
    latency and block overhead x 1.25 (1.5 / 1.2), then scales the whole step by 1.2; without a ring
    probe on either side only the speed factor applies; a plan without rings is untouched by it."""
    import dataclasses

    from megatron_hdp.harness.cpu_training import _predicted_time
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.sim.simulator import PolicyRules, simulate_step

    model = CostModel(a1=1e-8, b1=1e-5, g=3e-3, a2=1.0, b2=0.0, kv_bytes_per_token=256.0, num_layers=2,
                      ring_bandwidth=2e9, ring_latency=1e-3, ring_block_overhead=4e-5)
    ringed = plan_from_rings([512, 64, 64], [(0, 1), (0,), (1,)], [0, 1, 1], num_ranks=2, capacity=256)
    whole = plan_from_rings([64, 64], [(0,), (1,)], [0, 0], num_ranks=2, capacity=256)
    fit = {"model": model, "allreduce_bandwidth": 1e9, "step_overhead": 0.01, "speed_probe": 0.02,
           "ring_probe": 0.04}
    now = {"speed_probe": 0.024, "ring_probe": 0.06}
    scaled = dataclasses.replace(model, ring_latency=1.25e-3, ring_block_overhead=5e-5)
    for plan in (ringed, whole):
        by_hand = simulate_step(plan, scaled, grad_bytes=0, allreduce_bandwidth=1e9, rules=PolicyRules())
        _, predicted, speed = _predicted_time("balance", plan, grad_bytes=0, now=now, **fit)
        assert speed == pytest.approx(1.2)
        assert predicted == pytest.approx((by_hand.step_time + 0.01) * 1.2)
        plain = simulate_step(plan, model, grad_bytes=0, allreduce_bandwidth=1e9, rules=PolicyRules())
        _, unringed, _ = _predicted_time("balance", plan, grad_bytes=0, now=now, **{**fit, "ring_probe": None})
        assert unringed == pytest.approx((plain.step_time + 0.01) * 1.2)
    assert _predicted_time("balance", ringed, grad_bytes=0, now=now, **fit)[1] > \
        _predicted_time("balance", ringed, grad_bytes=0, now=now, **{**fit, "ring_probe": None})[1]


def test_moe_fit_charges_the_alltoall_and_takes_it_off_the_expert_share() -> None:
    """The CPU fit of a MoE model carries the all-to-all's bytes: the tiny model routes top-2 copies of its
    fp32 hidden state (64) in every layer, 4 x 64 x 2 B per token, and a dense one none. The expert share
    read from a lead-only EP group charges every member A per token of the lead (the cost model's rule):
    slopes made by hand from a planted x = 0.6, b1 = 30 us, A = 2 us at EP 4 give x back, and with A
    left out the all-to-all is folded into x as before issue 41, e dv / dlinear."""
    from megatron_hdp.harness.cpu_fit import expert_share, routed_bytes_per_token

    assert routed_bytes_per_token(CpuRunSpec(num_experts=4, ep_size=2)) == 4 * 64 * 2
    assert routed_bytes_per_token(CpuRunSpec()) == 0
    x, b1, alltoall, e = 0.6, 30e-6, 2e-6, 4
    dv, dlinear = x * b1 / e + alltoall, b1 + e * alltoall  # the others' slope, the group's less attention
    assert expert_share([(dv, dlinear)] * 2, ep_size=e, alltoall=alltoall) == pytest.approx(x, rel=1e-12)
    assert expert_share([(dv, dlinear)], ep_size=e) == pytest.approx(e * dv / dlinear, rel=1e-12)
    assert expert_share([(dv, dlinear), (-dv, dlinear), (dv, -dlinear)], ep_size=e, alltoall=alltoall) == 0.0
