"""Run a function on N gloo processes of this machine: the multi-rank harness of tests, benchmarks and
the CPU demo.

Every child initializes the default process group (gloo, a free loopback port), calls
`fn(rank, world_size, *args)`, and sends back its return value. The call ends by itself: a child's
exception is re-raised here with the child's traceback, and a run past `timeout_s` kills every child and
says which ranks had not finished — a multi-rank test never hangs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


class RankFailed(RuntimeError):
    """A child rank raised; the message carries its traceback."""


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return values by rank.

    `fn` and its arguments must be picklable (module-level function). `env` is applied in each child
    before torch is imported there.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, kwargs, results, timeout_s, num_threads, env or {}),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in values]
                if dead and all(p.exitcode not in (0, None) for p in (procs[r] for r in dead)):
                    # A child that died without reporting (segfault, OOM kill) fails the run now.
                    time.sleep(0.5)
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankFailed(f"ranks died without a result, exit codes {codes}")
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
    finally:
        stop(procs)
    return [values[rank] for rank in range(world_size)]


def stop(procs: list, grace_s: float = 5.0) -> None:
    """Join each child process; kill the ones still running after `grace_s` seconds."""
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
