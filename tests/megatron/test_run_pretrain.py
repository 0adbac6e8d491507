"""The CPU entry point `python -m megatron_hdp.harness.run_pretrain SCRIPT` and install()'s pipeline set-up.

The entry point's training runs are tested through tests/pretrain_harness.py (test_pretrain.py,
test_pretrain_pp.py, test_patch.py); here: its command line, and what install() sets for PP > 1.
"""

import subprocess
import sys

import pytest

from megatron_hdp.megatron.pretrain.args import parse_and_check
from megatron_hdp.megatron.pretrain.wrappers import pipeline_shapes_per_microbatch as _pipeline_shapes_per_microbatch

FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer "
    "--vocab-size 256 --mock-data --transformer-impl local --calculate-per-token-loss --attention-dropout 0.0 --hdp"
).split()


def test_command_line_without_a_script_exits_2_with_one_line():
    for argv in ([], ["/no/such/pretrain_gpt.py", "--hdp"]):
        run = subprocess.run([sys.executable, "-m", "megatron_hdp.harness.run_pretrain", *argv],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == "error: pretrain script /no/such/pretrain_gpt.py not found"


def test_runs_the_script_as_main_with_its_arguments(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print(sys.argv[1:], sys.path[0])\n")
    run = subprocess.run([sys.executable, "-m", "megatron_hdp.harness.run_pretrain", str(script), "--a", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == f"['--a', '1'] {tmp_path}"


def test_a_process_the_script_spawns_does_not_run_it_again(tmp_path):
    """Megatron's torch_dist writer spawns a multiprocessing Manager in the script's process; a spawned child
    re-runs the parent's main script unless it is marked main-only, and pretrain_gpt.py's imports fail there
    on Python 3.11 (the Manager died: EOFError at every save)."""
    script = tmp_path / "spawns.py"
    script.write_text(
        "import multiprocessing\n"
        "if __name__ != '__main__':\n"
        "    raise SystemExit('the script ran again in a spawned child')\n"
        "with multiprocessing.get_context('spawn').Manager() as manager:\n"
        "    print(manager.list([7])[0])\n")
    run = subprocess.run([sys.executable, "-m", "megatron_hdp.harness.run_pretrain", str(script)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "7"


def test_pipelines_get_per_microbatch_shapes():
    args, _ = parse_and_check(FLAGS + ["--pipeline-model-parallel-size", "2"], world_size=4)
    assert args.variable_seq_lengths is False  # Megatron's validate_args resets it
    _pipeline_shapes_per_microbatch(args)
    assert args.variable_seq_lengths is True and args.moe_token_dispatcher_type == "alltoall"  # dense model

    flat, _ = parse_and_check(FLAGS, world_size=4)
    _pipeline_shapes_per_microbatch(flat)
    assert flat.variable_seq_lengths is False and flat.moe_token_dispatcher_type == "allgather"  # PP 1: unchanged


def test_moe_with_the_allgather_dispatcher_is_refused_under_pp():
    argv = FLAGS + ["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--moe-token-dispatcher-type", "allgather"]
    args, _ = parse_and_check(argv, world_size=8)
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type alltoall"):
        _pipeline_shapes_per_microbatch(args)
