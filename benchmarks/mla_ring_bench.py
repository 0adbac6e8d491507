"""Multi-latent attention: the latent ring against the K/V ring on the same layer and documents.

    python benchmarks/mla_ring_bench.py                       # CPU: gloo rings k = 1 2 4, then one process
    python benchmarks/mla_ring_bench.py --repeat 5            # 5 whole runs: median [min, max]
    python benchmarks/mla_ring_bench.py --sections simulated --device cuda --lengths 8K 16K 32K 64K 128K \
        --ranks 2 4 8 --time-budget 400                       # one GPU (bf16), as the coordinator runs it

The layer: DeepSeek-V3's attention at TP 8 by default (16 heads, q and k 128 + 64 RoPE wide, v 128,
latent 512), bf16 on CUDA and fp32 on the CPU. Two rings over the same document(s):
* K/V ring: each rank up-projects its own latent (Megatron's `linear_kv_up_proj`) and `ring_attention`
  moves K and V, 16 x (192 + 128) values per token;
* latent ring: `latent_ring_attention` moves the latent and the RoPE key, 512 + 64 values per token, and
  each member up-projects every block it receives.

Sections:
* `gloo` (CPU): k gloo ranks on this machine (one thread each), forward and forward+backward, wall time of
  the slowest rank, CPU seconds summed over ranks, and the bytes each rank sends (`count_traffic`).
* `simulated` (`--device`): k virtual ranks in one process (`simulated_ring_attention`,
  `simulated_latent_ring_attention`: the same ring programs, no communication) against one rank's
  up-projection + local attention: the latent ring's extra up-projection work, with the bytes each ring
  would send per rank (the cost model's count, `analytic_cost_model`), and the measured time of one
  up-projection per token beside the cost model's `up_projection_time`.
Every case is timed after one warm-up (`--repeats` timed iterations, median); a document length that
fails (out of memory) is recorded with its error and the run goes on; `--time-budget` seconds stop
starting new ring sizes (gloo) or lengths (simulated), and the JSON lists those skipped. Results go to
benchmarks/results/mla_ring_bench.json (mla_ring_bench_cuda.json for the simulated section on CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_hdp.attention import (count_traffic, latent_ring_attention, local_varlen_attention, ring_attention,
                                    simulated_latent_ring_attention, simulated_ring_attention, zigzag_token_indices)
from megatron_hdp.commands.arguments import parse_count
from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.plan.cost.presets import ModelShape, analytic_cost_model
from output import write_result
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement
from ring_bench import timed

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("gloo", "simulated")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--device", default="auto", help="simulated section: cpu, cuda or auto (cuda when present)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads of this TP rank")
    parser.add_argument("--qk-head-dim", type=int, default=128)
    parser.add_argument("--rope-dim", type=int, default=64, help="qk_pos_emb_head_dim")
    parser.add_argument("--v-head-dim", type=int, default=128)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--seqlens", type=parse_count, nargs="+", default=[1536, 512],
                        help="gloo section: the packed documents (one ring call over all of them)")
    parser.add_argument("--lengths", type=parse_count, nargs="+", default=[2048],
                        help="simulated section: one document of each length")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="ring sizes k")
    parser.add_argument("--repeats", type=int, default=2, help="timed iterations after one warm-up")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new case starts (the cases left are listed as skipped)")
    add_repeat_argument(parser)
    parser.add_argument("--output", default=None, help="result JSON (default results/mla_ring_bench[_cuda].json)")
    return parser.parse_args(argv)


def layer_shape(args) -> dict:
    return dict(heads=args.heads, qk_head_dim=args.qk_head_dim, rope_dim=args.rope_dim, v_head_dim=args.v_head_dim,
                kv_lora_rank=args.kv_lora_rank)


def layer_inputs(num_tokens: int, shape: dict, *, dtype, device) -> tuple[torch.Tensor, ...]:
    """q, latent, k_rope, up_weight of `num_tokens` packed tokens (fixed seed: the same on every rank)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    heads, qk, rope, v, rank = (shape[k] for k in ("heads", "qk_head_dim", "rope_dim", "v_head_dim", "kv_lora_rank"))
    tensors = (torch.randn(num_tokens, heads, qk + rope, generator=gen), torch.randn(num_tokens, rank, generator=gen),
               torch.randn(num_tokens, 1, rope, generator=gen),
               torch.randn(heads * (qk + v), rank, generator=gen) / rank**0.5)
    return tuple(x.to(device=device, dtype=dtype) for x in tensors)


def up_project(latent: torch.Tensor, k_rope: torch.Tensor, weight: torch.Tensor, shape: dict):
    """K and V as Megatron's MLASelfAttention makes them from the latent (`linear_kv_up_proj`, then split)."""
    kv = (latent @ weight.t()).view(latent.shape[0], shape["heads"], -1)
    key = torch.cat([kv[..., : shape["qk_head_dim"]], k_rope.expand(-1, shape["heads"], -1)], -1)
    return key, kv[..., shape["qk_head_dim"]:]


def layer_model(shape: dict) -> ModelShape:
    """A one-layer model of this attention shape (for the cost model's bytes and up-projection time)."""
    return ModelShape(1, 1, shape["heads"], shape["heads"], 1, 1, kv_lora_rank=shape["kv_lora_rank"],
                      qk_head_dim=shape["qk_head_dim"], qk_pos_emb_head_dim=shape["rope_dim"],
                      v_head_dim=shape["v_head_dim"])


def cost_model_bytes(shape: dict, *, tokens_per_rank: float, ring_size: int, dtype_bytes: int) -> dict:
    """Bytes one rank sends per layer (fwd + bwd) on each ring, by the cost model of this layer shape."""
    cost = analytic_cost_model(layer_model(shape), dtype_bytes=dtype_bytes)
    return {kind: cost.ring_bytes(num_tokens=tokens_per_rank, ring_size=ring_size, kind=kind)
            for kind in ("kv", "latent")}


# --- gloo section ----------------------------------------------------------------------------------
def _gloo_worker(rank: int, world_size: int, cfg: dict) -> dict:
    """This rank's samples (after one warm-up) of each ring: fwd/step wall and CPU seconds, bytes sent."""
    torch.set_num_threads(1)
    shape, seqlens, ring = cfg["shape"], cfg["seqlens"], list(range(world_size))
    rows = zigzag_token_indices(seqlens, world_size, rank)
    *per_token, weight = layer_inputs(sum(seqlens), shape, dtype=torch.float32, device="cpu")
    q, latent, k_rope = (x[rows] for x in per_token)
    dims = dict(qk_head_dim=shape["qk_head_dim"], v_head_dim=shape["v_head_dim"])

    def kv_ring(leaves):
        return ring_attention(leaves[0], *up_project(*leaves[1:], shape), seqlens=seqlens, ring=ring)

    def latent_ring(leaves):
        return latent_ring_attention(*leaves[:3], up_weight=leaves[3], seqlens=seqlens, ring=ring, **dims)

    samples = {}
    for name, attend in (("kv", kv_ring), ("latent", latent_ring)):
        runs = []
        for _ in range(cfg["repeats"] + 1):
            leaves = [x.clone().requires_grad_() for x in (q, latent, k_rope, weight)]
            dist.barrier()
            with count_traffic() as traffic:
                wall0, cpu0 = time.perf_counter(), time.process_time()
                out = attend(leaves)
                wall1, cpu1 = time.perf_counter(), time.process_time()
                out.backward(torch.ones_like(out))
                wall2, cpu2 = time.perf_counter(), time.process_time()
            runs.append(dict(fwd_wall=wall1 - wall0, step_wall=wall2 - wall0, fwd_cpu=cpu1 - cpu0, step_cpu=cpu2 - cpu0,
                             sent=traffic.bytes_sent))
        samples[name] = runs[1:]
    return samples


def gloo_section(args, started: float) -> dict:
    shape = layer_shape(args)
    cfg = dict(shape=shape, seqlens=args.seqlens, repeats=args.repeats)
    rows, skipped = [], []
    for k in args.ranks:
        if over_budget(args, started):
            skipped.append(k)
            continue
        per_rank = run_gloo(_gloo_worker, k, cfg, timeout_s=3600)
        row = {"k": k, "tokens_per_rank": sum(args.seqlens) / k}
        for kind in ("kv", "latent"):
            iterations = list(zip(*(r[kind] for r in per_rank)))
            for key in ("fwd", "step"):
                row[f"{kind}_{key}_wall_s"] = statistics.median(max(s[f"{key}_wall"] for s in it) for it in iterations)
                row[f"{kind}_{key}_cpu_s"] = statistics.median(sum(s[f"{key}_cpu"] for s in it) for it in iterations)
            row[f"{kind}_MB_sent_per_rank"] = max(s["sent"] for s in iterations[0]) / 2**20
        row["latent_over_kv_bytes"] = row["latent_MB_sent_per_rank"] / row["kv_MB_sent_per_rank"] if k > 1 else None
        row["latent_over_kv_step_cpu"] = row["latent_step_cpu_s"] / row["kv_step_cpu_s"]
        rows.append(row)
    return {"shape": {**shape, "seqlens": args.seqlens, "dtype": "float32"}, "rows": rows,
            "skipped_ring_sizes": skipped}


# --- simulated section -----------------------------------------------------------------------------
def simulated_cases(length: int, ring_sizes: list[int], shape: dict, *, dtype, device, repeats: int):
    """One document of `length` tokens: one rank's up-projection + local attention, then per k the K/V
    ring and the latent ring on k virtual ranks (rows yielded as they are measured)."""
    leaves = [x.requires_grad_() for x in layer_inputs(length, shape, dtype=dtype, device=device)]
    q, latent, k_rope, weight = leaves
    dims = dict(qk_head_dim=shape["qk_head_dim"], v_head_dim=shape["v_head_dim"])
    grad = torch.ones(length, shape["heads"], shape["v_head_dim"], dtype=dtype, device=device)

    def fwd_and_step(fn) -> tuple[float, float]:
        times = timed(fn, device=device, repeats=repeats), timed(lambda: fn().backward(grad), device=device,
                                                                   repeats=repeats)
        for x in leaves:
            x.grad = None
        return times

    local = fwd_and_step(lambda: local_varlen_attention(q, *up_project(latent, k_rope, weight, shape),
                                                        seqlens=[length]))
    with torch.no_grad():
        up_projection = timed(lambda: latent @ weight.t(), device=device, repeats=repeats) / length
    element = torch.empty((), dtype=dtype).element_size()
    for k in ring_sizes:
        kv = fwd_and_step(lambda: simulated_ring_attention(q, *up_project(latent, k_rope, weight, shape),
                                                           seqlens=[length], ring_size=k))
        lat = fwd_and_step(lambda: simulated_latent_ring_attention(q, latent, k_rope, up_weight=weight,
                                                                   seqlens=[length], ring_size=k, **dims))
        model = cost_model_bytes(shape, tokens_per_rank=length / k, ring_size=k, dtype_bytes=element)
        yield {"L": length, "k": k, "local_fwd_s": local[0], "local_step_s": local[1], "kv_fwd_s": kv[0],
               "kv_step_s": kv[1], "latent_fwd_s": lat[0], "latent_step_s": lat[1],
               "latent_over_kv_step": lat[1] / kv[1], "kv_over_local_step": kv[1] / local[1],
               "kv_model_MB_per_rank_layer": model["kv"] / 2**20,
               "latent_model_MB_per_rank_layer": model["latent"] / 2**20,
               "up_projection_ns_per_token": 1e9 * up_projection}


def simulated_section(args, started: float) -> dict:
    device = simulated_device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = layer_shape(args)
    rows, skipped = [], []
    ring_sizes = [k for k in args.ranks if k > 1]
    for length in args.lengths:
        if over_budget(args, started):
            skipped.append(length)
            continue
        try:
            for row in simulated_cases(length, ring_sizes, shape, dtype=dtype, device=device, repeats=args.repeats):
                rows.append(row)
                print_table(f"simulated on {device}", rows[-1:], header=len(rows) == 1)
        except (RuntimeError, ValueError) as error:  # out of memory, or no kernel: recorded, the run goes on
            rows.append({"L": length, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(f"L={length}: {rows[-1]['error']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    cost = analytic_cost_model(layer_model(shape))
    return {"device": name, "shape": {**shape, "dtype": str(dtype).removeprefix("torch.")}, "rows": rows,
            "skipped_lengths": skipped, "h100_model_up_projection_ns_per_token": 1e9 * cost.up_projection_time}


def simulated_device(args) -> torch.device:
    """`--device`, auto: CUDA when present."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


# --- driver ----------------------------------------------------------------------------------------
def over_budget(args, started: float) -> bool:
    return args.time_budget is not None and time.perf_counter() - started > args.time_budget


def print_table(title: str, rows: list[dict], *, header: bool = True) -> None:
    if header:
        print(f"\n{title}")
    if not rows:
        return
    columns = list(rows[0])
    cells = [[format_spread(r.get(c), "{:.4g}") if isinstance(r.get(c), (float, dict)) else str(r.get(c))
              for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if header:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)), flush=True)


def measure(args) -> dict:
    started = time.perf_counter()
    result = {}
    if "gloo" in args.sections:
        result["gloo"] = gloo_section(args, started)
        print_table(f"gloo rings, both kinds ({result['gloo']['shape']})", result["gloo"]["rows"])
    if "simulated" in args.sections:
        result["simulated"] = simulated_section(args, started)
    return result


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    runs = repeat_measurement(lambda: measure(args), args.repeat)
    combined = over_runs(runs)
    if args.repeat > 1 and "gloo" in combined:
        print(f"\nover {args.repeat} runs: median [min, max]")
        print_table("gloo rings", combined["spread"]["gloo"]["rows"])
    on_cuda = "simulated" in args.sections and simulated_device(args).type == "cuda"
    output = args.output or RESULTS / ("mla_ring_bench_cuda.json" if on_cuda else "mla_ring_bench.json")
    write_result(output, {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                          "command": "python benchmarks/mla_ring_bench.py " + " ".join(argv),
                          "machine": {"platform": platform.platform(), "torch": torch.__version__}, **combined},
                 indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
