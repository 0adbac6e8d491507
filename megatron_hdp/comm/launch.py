"""Run a function on N gloo processes of this machine: the multi-rank harness of tests, benchmarks and
the CPU demo.

Every child initializes the default process group (gloo, a free loopback port), calls
`fn(rank, world_size, *args)`, and sends back its return value. The call ends by itself: a child's
exception is re-raised here with the child's traceback, and a run past `timeout_s` kills every child and
says which ranks had not finished — a multi-rank test never hangs. `run_gloo` returns the values (the
first failure fails the run); `gloo_reports` yields every rank's outcome as it comes, for runs where a
rank is meant to fail (tests/megatron/test_fault_restart.py kills one).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


class RankFailed(RuntimeError):
    """A child rank raised; the message carries its traceback."""


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PRELOADED_MODULES = ["torch", "torch.distributed"]
"""What the fork server imports once, so that each child starts from them instead of importing them
again (torch alone is ~4 s of CPU per child on a 2-core host). `preload_in_children` adds more."""


def preload_in_children(*modules: str) -> None:
    """Have the fork server import `modules` too (a module that is not installed is skipped). A layer
    above this one names its heavy imports here (the tests and the CLI name megatron-core and the
    integration, ~5 s of CPU per child): it takes effect if called before this process's first launch,
    which starts the server."""
    PRELOADED_MODULES.extend(module for module in modules if module not in PRELOADED_MODULES)


def _context(fresh_interpreter: bool) -> Any:
    """The multiprocessing context the children start from. By default children fork from one server
    that has imported `PRELOADED_MODULES` (nothing else: no CUDA, no process group, no state of the
    caller), so each starts as a spawned child would after those imports. `fresh_interpreter`: a new
    interpreter per child, for children that must import something else under those modules' names (a
    Megatron-LM checkout's `megatron`) or set a variable that torch reads when it is imported."""
    if fresh_interpreter:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED_MODULES))
    return ctx


def _child(fn, rank, world_size, port, args, kwargs, results, timeout_s, num_threads, env):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensors by value: the queue's own pickler would share their memory through
        # this child, which may have exited before the parent reads it.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - the traceback goes to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    num_threads: int = 1,
    env: dict[str, str] | None = None,
    fresh_interpreter: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return values by rank.

    `fn` and its arguments must be picklable (module-level function). `env` is applied in each child
    before `fn` runs (torch and Megatron are imported by then unless `fresh_interpreter`: see
    `_context`). The first rank to fail (raise, or die without a result) fails the run.
    """
    values: dict[int, Any] = {}
    with contextlib.closing(gloo_reports(fn, world_size, *args, timeout_s=timeout_s, num_threads=num_threads,
                                         env=env, fresh_interpreter=fresh_interpreter,
                                         **kwargs)) as reports:  # closed: the children stop now
        for report in reports:
            if report.error is not None:
                raise RankFailed(f"rank {report.rank} failed:\n{report.error}")
            values[report.rank] = report.value
    missing = sorted(set(range(world_size)) - set(values))
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
    return [values[rank] for rank in range(world_size)]


@dataclass(frozen=True)
class RankReport:
    """What one rank of `gloo_reports` came back with."""

    rank: int
    value: Any = None
    """`fn`'s return value (when `error` is None)."""
    error: Optional[str] = None
    """The child's traceback, or how it died without a result (its exit code)."""
    at: float = 0.0
    """`time.time()` when the parent received it."""


def gloo_reports(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    num_threads: int = 1,
    env: dict[str, str] | None = None,
    group_timeout_s: Optional[float] = None,
    fresh_interpreter: bool = False,
    **kwargs: Any,
) -> Iterator[RankReport]:
    """Start `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks and yield each rank's
    `RankReport` as it comes (a value, a traceback, or a death without a result). Ends when every rank
    has reported or after `timeout_s`; either way every child is stopped (killed after a grace period)
    when the iteration ends or is abandoned. `group_timeout_s` bounds each collective's wait in the
    children (default `timeout_s`); `env` and `fresh_interpreter` as for `run_gloo`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context(fresh_interpreter)
    results = ctx.Queue()
    port = free_port()
    group_timeout_s = timeout_s if group_timeout_s is None else group_timeout_s
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, kwargs, results, group_timeout_s, num_threads, env or {}),
            daemon=False,  # a rank may start processes of its own (Megatron's torch_dist checkpoint writer
            # starts a multiprocessing Manager), which a daemonic process may not; `stop` ends every child
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    reported: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(reported) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reported]
                if dead and all(procs[r].exitcode not in (0, None) for r in dead):
                    # A child that died without reporting (segfault, OOM kill, SIGKILL) reports its exit code.
                    time.sleep(0.5)
                    if results.empty():
                        for r in dead:
                            reported.add(r)
                            yield RankReport(r, error=f"died without a result, exit code {procs[r].exitcode}",
                                             at=time.time())
                continue
            reported.add(rank)
            yield RankReport(rank, value=pickle.loads(value), at=time.time()) if ok else RankReport(
                rank, error=value, at=time.time())
    finally:
        stop(procs)


def stop(procs: list, grace_s: float = 5.0) -> None:
    """Join each child process; kill the ones still running after `grace_s` seconds."""
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
