"""Ring attention cost: a document of L tokens over k ranks against the same attention on one rank.

    python benchmarks/ring_bench.py                          # CPU: L=4096, k = 1 2 4 8; GPU part if CUDA
    python benchmarks/ring_bench.py --seq-len 8192 --repeats 5
    python benchmarks/ring_bench.py --repeat 5               # 5 whole runs: each figure as median [min, max]

CPU (always): for each k, k gloo ranks on this machine (one thread each) run `ring_attention` on their
zigzag shards of one causal document, forward and forward+backward, `--repeats` timed iterations after
one warm-up; k = 1 is the local kernel on one rank. Reported per k: wall time (slowest rank; on a machine
with fewer cores than k the ranks time-share, so wall grows with k), CPU seconds summed over ranks
(the total work, robust to other load on the machine) and its ratio to k = 1 (the ring's overhead; 1.0
means no extra work), and attention bytes sent per rank (from `count_traffic`). A second table times
the ring's decomposition without any communication: `simulated_ring_attention` (the same ring programs
for k virtual ranks in one process) against one local call, one thread, in CPU seconds.

GPU (only when torch.cuda.is_available()): local-kernel throughput in TFLOP/s (causal: forward
2*L^2*D*Hq, backward 2.5x that) of every available backend for 4K-128K-token documents, and the
decomposition overhead of k virtual ranks on one GPU against a single varlen call over the same tokens
(target: within 1.25x). Results go to benchmarks/results/ring_bench.json with the command and the date.
`--repeat N` runs all of it N times (each ratio taken within its run) and reports median and range over
the runs (`repeats.py`); the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_hdp.attention import (
    available_backends,
    count_traffic,
    get_backend,
    local_varlen_attention,
    ring_attention,
    simulated_ring_attention,
    zigzag_token_indices,
)
from megatron_hdp.attention.backends import Segments
from megatron_hdp.comm.launch import run_gloo
from output import write_result
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement

RESULTS = Path(__file__).resolve().parent / "results" / "ring_bench.json"
GPU_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="CPU document length L")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="ring sizes k")
    parser.add_argument("--heads", type=int, default=8, help="query heads (CPU)")
    parser.add_argument("--kv-heads", type=int, default=2, help="kv heads (CPU)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed iterations after one warm-up, within a run (--repeat: whole runs)")
    add_repeat_argument(parser)
    parser.add_argument("--gpu-heads", type=int, default=16)
    parser.add_argument("--gpu-kv-heads", type=int, default=8)
    parser.add_argument("--gpu-head-dim", type=int, default=128)
    parser.add_argument("--gpu-lengths", type=int, nargs="+", default=list(GPU_LENGTHS))
    parser.add_argument("--output", default=str(RESULTS))
    return parser.parse_args(argv)


def document(length: int, heads: int, kv_heads: int, head_dim: int, *, dtype=torch.float32, device="cpu"):
    """q, k, v of one packed document (same on every rank: fixed seed)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randn(length, h, head_dim, generator=gen, dtype=dtype, device=device)
        for h in (heads, kv_heads, kv_heads)
    ]


def causal_flops(length: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention over one document (two matmuls, half the scores)."""
    return 2.0 * length * length * head_dim * heads


def _rank_worker(rank: int, world_size: int, cfg: dict) -> list[dict]:
    """One rank's timings and bytes per iteration (the first is the warm-up)."""
    ring = list(range(world_size))
    q, k, v = document(cfg["seq_len"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
    rows = zigzag_token_indices([cfg["seq_len"]], world_size, rank)
    shards = [x[rows].requires_grad_() for x in (q, k, v)]
    grad = torch.ones(len(rows), cfg["heads"], cfg["head_dim"])
    samples = []
    for _ in range(cfg["repeats"] + 1):
        dist.barrier()
        with count_traffic() as step_traffic:
            wall0, cpu0 = time.perf_counter(), time.process_time()
            with count_traffic() as forward_traffic:
                out = ring_attention(*shards, seqlens=[cfg["seq_len"]], ring=ring)
            wall1, cpu1 = time.perf_counter(), time.process_time()
            out.backward(grad)
            wall2, cpu2 = time.perf_counter(), time.process_time()
        samples.append(
            dict(
                fwd_wall=wall1 - wall0,
                step_wall=wall2 - wall0,
                fwd_cpu=cpu1 - cpu0,
                step_cpu=cpu2 - cpu0,
                fwd_sent=forward_traffic.bytes_sent,
                step_sent=step_traffic.bytes_sent,
                step_received=step_traffic.bytes_received,
            )
        )
    return samples[1:]


def cpu_ring_vs_local(args: argparse.Namespace) -> list[dict]:
    """Per ring size: the ring over k gloo ranks against the local kernel on one rank."""
    cfg = dict(
        seq_len=args.seq_len, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, repeats=args.repeats
    )
    rows = []
    for ring_size in args.ranks:
        per_rank = run_gloo(_rank_worker, ring_size, cfg, timeout_s=1800)
        iterations = list(zip(*per_rank))  # per iteration, every rank's sample
        first = iterations[0]  # bytes are the same every iteration
        row = dict(k=ring_size, tokens_per_rank=args.seq_len // ring_size)
        for key in ("fwd", "step"):
            row[f"{key}_wall_s"] = statistics.median(max(s[f"{key}_wall"] for s in it) for it in iterations)
            row[f"{key}_cpu_s"] = statistics.median(sum(s[f"{key}_cpu"] for s in it) for it in iterations)
        row["fwd_MB_sent_per_rank"] = max(s["fwd_sent"] for s in first) / 2**20
        row["step_MB_sent_per_rank"] = max(s["step_sent"] for s in first) / 2**20
        row["step_MB_received_per_rank"] = max(s["step_received"] for s in first) / 2**20
        rows.append(row)
    base = next((r for r in rows if r["k"] == 1), None)
    for row in rows:
        for key in ("fwd", "step"):
            row[f"{key}_cpu_overhead"] = row[f"{key}_cpu_s"] / base[f"{key}_cpu_s"] if base else None
    return rows


def timed(fn: Callable[[], object], *, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after one warm-up.

    CUDA: wall time between synchronizations. CPU: this process's CPU time, which for one thread is the
    wall time of an idle machine and is not inflated by other processes sharing the cores.
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - start)
    return statistics.median(times[1:])


def decomposition(
    length: int, ring_sizes: list[int], *, heads: int, kv_heads: int, head_dim: int, dtype, device, repeats: int
) -> list[dict]:
    """k virtual ranks in one process (ring programs, no communication) against one local call."""
    q, k, v = (x.requires_grad_() for x in document(length, heads, kv_heads, head_dim, dtype=dtype, device=device))
    grad = torch.ones_like(q)

    def step(attend):
        out = attend()
        out.backward(grad)

    local = lambda: local_varlen_attention(q, k, v, seqlens=[length])  # noqa: E731
    base_fwd = timed(local, device=device, repeats=repeats)
    base_step = timed(lambda: step(local), device=device, repeats=repeats)
    rows = []
    for ring_size in ring_sizes:
        ring = lambda: simulated_ring_attention(q, k, v, seqlens=[length], ring_size=ring_size)  # noqa: E731
        fwd = timed(ring, device=device, repeats=repeats)
        full = timed(lambda: step(ring), device=device, repeats=repeats)
        rows.append(
            dict(
                L=length,
                k=ring_size,
                local_fwd_s=base_fwd,
                ring_fwd_s=fwd,
                fwd_ratio=fwd / base_fwd,
                local_step_s=base_step,
                ring_step_s=full,
                step_ratio=full / base_step,
            )
        )
    return rows


def kernel_throughput(args: argparse.Namespace, device: torch.device, dtype) -> list[dict]:
    """TFLOP/s of each available backend's forward and backward, causal, one document of L tokens."""
    rows = []
    for name in available_backends(device, dtype):
        backend = get_backend(name, device=device, dtype=dtype)
        for length in args.gpu_lengths:
            q, k, v = document(
                length, args.gpu_heads, args.gpu_kv_heads, args.gpu_head_dim, dtype=dtype, device=device
            )
            segments = Segments((length,), (length,), device)
            scale = args.gpu_head_dim**-0.5
            out, lse = backend.forward(q, k, v, segments=segments, causal=True, scale=scale)
            dout = torch.randn_like(out)
            fwd = timed(
                lambda: backend.forward(q, k, v, segments=segments, causal=True, scale=scale),
                device=device,
                repeats=args.repeats,
            )
            bwd = timed(
                lambda: backend.backward(dout, q, k, v, out, lse, segments=segments, causal=True, scale=scale),
                device=device,
                repeats=args.repeats,
            )
            flops = causal_flops(length, args.gpu_heads, args.gpu_head_dim)
            rows.append(
                dict(
                    backend=name,
                    L=length,
                    fwd_ms=fwd * 1e3,
                    bwd_ms=bwd * 1e3,
                    fwd_tflops=flops / fwd / 1e12,
                    bwd_tflops=2.5 * flops / bwd / 1e12,
                )
            )
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    if not rows:
        print("  (none)")
        return
    columns = list(rows[0])
    cells = [[format_spread(r[c], "{:.4g}") if isinstance(r[c], (float, dict)) else str(r[c]) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)))


def cpu_section(args: argparse.Namespace) -> dict:
    shape = dict(L=args.seq_len, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    section = {"shape": {**shape, "dtype": "float32"}, "ring_vs_local": cpu_ring_vs_local(args)}
    section["decomposition"] = decomposition(
        args.seq_len,
        [k for k in args.ranks if k > 1],
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
        repeats=args.repeats,
    )
    return section


def gpu_section(args: argparse.Namespace) -> dict:
    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = dict(heads=args.gpu_heads, kv_heads=args.gpu_kv_heads, head_dim=args.gpu_head_dim)
    section = {"device": torch.cuda.get_device_name(device), "shape": {**shape, "dtype": "bfloat16"}}
    section["kernel_throughput"] = kernel_throughput(args, device, dtype)
    section["decomposition"] = [
        row
        for length in args.gpu_lengths
        for row in decomposition(
            length,
            [k for k in args.ranks if k > 1],
            heads=args.gpu_heads,
            kv_heads=args.gpu_kv_heads,
            head_dim=args.gpu_head_dim,
            dtype=dtype,
            device=device,
            repeats=args.repeats,
        )
    ]
    return section


def print_result(result: dict) -> None:
    """The tables of one run, or of `repeats.over_runs`'s spread (median [min, max] where a figure varied)."""
    cpu = result["cpu"]
    print_table(f"CPU: ring over k gloo ranks vs one rank ({cpu['shape']}, causal)", cpu["ring_vs_local"])
    print_table("CPU: k virtual ranks in one process (no communication) vs one local call", cpu["decomposition"])
    gpu = result["gpu"]
    if isinstance(gpu, str):
        print(f"\nGPU: {gpu}")
        return
    print_table(f"GPU: local kernels on {gpu['device']} ({gpu['shape']}, causal)", gpu["kernel_throughput"])
    print_table("GPU: k virtual ranks on one GPU vs one varlen call (target ratio <= 1.25)", gpu["decomposition"])


def measure(args: argparse.Namespace) -> dict:
    """One run: the CPU section, and the GPU section when CUDA is present."""
    cpu = cpu_section(args)
    gpu = gpu_section(args) if torch.cuda.is_available() else "not measured: no CUDA device on this machine"
    return {"cpu": cpu, "gpu": gpu}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    runs = repeat_measurement(lambda: measure(args), args.repeat, report=lambda _, result: print_result(result))
    combined = over_runs(runs)
    if args.repeat > 1:
        print(f"\nover {args.repeat} runs: median [min, max]")
        print_result(combined["spread"])
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/ring_bench.py " + " ".join(argv),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpu_threads_per_rank": 1},
        **combined,
    }
    write_result(args.output, result, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
