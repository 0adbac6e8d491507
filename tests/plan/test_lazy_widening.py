"""Balance's ring-size options made lazily (`widening.LazyOptions`): the same options as
`widening_options(..., alternatives=True)`, in its order, and only the first made until more are asked for
(on large batches balance rarely asks: the alternatives were 20-40% of the widening's time)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hdp.plan.cost import ring_sizes
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import shard_sequences
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.search.widening import LazyOptions, widening_options


def _setup(model, mix, ranks, capacity):
    cost_model = analytic_cost_model(model, "h100", tp_size=8 if model == "deepseek-v3" else 1)
    tokens = np.asarray(sample_global_batch(mix, num_tokens=ranks * 16384, seed=1), dtype=np.int64)
    sharding = shard_sequences(tokens, capacity=capacity, num_ranks=ranks, cost_model=cost_model, max_offload_ratio=1.0)
    settings = dict(num_ranks=ranks, capacity=capacity, cost_model=cost_model, max_offload_ratio=1.0)
    return tokens, sharding, settings


@pytest.mark.parametrize("model, mix, ranks", [("llama-7b", "github", 32), ("deepseek-v3", "byted", 64),
                                               ("llama-7b", "byted", 256), ("llama-7b", "github", 8),
                                               ("deepseek-v3", "github", 128)])
def test_lazy_options_are_widening_options_with_alternatives(model, mix, ranks, monkeypatch):
    tokens, sharding, settings = _setup(model, mix, ranks, 8192)
    eager = widening_options(tokens, sharding.ring_sizes, sharding.offload_ratios, alternatives=True, **settings)
    first = widening_options(tokens, sharding.ring_sizes, sharding.offload_ratios, **settings)
    asked = []  # the targets the ring sizer is asked about
    sizes_for = ring_sizes.RingSizer.sizes_for
    monkeypatch.setattr(ring_sizes.RingSizer, "sizes_for", lambda self, target: asked.append(target) or sizes_for(self, target))
    lazy = LazyOptions(tokens, sharding.ring_sizes, sharding.offload_ratios, **settings)
    assert all(np.array_equal(a, b) for a, b in zip(lazy[0], first[0]))
    before = len(asked)
    assert len(lazy) == len(eager) > 0
    assert len(asked) > before or len(eager) == 1 or not (tokens > 8192).any()
    for (sizes, ratios), (want_sizes, want_ratios) in zip(lazy[1:], eager[1:]):
        assert np.array_equal(sizes, want_sizes) and np.array_equal(ratios, want_ratios)
    assert [o[0].tolist() for o in lazy] == [o[0].tolist() for o in eager]


def test_the_first_option_asks_nothing_of_the_alternatives(monkeypatch):
    """Only the settled target's ring sizes are looked up (besides the bisection's) until an alternative is read."""
    tokens, sharding, settings = _setup("deepseek-v3", "github", 128, 8192)
    assert len(widening_options(tokens, sharding.ring_sizes, sharding.offload_ratios, alternatives=True, **settings)) > 1
    asked = []
    sizes_for = ring_sizes.RingSizer.sizes_for
    monkeypatch.setattr(ring_sizes.RingSizer, "sizes_for", lambda self, target: asked.append(target) or sizes_for(self, target))
    widening_options(tokens, sharding.ring_sizes, sharding.offload_ratios, **settings)
    eager_first = len(asked)
    asked.clear()
    lazy = LazyOptions(tokens, sharding.ring_sizes, sharding.offload_ratios, **settings)
    lazy[0]
    assert len(asked) == eager_first
    lazy[1]
    assert len(asked) > eager_first
