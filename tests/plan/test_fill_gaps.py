"""`placement.fill_gaps` keeps the filler slots sorted by time left; its fills must be exactly those of the
definition: each sequence, in order, into the slot of least idle time left (ties: the first gap) among
those with at least its time and its tokens, else left over. The definition below is the straightforward
scan of every slot per sequence the planner used before."""

import numpy as np

from megatron_hdp.plan.search.placement import TimedLayout, fill_gaps


def _by_definition(layout, order, weights, tokens, capacity):
    room = {g: [seconds, capacity] for g, (_, _, seconds) in enumerate(layout.gaps) if seconds > 0}
    left = []
    for seq in order:
        weight, size = float(weights[seq]), int(tokens[seq])
        fitting = [g for g, (seconds, free) in room.items() if weight <= seconds and size <= free]
        if not fitting:
            left.append(seq)
            continue
        g = min(fitting, key=lambda g: (room[g][0], g))
        rank, slot, _ = layout.gaps[g]
        layout.leading[rank][slot].append(seq)
        room[g][0] -= weight
        room[g][1] -= size
        if room[g][0] <= 0 or room[g][1] <= 0:
            del room[g]
    return left


def _layout(rng, num_ranks, num_gaps, integer):
    layout = TimedLayout(num_ranks)
    layout.leading = [[[] for _ in range(6)] for _ in range(num_ranks)]
    for _ in range(num_gaps):
        seconds = float(rng.integers(0, 5)) if integer else float(rng.random() * 4 - 0.5)
        layout.gaps.append((int(rng.integers(num_ranks)), int(rng.integers(6)), seconds))
    return layout


def test_sorted_slots_fill_exactly_as_the_scan():
    """Random gaps with many ties (integer times and tokens, equal gaps, zero and negative idle time),
    sequences in any order, weights as an array or a list."""
    rng = np.random.default_rng(41)
    for trial in range(400):
        integer = trial % 2 == 0
        num_ranks, num_gaps, num_seqs = int(rng.integers(1, 6)), int(rng.integers(0, 15)), int(rng.integers(0, 30))
        weights = rng.integers(0, 4, size=num_seqs).astype(float) if integer else rng.random(num_seqs) * 2
        tokens = rng.integers(1, 9, size=num_seqs)
        capacity = int(rng.integers(1, 12))
        order = rng.permutation(num_seqs).tolist() if trial % 3 else np.argsort(-weights, kind="stable").tolist()
        got_layout = _layout(np.random.default_rng(trial), num_ranks, num_gaps, integer)
        want_layout = _layout(np.random.default_rng(trial), num_ranks, num_gaps, integer)
        given = weights.tolist() if trial % 4 == 1 else weights
        got = fill_gaps(got_layout, order, weights=given, tokens=tokens, capacity=capacity)
        want = _by_definition(want_layout, order, weights, tokens, capacity)
        assert got == want
        assert got_layout.leading == want_layout.leading
