"""CUDA/NCCL code paths on this CPU machine, through the fake-GPU harness (`tests/fake_gpu.py`).

Each scenario runs in a fresh interpreter (the harness must load its CUDA guard before torch is imported,
and it patches torch.cuda for the life of the process). What they catch, before the fix of each:
* issue 13 fault 1: a micro-batch left on the host fed to a CUDA model (`FakeTensorDeviceMismatchError`
  in the embedding);
* fault 2: the step statistics mixing CPU and CUDA tensors / CPU tensors in NCCL collectives;
* fault 7: a host sync (`.item()`) inside a layer (RoPE table size), and a blocking host-to-device copy
  of cu_seqlens inside every layer;
* fault 8: a ring's P2P as the first NCCL operation of the default group;
* the `install()` path (`install_step`): micro-batches handed to Megatron's schedule from pageable
  memory, ring plans (cu_seqlens, row indices) first copied to the GPU inside a layer whenever the
  documents change, and the telemetry gather putting a CPU tensor into an NCCL all-gather.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent


@pytest.fixture(scope="module")
def guard_library() -> Path:
    sys.path.insert(0, str(HERE))
    import fake_gpu

    try:
        return fake_gpu.build_guard_library()
    except Exception as err:  # no C++ compiler: the harness cannot run here
        pytest.skip(f"cannot build the fake CUDA guard ({type(err).__name__}): {err}")


def _run(library: Path, scenario: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, str(HERE / "fake_gpu.py"), str(library), scenario, *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if not line.startswith("frame #")]
    assert result.returncode == 0, "\n".join(lines[-40:])
    return output


def test_harness_enforces_nccl_and_device_rules(guard_library):
    assert "scenario harness_rules: ok" in _run(guard_library, "harness_rules")


@pytest.mark.parametrize("pp_size,rank", [("1", "0"), ("1", "1"), ("2", "0"), ("2", "1")])
def test_hdp_step_on_fake_gpu(guard_library, pp_size, rank):
    """Two HDP steps as global rank `rank` of 2 of a bf16 GPTModel with the HDP spec, torch varlen
    attention, activation offloading, Megatron DDP and optimizer: PP=1 (HDP rank of 2, a ring over both
    ranks and whole documents) and PP=2 (one pipeline stage)."""
    output = _run(guard_library, "hdp_step", pp_size, rank)
    assert "of micro-batch tensors (pinned, non-blocking)" in output


@pytest.mark.parametrize("rank", ["0", "1"])
def test_virtual_pipeline_step_on_fake_gpu(guard_library, rank):
    """Two HDP steps as PP stage `rank` of 2 with 2 virtual pipeline stages: model chunks on "cuda", a DDP
    and an offloader per chunk, Megatron's interleaved schedule with overlapped P2P."""
    assert "micro-batch copies (pinned, non-blocking) over 2 chunks" in _run(guard_library, "hdp_step_vpp", rank)


def test_first_nccl_operation_is_not_a_ring(guard_library):
    """initialize_hdp on 4 ranks, then ring attention among ranks 0 and 1."""
    assert "scenario first_p2p: ok" in _run(guard_library, "first_p2p", "4")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_megatron_install_path_on_fake_gpu(guard_library, rank):
    """What install() wires into megatron.training, called as train() calls it, as HDP rank `rank` of 2:
    the HDP loader over an indexed dataset, two steps through the patched get_forward_backward_func
    (Megatron's schedule, offloading, finalize timed by the telemetry), then the patched training_log
    (hdp_statistics, the measured telemetry gathered over the HDP domain; the last rank prints it)."""
    output = _run(guard_library, "install_step", rank)
    assert "micro-batch copies (pinned, non-blocking)" in output
    if rank == "1":
        assert " [HDP measured] iteration        1 |" in output  # CUDA events are read one step late
