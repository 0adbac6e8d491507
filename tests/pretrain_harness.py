"""Harness for `megatron.training.pretrain` runs in test processes: examples/pretrain_gpt_hdp.py, or any
pretrain script (e.g. a patched Megatron-LM `pretrain_gpt.py`) through `megatron_hdp.harness.run_pretrain`.

- `TINY`: a tiny GPT's Megatron flags (CPU, gloo, per-token loss, no fusions) without data flags.
- `pretrain_rank(rank, world_size, argv, reference_plans=None)`: one rank of a run (for `run_gloo`);
  returns per step the losses, HDP statistics, consumed-sample counts and MTP losses Megatron logged (and
  the token sums behind them: `_record_mtp_log`), the iteration numbers, under --hdp the step's sample ids
  and plan digest, and the class of each MTP layer's core attention. With `record_weights` also this
  rank's parameters (every model chunk's) after each step, and before its first one (what the run started
  from: initialised or loaded). A run that ends by --exit-interval (Megatron's sys.exit(0)) returns
  normally.
  With `reference_plans=(plans_dir, data_prefix)` the run trains plain Megatron on `PlannedPiecesDataset`.
  A plain run with `--context-parallel-size` trains with tests/cp_stand_in.py's CP attention (no TE here).
- `run_pretrain(argv, world_size=4, script=None, python_path=(), reference_plans=None)`: a whole run on
  gloo ranks (`pretrain_rank` on each); `python_path` goes first on each rank's `sys.path` (a Megatron-LM
  checkout, to train with its own `megatron` package). `logged_losses` / `assert_same_losses` read and
  compare the per-step losses (Megatron logs them on its last pipeline stage only).
- `PlannedPiecesDataset`: the reference for document-level HDP. It reads plans saved with
  `--hdp-save-plans` and yields, step after step, each planned sequence as its own Megatron sample: the
  piece's tokens (by its `source`: document, offset, length, read from the indexed dataset directly),
  from the sample index a resumed run starts at (its consumed samples; the samples after the plans' are
  the script's own dataset's, so a run can go on as plain Megatron would), padded to --seq-length with loss mask 0 on the padding (and, with --eod-mask-loss, on input positions
  holding the tokenizer's EOD, as Megatron masks them). Causal attention keeps the padding at the end
  invisible to the real positions, so a plain run with --global-batch-size = the documents of a step
  computes each document as its own sequence: HDP's loss, by an independent path.
- `expected_pieces(raw_lengths, seq_length)`: (document, offset, length) of every piece of every
  document, by the documented cutting rule, written out independently of the package.
- `megatron_lm_checkout()` / `patched_pretrain_gpt(root, where)` / `checkout_entry(where)`: the Megatron-LM
  checkout MEGATRON_LM_DIR names (None when unset; skip when it cannot train), its pretrain_gpt.py with our
  patch applied, and both as `run_pretrain`'s script and python path.
- `MLA`, `assert_whole_and_rings_agree(argv, seq_length)`: multi-latent attention flags, and the check
  that --hdp trains with the same losses on 1 rank (documents whole) and on 4 (documents on rings).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 256 "
    "--micro-batch-size 1 --lr 3e-3 --lr-decay-style constant "
    "--tokenizer-type NullTokenizer --vocab-size 256 --split 100,0,0 --num-workers 0 --seed 1234 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-masked-softmax-fusion --no-persist-layer-norm --attention-dropout 0 --hidden-dropout 0 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--use-cpu-initialization --distributed-backend gloo --calculate-per-token-loss "
    "--log-interval 1 --eval-iters 0 --eval-interval 1000"
).split()


def megatron_lm_checkout() -> Optional[Path]:
    """The Megatron-LM checkout MEGATRON_LM_DIR names, ready to train with (its `megatron` package and its
    dataset helpers built); None when the variable is unset; pytest.skip, with the reason, when it names
    no such checkout."""
    import pytest

    where = os.environ.get("MEGATRON_LM_DIR")
    if not where:
        return None
    root = Path(where)
    if not (root / "pretrain_gpt.py").is_file():
        pytest.skip(f"{root} is not a Megatron-LM checkout (training needs its megatron package)")
    if not list((root / "megatron/core/datasets").glob("helpers_cpp*.so")):
        pytest.skip(f"build the dataset helpers first: make -C {root}/megatron/core/datasets LIBEXT=$(python -c "
                    "\"import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))\")")
    return root


def patched_pretrain_gpt(root: Path, where: Path) -> Path:
    """`root`'s pretrain_gpt.py copied into the directory `where` with patches/pretrain_gpt.patch applied."""
    shutil.copy(root / "pretrain_gpt.py", where / "pretrain_gpt.py")
    applied = subprocess.run(["bash", str(ROOT / "patches" / "apply.sh"), str(where)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return where / "pretrain_gpt.py"


def checkout_entry(where: Path) -> tuple[Optional[Path], tuple[str, ...]]:
    """(MEGATRON_LM_DIR's patched pretrain_gpt.py, copied into `where`: the HDP run's script; the checkout's
    path: both runs' `megatron`) for `run_pretrain`, or (None, ()) without MEGATRON_LM_DIR: our entry point on
    the installed megatron-core."""
    root = megatron_lm_checkout()
    return (None, ()) if root is None else (patched_pretrain_gpt(root, where), (str(root),))


MLA = (
    "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8 "
    "--v-head-dim 8 --qk-layernorm --rope-type yarn --rotary-scaling-factor 4 --mscale 1.0 --mscale-all-dim 0.5"
).split()
"""DeepSeek-V3-style multi-latent attention for `TINY`: a query latent, latent norms, YaRN RoPE (an mscale
other than mscale_all_dim)."""


def expected_pieces(raw_lengths: list[int], seq_length: int) -> list[tuple[int, int, int]]:
    """(document, offset, length) of each piece: a document of n raw tokens has n - 1 positions, cut
    into consecutive runs of at most seq_length."""
    pieces = []
    for document, raw in enumerate(raw_lengths):
        for offset in range(0, raw - 1, seq_length):
            pieces.append((document, offset, min(seq_length, raw - 1 - offset)))
    return pieces


def read_saved_plans(directory: str | Path) -> list[dict]:
    """The saved plans in iteration order."""
    return [json.loads(path.read_text()) for path in sorted(Path(directory).glob("iter_*.json"))]


class PlannedPiecesDataset:
    """Each planned sequence of the saved plans as one padded Megatron sample (module docstring)."""

    def __init__(self, plans_dir: str, data_prefix: str, seq_length: int, *, eod: Optional[int] = None,
                 start: int = 0, after=None):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.indexed = IndexedDataset(data_prefix)
        self.seq_length = seq_length
        self.eod = eod
        self.start = start
        """The first sample index: a run resumed after `start` consumed samples reads the plans' first piece."""
        self.after = after
        """The dataset whose samples come after the plans' (None: none)."""
        """With --eod-mask-loss: input positions holding this token do not count (Megatron's rule)."""
        self.pieces = [
            (entry["source"]["document"], entry["source"]["offset"], entry["length"])
            for plan in read_saved_plans(plans_dir)
            for entry in sorted(plan["sequences"], key=lambda entry: entry["id"])
        ]

    def __len__(self) -> int:
        return len(self.after) if self.after is not None else self.start + len(self.pieces)

    def __getitem__(self, index: int) -> dict:
        import torch

        if index >= self.start + len(self.pieces):
            return self.after[index]
        document, offset, length = self.pieces[index - self.start]
        raw = torch.from_numpy(self.indexed.get(document, offset=offset, length=length + 1).astype(np.int64))
        tokens = torch.zeros(self.seq_length, dtype=torch.int64)
        labels = torch.zeros(self.seq_length, dtype=torch.int64)
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        tokens[:length], labels[:length], loss_mask[:length] = raw[:-1], raw[1:], 1.0
        if self.eod is not None:
            loss_mask[:length][raw[:-1] == self.eod] = 0.0
        causal = torch.triu(torch.ones(self.seq_length, self.seq_length, dtype=torch.bool), diagonal=1)
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length), "attention_mask": causal.unsqueeze(0)}


def _planned_pieces_provider(plans_dir: str, data_prefix: str, train_val_test_num_samples, vp_stage=None, *,
                             provider):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args

    args = get_args()
    eod = build_tokenizer(args).eod if args.eod_mask_loss else None
    dataset = PlannedPiecesDataset(plans_dir, data_prefix, args.seq_length, eod=eod, start=args.consumed_train_samples,
                                   after=provider(train_val_test_num_samples)[0])  # built after --load
    return dataset, None, None


def pretrain_rank(rank: int, world_size: int, argv: list[str], reference_plans: Optional[tuple[str, str]] = None,
                  offload_min_tensor_bytes: Optional[int] = 0, script: Optional[str] = None,
                  python_path: tuple[str, ...] = (), record_weights: bool = False) -> dict:
    """Run examples/pretrain_gpt_hdp.main(argv) (or `script` through run_pretrain) on this rank; return what
    Megatron logged per step."""
    os.environ["RANK"] = str(rank)  # Megatron's parse_args reads RANK and WORLD_SIZE from the environment
    sys.path[:0] = python_path  # before the first megatron import: a checkout's megatron wins over the wheel
    sys.path.insert(0, str(ROOT / "examples"))
    from megatron_hdp.megatron.compat.versions import require_megatron_training

    require_megatron_training()
    from megatron.training import training

    from megatron_hdp.megatron.pretrain import runtime as hdp_runtime

    if offload_min_tensor_bytes is not None and "--hdp" in argv:  # the tiny model's tensors move too
        argv = [*argv, "--hdp-offload-min-tensor-bytes", str(offload_min_tensor_bytes)]
    if script is None or reference_plans is not None:
        import pretrain_gpt_hdp
    if script is None and "--context-parallel-size" in argv and "--hdp" not in argv:
        import cp_stand_in  # plain Megatron's CP without Transformer Engine

        cp_stand_in.install(pretrain_gpt_hdp)
    if reference_plans is not None:
        pretrain_gpt_hdp.datasets_provider = functools.partial(_planned_pieces_provider, *reference_plans,
                                                               provider=pretrain_gpt_hdp.datasets_provider)

    losses, stats, consumed, iterations, ids, digests, weights = [], [], [], [], [], [], {}
    mtp, mtp_tokens, mtp_attention = [], [], []
    original = training.training_log
    _record_mtp_log(mtp, mtp_tokens)
    _record_mtp_attention(training, mtp_attention)

    def recording_training_log(loss_dict, *args, **kwargs):
        if "lm loss" in loss_dict:
            losses.append(float(loss_dict["lm loss"]))
        stats.append(hdp_runtime.hdp_statistics())
        consumed.append(training.get_args().consumed_train_samples)  # after Megatron's per-step increment
        iterations.append(training.get_args().curr_iteration + 1)
        runtime = hdp_runtime.installed()
        if runtime is not None:
            ids.append(runtime.last_step.sample_ids.tolist())
            digests.append(runtime.last_step.plan.digest())
        return original(loss_dict, *args, **kwargs)

    original_step = training.train_step

    def recording_train_step(forward_step_func, data_iterator, model, *args, **kwargs):
        def parameters():
            return {f"{index}.{name}": value.detach().clone() for index, chunk in enumerate(model)
                    for name, value in chunk.named_parameters()}

        if not weights:
            weights[training.get_args().curr_iteration] = parameters()
        result = original_step(forward_step_func, data_iterator, model, *args, **kwargs)
        weights[training.get_args().curr_iteration + 1] = parameters()
        return result

    training.training_log = recording_training_log
    if record_weights:
        training.train_step = recording_train_step
    try:
        if script is None:
            pretrain_gpt_hdp.main(argv)
        else:
            from megatron_hdp.harness.run_pretrain import run_script

            run_script(script, argv)
    except SystemExit as stop:  # --exit-interval: Megatron ends the run with sys.exit(0)
        if stop.code not in (0, None):
            raise
    return {"losses": losses, "stats": stats, "consumed": consumed, "iterations": iterations, "ids": ids,
            "digests": digests, "weights": weights, "mtp": mtp, "mtp_tokens": mtp_tokens,
            "mtp_attention": mtp_attention}


def _record_mtp_attention(training, names: list) -> None:
    """Append to `names` the class of every MTP layer's core attention of the model Megatron builds."""
    from megatron.core.utils import unwrap_model

    original = training.setup_model_and_optimizer

    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        for chunk in model:
            for layer in getattr(getattr(unwrap_model(chunk), "mtp", None), "layers", ()):
                names.append(type(layer.mtp_model_layer.self_attention.core_attention).__name__)
        return model, optimizer, scheduler

    training.setup_model_and_optimizer = setup_model_and_optimizer


def _record_mtp_log(records: list, token_sums: list) -> None:
    """Append to `records`, per training step, the `mtp_k loss` values Megatron logs (empty without MTP),
    and to `token_sums` this rank's {name: [sum over its micro-batches of each one's logged depth-k loss
    times its depth-k loss-token count, that count]}: with 0/1 loss masks (plain Megatron) the depth-k
    token-loss sum and count, whose quotient over the ranks is the token-level mean of the global batch."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    original_track = MTPLossLoggingHelper.track_mtp_metrics
    original_save = MTPLossLoggingHelper.save_metrics_to_tracker
    step: dict = {}

    def save_metrics_to_tracker(loss, correct, total, layer_number, num_layers, *args, **kwargs):
        if layer_number is not None:
            sums = step.setdefault(f"mtp_{layer_number + 1} loss", [0.0, 0.0])
            sums[0] += float(loss) * float(total)
            sums[1] += float(total)
        return original_save(loss, correct, total, layer_number, num_layers, *args, **kwargs)

    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        logged: dict = {}
        original_track(loss_scale, iteration, writer, wandb_writer, logged)
        records.append({name: float(value) for name, value in logged.items()})
        token_sums.append(dict(step))
        step.clear()
        for name, value in logged.items():
            total_loss_dict[name] = total_loss_dict.get(name, 0) + value

    MTPLossLoggingHelper.save_metrics_to_tracker = staticmethod(save_metrics_to_tracker)
    MTPLossLoggingHelper.track_mtp_metrics = staticmethod(track_mtp_metrics)


def run_pretrain(
    argv: list[str],
    *,
    world_size: int = 4,
    script: Optional[Path] = None,
    python_path: tuple[str, ...] = (),
    reference_plans: Optional[tuple[str, str]] = None,
    record_weights: bool = False,
    timeout_s: float = 600,
) -> list[dict]:
    """`pretrain_rank` on `world_size` gloo ranks (module docstring); what each rank logged, by rank."""
    from megatron_hdp.comm.launch import run_gloo

    env = {"LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # TP > 1 needs it
    return run_gloo(pretrain_rank, world_size, argv, reference_plans, 0, None if script is None else str(script),
                    tuple(python_path), record_weights, timeout_s=timeout_s, env=env,
                    fresh_interpreter=bool(python_path))  # a checkout's megatron, not the preloaded wheel's


def logged_losses(run: list[dict]) -> list[float]:
    """The per-step losses of a run: every rank that logged them (the last pipeline stages) logged the same."""
    logged = [rank["losses"] for rank in run if rank["losses"]]
    assert logged, "no rank logged a loss"
    assert all(losses == logged[0] for losses in logged), logged
    return logged[0]


def assert_same_losses(run: list[dict], reference: list[dict], *, rel: float = 1e-5) -> list[float]:
    """Every step's loss of `run` equals `reference`'s (same documents per step: equal up to summation
    order); returns `run`'s losses."""
    import pytest

    losses, expected = logged_losses(run), logged_losses(reference)
    assert len(losses) == len(expected)
    assert losses == pytest.approx(expected, rel=rel, abs=1e-6)
    return losses


def assert_whole_and_rings_agree(argv: list[str], *, seq_length: int, ring_kinds: tuple[str, ...] = (),
                                 **run_kwargs) -> list[float]:
    """`argv` with --hdp on 1 rank with capacity `seq_length` (every document whole) and on 4 ranks with
    capacity 24 (longer pieces on rings of up to 4 ranks): the same loss at every step, and rings ran.
    `ring_kinds` (multi-latent attention): one 4-rank run per --hdp-ring-kind, each with the losses of the
    whole run (and latent rings ran with "latent"). `run_kwargs` go to `run_pretrain` (a script and its
    Megatron-LM checkout). Returns the losses."""
    hdp = ["--hdp", "--no-hdp-offload"]
    whole = run_pretrain(argv + hdp + ["--hdp-capacity", str(seq_length)], world_size=1, **run_kwargs)
    assert all(step["hdp/rings"] == 0 for step in whole[0]["stats"])
    for kind in ring_kinds or (None,):
        forced = ["--hdp-ring-kind", kind] if kind else []
        rings = run_pretrain(argv + hdp + forced + ["--hdp-capacity", "24"], world_size=4, **run_kwargs)
        assert sum(step["hdp/rings"] for step in rings[0]["stats"]) > 0
        latent = sum(step["hdp/latent-rings"] for step in rings[0]["stats"])
        assert latent > 0 if kind == "latent" else latent == 0
        losses = assert_same_losses(rings, whole)
    return losses
