"""Run a generator one or two items ahead in a background thread: the loader's planning and reading for
step n+1 happen while step n trains.

A thread rather than DataLoader worker processes: the work is numpy slicing of an mmap'd file and the
pure-Python planner, the results are small, and a thread needs no pickling of plans or datasets. An
exception in the producer is re-raised in the consumer at the item where it happened; `close()` (also
on garbage collection and at interpreter exit, the thread being a daemon) stops the producer without
leaving a thread blocked on a full queue.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

_DONE = object()
_POLL_SECONDS = 0.1


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Iterate over `make_iterator()` with up to `depth` items prepared ahead in a daemon thread."""

    def __init__(self, make_iterator: Callable[[], Iterator[T]], *, depth: int = 1, name: str = "hdp-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(make_iterator,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Put `item`, waiting for room; False when the consumer closed us meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make_iterator: Callable[[], Iterator[T]]) -> None:
        try:
            for item in make_iterator():
                if not self._put(item):
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, who re-raises it
            self._put(_Failure(error))
            return
        self._put(_DONE)

    def __iter__(self) -> "Prefetcher[T]":
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    raise RuntimeError("the prefetch thread ended without a result") from None
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            self.close()
            raise item.error
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer and wait (up to `timeout` s) for its thread; idempotent."""
        self._stop.set()
        self._finished = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def __del__(self) -> None:
        self._stop.set()
