"""Sequence-length mixes: the shared real length lists, seeded synthetic ByteScale-like mixes, batches.

Real mixes are the files in `../shared/data/lengths/` relative to the project root (one integer per
line; override the folder with MEGATRON_HDP_LENGTHS_DIR). Synthetic mixes follow the bucket statistics
ByteScale (arXiv 2502.21231, Sec. 3.1) publishes for its "Byted" and "GitHub" datasets; the statistics
pin down the token share of each bucket, and the few numbers they leave open are assumptions stated in
`SYNTHETIC` below. Within a bucket [lo, hi] lengths follow a truncated power law p(x) ~ x^a whose
exponent is solved so that the bucket's mean is the one the statistics imply.

Byted, published: ~80% of samples <= 4K; 1% of samples >= 128K hold 44.3% of tokens; 0.05% of samples
>= 2M hold 12.1%; samples > 256K hold 37%. Assumed: samples >= 2M are exactly 2M (2048K, the paper's
longest context), so the mean length is 2M x 0.0005 / 0.121 = 8,666; the <= 4K bucket has mean 1,200;
the 128K-256K bucket has mean 180K. Everything else follows (4K-128K: 19% of samples, mean 20.4K;
256K-2M: 0.60% of samples, mean 360K).
GitHub, published: samples > 128K hold 16.2% of tokens, > 256K hold 9.8%. Assumed: bucket means 1,200
(<= 4K), 15K (4K-128K), 180K (128K-256K), 400K (256K-2M) and 85% of samples <= 4K (mean length 3.9K).

`rl-rollouts` (issue 39): RL post-training rollouts, prompt + response, 1K-128K tokens, in the same bucket
form (`_rl_rollouts`, where the sources and what is assumed are written out).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

K = 1024
MAX_LENGTH = 2048 * K

REAL_MIXES: dict[str, str] = {
    "wikipedia": "wikipedia-flexsp.txt",
    "prolong": "prolong-distca.txt",
    "wlbllm": "wlbllm-distca.txt",
}


@dataclass(frozen=True)
class Bucket:
    """Lengths in [lo, hi] drawn with probability `fraction`, with mean `mean` inside the bucket."""

    lo: int
    hi: int
    fraction: float
    mean: float


def _byted() -> tuple[Bucket, ...]:
    mean = MAX_LENGTH * 0.0005 / 0.121  # tokens per sample, from the >= 2M bucket
    share_small = 0.80 * 1200 / mean
    p_128_256 = 0.073 * mean / (180 * K)  # 44.3% - 37% of tokens in [128K, 256K)
    return (
        Bucket(16, 4 * K, 0.80, 1200.0),
        Bucket(4 * K + 1, 128 * K - 1, 0.19, (1 - 0.443 - share_small) * mean / 0.19),
        Bucket(128 * K, 256 * K, p_128_256, 180.0 * K),
        Bucket(256 * K + 1, MAX_LENGTH - 1, 0.01 - 0.0005 - p_128_256, 0.249 * mean / (0.01 - 0.0005 - p_128_256)),
        Bucket(MAX_LENGTH, MAX_LENGTH, 0.0005, float(MAX_LENGTH)),
    )


def _github() -> tuple[Bucket, ...]:
    means = (1200.0, 15.0 * K, 180.0 * K, 400.0 * K)
    share_long = (0.162 - 0.098, 0.098)
    # 85% of samples <= 4K fixes the split of the remaining 83.8% of tokens between the two short buckets.
    ratio = 0.85 / 0.15 * means[0] / means[1]  # share_small / share_mid, ignoring the tiny long fractions
    share_small = 0.838 * ratio / (1 + ratio)
    shares = (share_small, 0.838 - share_small) + share_long
    mean = 1.0 / sum(w / m for w, m in zip(shares, means))
    bounds = ((16, 4 * K), (4 * K + 1, 128 * K), (128 * K + 1, 256 * K), (256 * K + 1, MAX_LENGTH))
    return tuple(Bucket(lo, hi, w * mean / m, m) for (lo, hi), w, m in zip(bounds, shares, means))


ROLLOUT_MEDIAN = 4 * K
"""`rl-rollouts`: median rollout length (prompt + response), tokens."""
ROLLOUT_SIGMA = 1.2
"""`rl-rollouts`: standard deviation of the log-length."""
ROLLOUT_RANGE = (1 * K, 128 * K)
"""`rl-rollouts`: the lengths it holds (the log-normal restricted to this range)."""


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _rl_rollouts() -> tuple[Bucket, ...]:
    """RL rollouts (prompt + response): a log-normal of median `ROLLOUT_MEDIAN` and log-sigma
    `ROLLOUT_SIGMA` restricted to `ROLLOUT_RANGE`, as octave buckets [2^i K, 2^(i+1) K] with the
    log-normal's mass and conditional mean in each (the truncated power law inside a bucket then
    reproduces the bucket's mean, as for ByteScale's mixes).

    Published, what pins it: response lengths in reasoning RL are one long-tailed mode, and the longest
    few responses dominate the rollout (Seer, arXiv 2511.14617: the last 10% of requests take up to half
    of the rollout time; TLT, arXiv 2511.16665, and DARTS, arXiv 2605.30859, call the distribution a
    "persistent long tail"); the cap on a response is 16K-96K in published runs (DAPO, arXiv 2503.14476:
    max response 20,480 = 16,384 + a 4,096 overlong buffer, prompts <= 2,048; Seer: 65,536 for Moonlight,
    40,960 for Qwen2-VL-72B, 98,304 for Kimi K2); DeepSeek-R1-Zero's mean response grows to about 10K
    tokens over its RL run (arXiv 2501.12948, Fig. 3, read off the plot).
    Assumed (no paper we found publishes the percentiles): the log-normal shape, median 4K and sigma 1.2.
    Mass outside [1K, 128K] (12% below, 0.2% above) is dropped and the rest renormalised, which leaves a
    median of ~4.9K, a mean of ~9K (R1-Zero's late-training order), 5% of rollouts above ~31K holding
    ~28% of the tokens, 4.5% above 32K and 1% above 64K. A context limit
    (`sample_global_batch(max_length=...)`) clips lengths as a framework's response cap truncates rollouts:
    at 32K, 4.5% of rollouts sit at the cap.
    """
    mu, sigma = math.log(ROLLOUT_MEDIAN), ROLLOUT_SIGMA
    lo, hi = ROLLOUT_RANGE
    edges = [lo]
    while edges[-1] < hi:
        edges.append(min(hi, 2 * edges[-1]))
    z = [(math.log(e) - mu) / sigma for e in edges]
    mass = [_normal_cdf(b) - _normal_cdf(a) for a, b in zip(z, z[1:])]
    # E[X; a < X < b] of a log-normal: exp(mu + sigma^2 / 2) (Phi(z_b - sigma) - Phi(z_a - sigma))
    partial = [math.exp(mu + sigma**2 / 2) * (_normal_cdf(b - sigma) - _normal_cdf(a - sigma)) for a, b in zip(z, z[1:])]
    total = sum(mass)
    return tuple(Bucket(a + (i > 0), b, m / total, p / m)
                 for i, (a, b, m, p) in enumerate(zip(edges, edges[1:], mass, partial)))


SYNTHETIC: dict[str, tuple[Bucket, ...]] = {"byted": _byted(), "github": _github(), "rl-rollouts": _rl_rollouts()}
DISTRIBUTIONS = tuple(SYNTHETIC) + tuple(REAL_MIXES)


def lengths_dir() -> Path:
    """The shared length lists: $MEGATRON_HDP_LENGTHS_DIR, else <project root>/../shared/data/lengths."""
    override = os.environ.get("MEGATRON_HDP_LENGTHS_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "lengths"


def read_lengths(path: Union[str, Path]) -> np.ndarray:
    """Lengths from a file of one positive integer per line (blank lines ignored)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"length file {path} does not exist")
    text = path.read_text()
    try:
        values = np.array(text.split(), dtype=np.int64)
    except ValueError:
        values = None
    if values is None or (values < 1).any():
        for number, line in enumerate(text.splitlines(), start=1):  # slow path, only to name the bad line
            line = line.strip()
            if line and (not line.lstrip("-").isdigit() or int(line) < 1):
                raise ValueError(f"{path}:{number}: {line!r} is not a positive integer length")
        raise ValueError(f"length file {path} is not one integer per line")
    if not len(values):
        raise ValueError(f"length file {path} holds no lengths")
    return values


def real_mix(name: str) -> np.ndarray:
    """All lengths of a shared real mix ('wikipedia', 'prolong', 'wlbllm')."""
    if name not in REAL_MIXES:
        raise ValueError(f"unknown real mix {name!r}; known: {', '.join(REAL_MIXES)}")
    return read_lengths(lengths_dir() / REAL_MIXES[name])


def _bucket_sample(bucket: Bucket, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` lengths of a truncated power law on [lo, hi] with the bucket's mean (grid inverse CDF)."""
    if bucket.lo == bucket.hi:
        return np.full(count, bucket.lo, dtype=np.int64)
    grid = np.geomspace(bucket.lo, bucket.hi, 2049)
    log_grid = np.log(grid)

    def cdf(exponent: float) -> np.ndarray:
        # density of x ~ x^exponent; on a log grid the mass of a cell is ~ x^(exponent + 1) d(log x)
        weight = np.exp((exponent + 1) * (log_grid - log_grid.max()))
        mass = np.concatenate(([0.0], np.cumsum((weight[1:] + weight[:-1]) / 2 * np.diff(log_grid))))
        return mass / mass[-1]

    def mean(exponent: float) -> float:
        c = cdf(exponent)
        return float(np.sum(np.diff(c) * (grid[1:] + grid[:-1]) / 2))

    lo, hi = -12.0, 12.0
    for _ in range(60):  # mean(exponent) increases with the exponent
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < bucket.mean else (lo, mid)
    draws = np.interp(rng.random(count), cdf((lo + hi) / 2), grid)
    return np.clip(np.rint(draws), bucket.lo, bucket.hi).astype(np.int64)


def synthetic_lengths(name: str, *, num_sequences: int, seed: int = 0) -> np.ndarray:
    """`num_sequences` lengths of the synthetic mix `name` ('byted', 'github' or 'rl-rollouts'), seeded."""
    if name not in SYNTHETIC:
        raise ValueError(f"unknown synthetic mix {name!r}; known: {', '.join(SYNTHETIC)}")
    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    buckets = SYNTHETIC[name]
    rng = np.random.default_rng(seed)
    fractions = np.array([b.fraction for b in buckets])
    which = rng.choice(len(buckets), size=num_sequences, p=fractions / fractions.sum())
    out = np.empty(num_sequences, dtype=np.int64)
    for index, bucket in enumerate(buckets):
        chosen = np.flatnonzero(which == index)
        out[chosen] = _bucket_sample(bucket, len(chosen), rng)
    return out


def sample_global_batch(
    source: Union[str, Sequence[int], np.ndarray], *, num_tokens: int, seed: int = 0, max_length: int | None = None
) -> list[int]:
    """Whole documents drawn at random from `source` until `num_tokens` is reached (the last one may overshoot).

    `source` is a mix name (synthetic or real) or an array of lengths to draw from (without replacement,
    reshuffled when exhausted). `max_length` clips lengths, as a context-length limit would.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    rng = np.random.default_rng(seed)
    if isinstance(source, str) and source in SYNTHETIC:
        mean = sum(b.fraction * b.mean for b in SYNTHETIC[source])
        pool = synthetic_lengths(source, num_sequences=int(2 * num_tokens / mean) + 16, seed=seed)
    else:
        pool = real_mix(source) if isinstance(source, str) else np.asarray(source, dtype=np.int64)
        if len(pool) == 0:
            raise ValueError("cannot sample a batch from an empty length list")
    if max_length is not None:
        pool = np.minimum(pool, max_length)
    picked: list[np.ndarray] = []
    total = 0
    while total < num_tokens:
        order = rng.permutation(pool)
        cumulative = np.cumsum(order)
        stop = int(np.searchsorted(cumulative, num_tokens - total)) + 1
        picked.append(order[:stop])
        total += int(cumulative[min(stop, len(order)) - 1])
    return np.concatenate(picked).tolist()


def mix_statistics(lengths: Sequence[int]) -> dict[str, float]:
    """The bucket statistics ByteScale publishes, measured on `lengths` (fractions in [0, 1])."""
    array = np.asarray(lengths, dtype=np.int64)
    tokens = array.sum()
    return {
        "num_sequences": float(len(array)),
        "mean": float(array.mean()),
        "samples_le_4k": float(np.mean(array <= 4 * K)),
        "samples_ge_128k": float(np.mean(array >= 128 * K)),
        "samples_ge_2m": float(np.mean(array >= MAX_LENGTH)),
        "tokens_gt_128k": float(array[array > 128 * K].sum() / tokens),
        "tokens_ge_128k": float(array[array >= 128 * K].sum() / tokens),
        "tokens_gt_256k": float(array[array > 256 * K].sum() / tokens),
        "tokens_ge_2m": float(array[array >= MAX_LENGTH].sum() / tokens),
    }
