"""Nested lists of sequence ids (a schedule's micro-batches, a row's lanes) as flat numpy arrays.

The planner's timing and row building sum per-sequence values over each list at once
(`np.bincount` over each id's list number, `np.repeat(np.arange(len(lists)), sizes)`) instead of a
Python `sum` per list: at 1,024 ranks a schedule holds ~10K lists.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np


def flat_ids(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, ids): each list's length, and every id of every list in order, as int64 arrays."""
    sizes = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(sizes.sum()))
    return sizes, ids
