"""CUDA/NCCL code paths on this CPU machine, through the fake-GPU harness (`tests/fake_gpu.py`).

Each scenario runs in a process of its own (the harness must load its CUDA guard before torch is imported,
and it patches torch.cuda for the life of the process), forked from one interpreter that imported torch and
Megatron once for the module (`tests/fake_gpu_server.py`). What they catch, before the fix of each:
* issue 13 fault 1: a micro-batch left on the host fed to a CUDA model (`FakeTensorDeviceMismatchError`
  in the embedding);
* fault 2: the step statistics mixing CPU and CUDA tensors / CPU tensors in NCCL collectives;
* fault 7: a host sync (`.item()`) inside a layer (RoPE table size), and a blocking host-to-device copy
  of cu_seqlens inside every layer;
* fault 8: a ring's P2P as the first NCCL operation of the default group;
* issue 21 item 1: FP8 delayed scaling at PP=1, where TE all-reduces amaxes over TP x DP twice per
  micro-batch and HDP ranks run different numbers of micro-batches (rank 0 posted 8 all-reduces on the
  amax group, rank 1 four);
* issue 21 item 7: blocking copies of small tables (cu_seqlens per local group and ring plan, ring
  row indices, the MoE loss's lengths and z-loss mask in every MoE layer) between a micro-batch's own
  non-blocking transfer and its backward (`fake_gpu.blocking_copies_in_microbatches`);
* the `install()` path (`install_step`): micro-batches handed to Megatron's schedule from pageable
  memory, ring plans (cu_seqlens, row indices) first copied to the GPU inside a layer whenever the
  documents change, and the telemetry gather putting a CPU tensor into an NCCL all-gather;
* multi-token prediction (`hdp_step` at PP=1): the MTP layer's attention on the ring, its rolls answered
  from the micro-batch's own (pinned, non-blocking) tensors, Megatron's MTP loss and log on the device;
* sliding windows (`window_ring`, 4 played ranks, P2P matched across them by `fake_gpu.p2p_problems`):
  flex's window mask copying each ring piece's shifts from the host inside the first windowed layer;
  the same scenario carries learnable attention sinks (gpt-oss's attention) on every ring and kernel;
* multi-token prediction with learnable sinks together (`hdp_step 1 RANK 1 sinks`), and with multi-latent
  attention (`hdp_step 1 0 1 mla`): DeepSeek-V3's MLA and MTP with a learnable sink and core-attention
  recompute, a K/V ring, then a latent ring, on CUDA tensors;
* the post-training door (issue 39: `posttrain_door`, `PostTrainer`'s forward and train step): the
  forward's results picked from the device by a boolean mask (a data-dependent nonzero, a host sync in
  every micro-batch), and blocking copies inside every micro-batch of the token count and of the
  per-sample sums' tables (each token's slot, each ring's slots).
"""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parents[1]  # tests/, where fake_gpu.py and its scenarios live
ROOT = HERE.parent


@pytest.fixture(scope="module")
def guard_library() -> Path:
    sys.path.insert(0, str(HERE))
    import fake_gpu

    try:
        return fake_gpu.build_guard_library()
    except Exception as err:  # no C++ compiler: the harness cannot run here
        pytest.skip(f"cannot build the fake CUDA guard ({type(err).__name__}): {err}")


@pytest.fixture(scope="module")
def server(guard_library, tmp_path_factory):
    """The interpreter that imports torch and Megatron once; each scenario runs in a process forked from
    it (`tests/fake_gpu_server.py`), as alone as in a fresh interpreter."""
    from fake_gpu_server import FakeGpuServer

    server = FakeGpuServer(guard_library, tmp_path_factory.mktemp("fake_gpu"))
    yield server
    server.close()


def _checked(returncode: int, output: str) -> str:
    lines = [line for line in output.splitlines() if not line.startswith("frame #")]
    assert returncode == 0, "\n".join(lines[-40:])
    return output


def _run(server, scenario: str, *args: str) -> str:
    return _run_ranks(server, scenario, [args], timeout_s=600)[0]


RANKS = ("0", "1")
"""The played ranks of the 2-rank scenarios. Each process plays its rank alone (its peers' collectives
answered by the harness), so a world's ranks run at once: on 2 cores that halves their wall time."""


def _run_ranks(server, scenario: str, args: list[tuple[str, ...]], timeout_s: float = 300) -> list[str]:
    """`scenario` with each argument tuple at once, one process each (the ranks of one played world):
    their outputs, in order; every process is ended by the timeout."""
    return [_checked(*result) for result in server.run([(scenario, *a) for a in args], timeout_s=timeout_s)]


def test_harness_enforces_nccl_and_device_rules(server):
    assert "scenario harness_rules: ok" in _run(server, "harness_rules")


@pytest.mark.parametrize("pp_size,mtp_depth,attention", [("1", "1", "sinks"), ("2", "0", "")])
def test_hdp_step_on_fake_gpu(server, pp_size, mtp_depth, attention):
    """Two HDP steps as each global rank of 2 (both played at once) of a bf16 GPTModel with the HDP spec, torch varlen
    attention, activation offloading, Megatron DDP and optimizer: PP=1 (HDP rank of 2, a ring over both
    ranks and whole documents, with gpt-oss's learnable attention sinks and a multi-token prediction layer
    attending on the same ring, its rolls from the micro-batch: MTP and sinks together) and PP=2 (one
    pipeline stage). No blocking host-to-device copy between a micro-batch's own transfer and its backward
    (issue 21 item 7: cu_seqlens, ring row indices)."""
    for output in _run_ranks(server, "hdp_step", [(pp_size, rank, mtp_depth, attention) for rank in RANKS]):
        assert "of micro-batch tensors (pinned, non-blocking)" in output
        assert ("rolls answered from the micro-batches" in output) == (mtp_depth != "0")


def test_multi_latent_attention_step_on_fake_gpu(server):
    """`test_hdp_step_on_fake_gpu`'s PP=1 rank 0 (a ring and whole documents) with DeepSeek-V3's attention
    and MTP: multi-latent attention with YaRN (HDP's MLA module, RoPE angles of the micro-batch's
    positions, made in its first layer; V narrower than q and k through torch varlen, padded), the K/V
    ring in the first step and the latent ring (up-projection of received latents, latent gradients sent
    back; its latent through the core-attention checkpoint's arguments, the sink after its merge) in the
    second, and a multi-token prediction layer of MLA, with a learnable sink and `--recompute-modules
    core_attn`, on CUDA tensors under NCCL's rules, no host sync or blocking copy inside a layer or a
    micro-batch."""
    output = _run(server, "hdp_step", "1", "0", "1", "mla")
    assert "of micro-batch tensors (pinned, non-blocking)" in output
    assert "rolls answered from the micro-batches" in output


def test_virtual_pipeline_step_on_fake_gpu(server):
    """Two HDP steps as each PP stage of 2 with 2 virtual pipeline stages: model chunks on "cuda", a DDP
    and an offloader per chunk, Megatron's interleaved schedule with overlapped P2P."""
    for output in _run_ranks(server, "hdp_step_vpp", [(rank,) for rank in RANKS]):
        assert "micro-batch copies (pinned, non-blocking) over 2 chunks" in output


def test_moe_router_losses_on_fake_gpu(server):
    """HDP's MoE routers (per-document load-balancing loss and z-loss) of three layers over a plan's
    micro-batches, forward and backward: no blocking host-to-device copy between a micro-batch's transfer
    and its backward (issue 21 item 7: the documents' lengths and the z-loss padding mask, every layer)."""
    for output in _run_ranks(server, "moe_routers", [(rank,) for rank in RANKS]):
        assert "none blocking" in output


def test_host_sync_inside_a_layer_is_caught(server):
    """The README says the harness catches a host sync inside a layer: `.item()` in a TransformerLayer's
    forward and in a backward raise `HostSyncInLayer`; outside a layer it passes (recorded); `.cpu()` too."""
    assert "scenario host_sync_rule: ok" in _run(server, "host_sync_rule")


def test_first_nccl_operation_is_not_a_ring(server):
    """initialize_hdp on 4 ranks, then ring attention among ranks 0 and 1."""
    assert "scenario first_p2p: ok" in _run(server, "first_p2p", "4")


def test_megatron_install_path_on_fake_gpu(server):
    """What install() wires into megatron.training, called as train() calls it, as each HDP rank of 2:
    the HDP loader over an indexed dataset, two steps through the patched get_forward_backward_func
    (Megatron's schedule, offloading, finalize timed by the telemetry), then the patched training_log
    (hdp_statistics, the measured telemetry gathered over the HDP domain; the last rank prints it)."""
    outputs = _run_ranks(server, "install_step", [(rank,) for rank in RANKS])
    assert all("micro-batch copies (pinned, non-blocking)" in output for output in outputs)
    # the last rank prints the telemetry; CUDA events are read one step late
    assert " [HDP measured] iteration        1 |" in outputs[-1]


FP8_RUNS = [("delayed", "0"), ("delayed", "1"), ("tensorwise", "0")]


@pytest.mark.parametrize("recipe,tp_only", FP8_RUNS, ids=["delayed", "delayed-tp-only-amax", "tensorwise"])
def test_ranks_with_different_microbatch_counts_post_the_same_collectives(server, tmp_path, recipe, tp_only):
    """Two played HDP ranks of one world (rank 0 runs two micro-batches, rank 1 one) with Megatron's FP8
    and TE's amax reductions stood in for (`fake_te_fp8`): on every communicator both belong to, they
    post the same collectives in the same order with the same sizes (NCCL pairs the n-th collective of
    each member); P2P (the ring) is left out. A configuration that cannot meet this is refused on both."""
    import json

    logs_at = [tmp_path / f"rank{rank}.json" for rank in RANKS]
    _run_ranks(server, "fp8_collectives",
               [(rank, recipe, tp_only, str(log)) for rank, log in zip(RANKS, logs_at)])
    results = [json.loads(log.read_text()) for log in logs_at]
    if "refused" in results[0] or "refused" in results[1]:
        assert all("--fp8-recipe delayed" in r.get("refused", "") for r in results), results
        return
    logs = [r["log"] for r in results]
    shared = sorted(set(logs[0]) & set(logs[1]))
    assert any(key.startswith("0,1#") for key in shared), f"no communicator of both ranks: {shared}"
    for key in shared:
        assert logs[0][key] == logs[1][key], f"communicator {key}: rank 0 posted {logs[0][key]}, rank 1 {logs[1][key]}"


def test_windowed_rings_post_matching_p2p_on_fake_gpu(server, tmp_path):
    """gpt-oss's attention: a learnable sink on both layers (`softmax_type="learnable"`, applied after each
    ring's merge, its parameter's gradient reduced with the others) and a causal sliding window (Megatron's
    `window_size=(12, 0)` on layer 1, layer 2 full) under HDP, two
    steps as each of 4 played ranks (`fake_gpu_scenarios.window_ring`): a ring over all 4 ranks whose
    window reaches two of the three other positions' K/V (direct sends, `RingPlan.direct`), a ring over 3
    in another order, whole documents. Inside each rank: no CPU tensor in NCCL, no host sync or blocking
    copy inside a layer, none between a micro-batch's transfer and its backward. Across the ranks: every
    P2P send meets its receive in order with the same size and dtype, every rank's NCCL group calls
    complete (no deadlock), and all ranks post the same collectives on the communicators they share."""
    import json

    import fake_gpu
    from fake_gpu_scenarios import WINDOW_WORLD

    paths = [tmp_path / f"rank{rank}.json" for rank in range(WINDOW_WORLD)]
    _run_ranks(server, "window_ring", [(str(rank), str(path)) for rank, path in enumerate(paths)])
    logs = [json.loads(path.read_text()) for path in paths]
    world = ",".join(map(str, range(WINDOW_WORLD))) + "#0"  # the default group: the rings' communicator
    assert set().union(*(log["p2p"] for log in logs)) == {world}, [list(log["p2p"]) for log in logs]
    problems = fake_gpu.p2p_problems({rank: log["p2p"][world] for rank, log in enumerate(logs)})
    assert not problems, "\n".join(problems)
    # the windowed ring's hop of 2 (position 3 -> 1 of ring 0,1,2,3): only a direct plan sends there
    assert any(op[:2] == ["send", 1] for call in logs[3]["p2p"][world] for op in call), "no direct send 3 -> 1"
    shared = set(logs[0]["collectives"]).intersection(*(log["collectives"] for log in logs[1:]))
    assert world in shared
    for key in shared:
        posted = [log["collectives"][key] for log in logs]
        assert all(p == posted[0] for p in posted), f"communicator {key}: {posted}"


def test_posttrain_door_on_fake_gpu(server, tmp_path):
    """`PostTrainer` as each of 2 played HDP ranks (`fake_gpu_posttrain.posttrain_door`): forward-only
    log-probs gathered to the host and a train step whose `loss_fn` reads the plan's response mask and sums
    per sample across a ring, for a batch with a ring over both ranks and one where rank 1 is idle (a
    padding micro-batch). Inside each rank: no host sync or blocking copy inside a layer, none between a
    micro-batch's transfer and its backward. Across the ranks: every P2P send meets its receive, and the
    idle rank posts the same collectives as the busy one."""
    import json

    import fake_gpu

    paths = [tmp_path / f"rank{rank}.json" for rank in RANKS]
    outputs = _run_ranks(server, "posttrain_door", [(rank, str(path)) for rank, path in zip(RANKS, paths)])
    assert all("micro-batch copies (pinned, non-blocking)" in output for output in outputs)
    logs = [json.loads(path.read_text()) for path in paths]
    world = "0,1#0"  # the default group: the rings' communicator
    assert all(log["p2p"].get(world) for log in logs), "no ring P2P (the per-sample sums and attention)"
    problems = fake_gpu.p2p_problems({rank: log["p2p"][world] for rank, log in enumerate(logs)})
    assert not problems, "\n".join(problems)
    shared = set(logs[0]["collectives"]) & set(logs[1]["collectives"])
    assert world in shared
    for key in shared:
        assert logs[0]["collectives"][key] == logs[1]["collectives"][key], f"communicator {key}"


def test_p2p_rules_catch_what_nccl_would_not_survive():
    """`fake_gpu.p2p_problems` on hand-written logs of 3 ranks: a ring step (each rank one group call
    sending to the next and receiving from the previous) passes; a receive of another size or dtype, a
    send without a receive, and two ranks each waiting for the other's second call are reported."""
    sys.path.insert(0, str(HERE))
    import fake_gpu

    def step(rank, numel=8, dtype="bfloat16"):
        return [["send", (rank + 1) % 3, 8, "bfloat16"], ["recv", (rank - 1) % 3, numel, dtype]]

    assert fake_gpu.p2p_problems({r: [step(r), step(r)] for r in range(3)}) == []
    assert "8 bfloat16 sent, 8 float32 received" in fake_gpu.p2p_problems(
        {0: [step(0, dtype="float32")], 1: [step(1)], 2: [step(2)]})[0]
    assert "8 bfloat16 sent, 4 bfloat16 received" in fake_gpu.p2p_problems(
        {0: [step(0)], 1: [step(1, numel=4)], 2: [step(2)]})[0]
    assert "rank 0 posts 2 sends to rank 1, rank 1 1 receives" in fake_gpu.p2p_problems(
        {0: [step(0), [["send", 1, 8, "bfloat16"]]], 1: [step(1)], 2: [step(2)]})[0]
    crossed = {0: [[["send", 1, 8, "bfloat16"]], [["recv", 1, 8, "bfloat16"]]],
               1: [[["send", 0, 8, "bfloat16"]], [["recv", 0, 8, "bfloat16"]]]}  # both send first: each waits
    problems = fake_gpu.p2p_problems(crossed)
    assert [p.split(" waits")[0] for p in problems] == [f"deadlock: rank {r}'s NCCL group call #0" for r in (0, 1)]
