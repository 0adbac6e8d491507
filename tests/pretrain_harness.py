"""Run a pretrain script through `megatron.training.pretrain` on gloo ranks and record what Megatron logged.

Shared by the pretrain tests: `run_pretrain(argv)` runs `examples/pretrain_gpt_hdp.py` (or any pretrain
script, e.g. a patched Megatron-LM `pretrain_gpt.py`) on `world_size` CPU ranks through our entry point
`megatron_hdp.megatron.run_pretrain` and returns, per rank, the losses Megatron logged (only its
last-pipeline-stage ranks log them), the HDP statistics of each step and Megatron's
`consumed_train_samples` after each step. `assert_same_losses` compares two runs step by step.
"""

import os
import sys
from pathlib import Path
from typing import Optional

import pytest

from megatron_hdp.comm.launch import run_gloo

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt_hdp.py"

TINY_GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 3e-3 --lr-decay-style constant "
    "--tokenizer-type NullTokenizer --vocab-size 256 --split 100,0,0 --num-workers 0 --seed 1234 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-masked-softmax-fusion --no-persist-layer-norm --attention-dropout 0 --hidden-dropout 0 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--use-cpu-initialization --distributed-backend gloo --calculate-per-token-loss "
    "--log-interval 1 --eval-iters 0 --eval-interval 1000"
).split()
"""A 2-layer GPT (hidden 64, 64-token samples, vocabulary 256) trained for 4 steps of 8 samples, fp32, no
dropout: small enough for seconds per run on 4 CPU ranks, exact enough to compare losses to 1e-5."""


def _pretrain_on_rank(rank: int, world_size: int, script: str, argv: list[str], python_path: list[str]) -> dict:
    os.environ["RANK"] = str(rank)  # Megatron's parse_args reads RANK and WORLD_SIZE from the environment
    sys.path[:0] = python_path  # before the first megatron import: a checkout's megatron wins over the wheel
    from megatron_hdp.megatron.training_compat import require_megatron_training

    require_megatron_training()
    from megatron.training import training

    from megatron_hdp.megatron import training_install
    from megatron_hdp.megatron.run_pretrain import run_script
    from megatron_hdp.offload import OffloadConfig

    training_install.OFFLOAD_CONFIG = OffloadConfig(min_tensor_bytes=0)  # the tiny model's tensors move too
    losses, stats, consumed = [], [], []
    original = training.training_log

    def recording_training_log(loss_dict, *args, **kwargs):
        if "lm loss" in loss_dict:
            losses.append(float(loss_dict["lm loss"]))
        stats.append(training_install.hdp_statistics())
        consumed.append(training.get_args().consumed_train_samples)  # after Megatron's per-step increment
        return original(loss_dict, *args, **kwargs)

    training.training_log = recording_training_log  # install() wraps it, so it sees HDP's statistics too
    run_script(script, argv)
    return {"losses": losses, "stats": stats, "consumed": consumed}


def run_pretrain(
    argv: list[str],
    *,
    world_size: int = 4,
    script: Optional[Path] = None,
    python_path: tuple[str, ...] = (),
    timeout_s: float = 600,
) -> list[dict]:
    """Run `script` (default: examples/pretrain_gpt_hdp.py) with `argv` on `world_size` gloo ranks.

    `python_path` goes first on each rank's `sys.path`: a Megatron-LM checkout, to train with its own
    `megatron` package (core and training) instead of the installed wheel's.
    """
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # TP > 1 needs it
    return run_gloo(
        _pretrain_on_rank, world_size, str(script or EXAMPLE), argv, list(python_path), timeout_s=timeout_s, env=env
    )


def logged_losses(run: list[dict]) -> list[float]:
    """The per-step losses of a run: every rank that logged them (the last pipeline stages) logged the same."""
    logged = [rank["losses"] for rank in run if rank["losses"]]
    assert logged, "no rank logged a loss"
    assert all(losses == logged[0] for losses in logged), logged
    return logged[0]


def assert_same_losses(run: list[dict], reference: list[dict], *, rel: float = 1e-5) -> list[float]:
    """Every step's loss of `run` equals `reference`'s (same documents per step: equal up to summation
    order); returns `run`'s losses."""
    losses, expected = logged_losses(run), logged_losses(reference)
    assert len(losses) == len(expected)
    assert losses == pytest.approx(expected, rel=rel, abs=1e-6)
    return losses
