"""Length mixes: the synthetic mixes reproduce ByteScale's published statistics; readers; batch sampler."""

import numpy as np
import pytest

from megatron_hdp.plan.lengths import (
    REAL_MIXES,
    lengths_dir,
    mix_statistics,
    read_lengths,
    real_mix,
    sample_global_batch,
    synthetic_lengths,
)

# ByteScale Sec. 3.1 (as copied in shared/data/lengths/README.md)
PUBLISHED = {
    "byted": {"samples_le_4k": 0.80, "samples_ge_128k": 0.01, "tokens_ge_128k": 0.443, "samples_ge_2m": 0.0005,
              "tokens_ge_2m": 0.121, "tokens_gt_256k": 0.37},
    "github": {"tokens_gt_128k": 0.162, "tokens_gt_256k": 0.098},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_synthetic_mix_matches_the_published_buckets(name):
    stats = mix_statistics(synthetic_lengths(name, num_sequences=400_000, seed=7))
    for key, published in PUBLISHED[name].items():
        # sampling noise of the rare long buckets dominates: the >= 2M bucket holds ~200 of 400K samples
        assert stats[key] == pytest.approx(published, rel=0.12, abs=0.002), key


def test_synthetic_mix_is_seeded_and_bounded():
    a = synthetic_lengths("byted", num_sequences=1000, seed=1)
    assert np.array_equal(a, synthetic_lengths("byted", num_sequences=1000, seed=1))
    assert not np.array_equal(a, synthetic_lengths("byted", num_sequences=1000, seed=2))
    assert a.min() >= 1 and a.max() <= 2 * 1024 * 1024
    with pytest.raises(ValueError, match="unknown synthetic mix 'nope'"):
        synthetic_lengths("nope", num_sequences=3)
    with pytest.raises(ValueError, match="num_sequences must be positive, got 0"):
        synthetic_lengths("byted", num_sequences=0)


def test_sample_global_batch_reaches_the_budget_with_whole_documents():
    pool = np.array([10, 20, 30, 40])
    batch = sample_global_batch(pool, num_tokens=1000, seed=3)
    assert sum(batch) >= 1000 and sum(batch) - batch[-1] < 1000
    assert set(batch) <= set(pool.tolist())
    assert batch == sample_global_batch(pool, num_tokens=1000, seed=3)
    clipped = sample_global_batch("byted", num_tokens=1 << 22, seed=0, max_length=8192)
    assert max(clipped) <= 8192 and sum(clipped) >= 1 << 22
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        sample_global_batch(pool, num_tokens=0)


def test_read_lengths(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("5\n\n17\n3\n")
    assert read_lengths(good).tolist() == [5, 17, 3]
    bad = tmp_path / "bad.txt"
    bad.write_text("5\n1.5\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: '1.5' is not a positive integer length"):
        read_lengths(bad)
    zero = tmp_path / "zero.txt"
    zero.write_text("5\n0\n")
    with pytest.raises(ValueError, match=r"zero.txt:2"):
        read_lengths(zero)
    with pytest.raises(ValueError, match="does not exist"):
        read_lengths(tmp_path / "missing.txt")


@pytest.mark.skipif(not lengths_dir().is_dir(), reason=f"shared length lists not found at {lengths_dir()}")
@pytest.mark.parametrize("name,count,maximum", [("prolong", 77_932, 340_149), ("wlbllm", 99_519, 124_913)])
def test_real_mixes_match_their_readme(name, count, maximum):
    lengths = real_mix(name)
    assert len(lengths) == count and lengths.max() == maximum
    assert name in REAL_MIXES
