"""Produce a stream of items ahead of its consumer: the loader's planning and reading for step n+1
happen while step n trains.

Two ways (`prefetched`): a daemon thread (`Prefetcher`: no pickling, the results are shared directly),
or DataLoader worker processes, which keep the pure-Python planner from competing with the training
loop for the GIL. Either way an exception in the producer is re-raised in the consumer at the item where
it happened, and closing the stream stops the producer without leaving a thread or process blocked.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterator, TypeVar

import torch.utils.data

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


def _identity(item: T) -> T:
    return item


class _ShardedStream(torch.utils.data.IterableDataset):
    """Worker w of W iterates make_iterator(w, W); the DataLoader interleaves the workers' items round
    robin, which restores the order of make_iterator(0, 1) when shard w holds items w, w + W, ..."""

    def __init__(self, make_iterator: Callable[[int, int], Iterator[T]]):
        self.make_iterator = make_iterator

    def __iter__(self) -> Iterator[T]:
        info = torch.utils.data.get_worker_info()
        return self.make_iterator(info.id, info.num_workers) if info else self.make_iterator(0, 1)


def prefetched(
    make_iterator: Callable[[int, int], Iterator[T]], *, depth: int = 1, workers: int = 0, name: str = "hdp-prefetch"
) -> Iterator[T]:
    """The items of make_iterator(0, 1), produced ahead of the consumer.

    workers = 0, depth = 0: in the consumer's thread, when asked (no overlap; for timing and debugging);
    workers = 0, depth >= 1: in a daemon thread, up to `depth` items ahead;
    workers >= 1: in that many DataLoader worker processes, worker w producing make_iterator(w, workers)
    (items w, w + workers, ...), up to max(depth, 1) items ahead per worker.
    Stop it with `close_stream`.
    """
    if depth < 0 or workers < 0:
        raise ValueError(f"prefetch depth and workers must be >= 0, got {depth} and {workers}")
    if workers:
        loader = torch.utils.data.DataLoader(
            _ShardedStream(make_iterator), batch_size=None, num_workers=workers, prefetch_factor=max(depth, 1),
            collate_fn=_identity,
        )
        return iter(loader)
    if depth == 0:
        return make_iterator(0, 1)
    return Prefetcher(lambda: make_iterator(0, 1), depth=depth, name=name)


def close_stream(stream: Iterator) -> None:
    """Stop a stream from `prefetched`: join its thread or close its generator. A DataLoader iterator shuts
    its workers down when the last reference to it goes (its own `__del__`), so callers drop it."""
    if isinstance(stream, Prefetcher):
        stream.close()
    elif hasattr(stream, "close"):
        stream.close()
