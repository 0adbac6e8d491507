"""Per-token loss weights of the loss-aggregation modes RL frameworks use (pure numpy; no torch).

A post-training step's gradient is the gradient of sum(w * l) over the global batch (`PostTrainer.train_step`),
so a mode is nothing but its weights w, computed once from the whole batch's loss masks: no placement,
micro-batch or ring enters them, which is what makes every mode exact under HDP. With m the loss mask
(token-aligned, `posttrain.planning`: entry 0 predicts nothing and always weighs 0), n_i = sum of sample
i's mask, S the samples with n_i > 0:

- ``token-mean``: w = m / sum_i n_i (every loss token of the batch equal);
- ``seq-mean-token-mean``: w = m / (|S| n_i) (each sample's token mean, averaged over samples);
- ``seq-mean-token-sum``: w = m / |S| (each sample's token sum, averaged over samples);
- ``seq-mean-token-sum-norm``: w = m / horizon, a fixed horizon (Dr. GRPO; verl's loss_scale_factor);
- ``prompt-mean``: w = m / (P g_p), samples grouped by prompt (`groups`), g_p the loss tokens of prompt p's
  samples, P the prompts with g_p > 0 (each prompt's token mean, averaged over prompts).

Refused (`REFUSED`), each in one line naming the replacement: a horizon equal to the padded length of a
micro-batch, and means taken per micro-batch (of the loss, a KL or an entropy term): their value depends
on how samples are packed into micro-batches, which HDP chooses per step.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import numpy as np

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "prompt-mean")
"""The loss-aggregation modes `loss_weights` turns into weights."""

REFUSED = {
    "microbatch-token-mean": "token-mean (the mean over the global batch's loss tokens)",
    "microbatch-seq-mean": "seq-mean-token-mean (the mean over the global batch's samples)",
    "microbatch-kl-mean": "token-mean weights on the KL term inside loss_fn",
    "microbatch-entropy-mean": "token-mean weights on the entropy term inside loss_fn",
}
"""Modes whose value depends on how micro-batches are formed -> what to use instead."""


def loss_weights(
    loss_masks: Sequence[np.ndarray],
    *,
    mode: str,
    horizon: Optional[int] = None,
    groups: Optional[Sequence[Hashable]] = None,
) -> list[np.ndarray]:
    """Per-token float64 weights (token-aligned, one array per sample) of aggregation `mode` (module
    docstring) for samples whose loss masks (0/1, token-aligned, entry 0 ignored) are `loss_masks`.
    `horizon`: the fixed horizon of seq-mean-token-sum-norm; `groups`: each sample's prompt id for
    prompt-mean. ValueError for a refused or unknown mode, a missing horizon or groups."""
    if mode in REFUSED:
        raise ValueError(f"loss mode {mode!r} depends on how micro-batches are formed; use {REFUSED[mode]}")
    if mode not in MODES:
        raise ValueError(f"unknown loss mode {mode!r}; choose one of {', '.join(MODES)}")
    masks = [np.asarray(m, dtype=np.float64).reshape(-1).copy() for m in loss_masks]
    for index, mask in enumerate(masks):
        if mask.size < 2:
            raise ValueError(f"sample {index}'s loss mask has {mask.size} entries: a sample needs at least 2 tokens")
        mask[0] = 0.0
    counts = np.array([mask.sum() for mask in masks])
    num_samples = int((counts > 0).sum())
    if mode == "seq-mean-token-sum-norm":
        if horizon is None or horizon <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a fixed horizon > 0, got {horizon!r}: pass horizon=<the "
                             "longest response the rollout may have> (a micro-batch's padded length is not fixed)")
        return [mask / horizon for mask in masks]
    if not counts.sum():
        return [mask * 0.0 for mask in masks]
    if mode == "token-mean":
        return [mask / counts.sum() for mask in masks]
    if mode == "seq-mean-token-mean":
        return [mask / (num_samples * n) if n else mask for mask, n in zip(masks, counts)]
    if mode == "seq-mean-token-sum":
        return [mask / num_samples for mask in masks]
    if groups is None or len(groups) != len(masks):
        raise ValueError(f"prompt-mean needs the prompt id of each of the {len(masks)} samples (groups=...)")
    per_prompt: dict[Hashable, float] = {}
    for group, n in zip(groups, counts):
        per_prompt[group] = per_prompt.get(group, 0.0) + n
    num_prompts = sum(1 for total in per_prompt.values() if total > 0)
    return [mask / (num_prompts * per_prompt[group]) if per_prompt[group] else mask
            for mask, group in zip(masks, groups)]
