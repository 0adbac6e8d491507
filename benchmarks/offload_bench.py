"""Selective activation offloading on one long sequence: memory, step time and exposed transfer time for
offload ratios 0, 0.5 and 1.0, and the longest sequence that fits at each.

    python benchmarks/offload_bench.py                     # CUDA: 64K tokens, 4-layer Llama-shaped GPT
    python benchmarks/offload_bench.py --device cpu        # reduced: bookkeeping and time only

On CUDA, memory is torch.cuda.max_memory_allocated during a step minus what was allocated before it
(weights and gradients), and the longest sequence is searched by doubling then bisecting until a step
runs out of memory. On CPU the copies are host-to-host, so memory is the saved-tensor accounting
(bytes autograd keeps minus bytes moved) and the longest sequence is extrapolated from it for a notional
`--cpu-budget-mib` budget. ByteScale's target: ratio 0.5 saves >= 30% activation memory with <= 3%
slowdown for sequences >= 64K. Results go to benchmarks/results/offload_bench.json with the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_hdp.offload import ActivationOffloader, OffloadConfig
from megatron_hdp.offload.reference_model import ReferenceGPT
from megatron_hdp.plan.presets import ModelShape

RESULTS = Path(__file__).resolve().parent / "results" / "offload_bench.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 65536 on CUDA, 2048 on CPU")
    parser.add_argument("--ratios", default="0,0.5,1.0")
    parser.add_argument("--num-layers", type=int, default=None, help="default: 4 (64K tokens of 8 layers keep ~85 GB of "
                        "activations at ratio 0: more than an 80 GB H100 holds)")
    parser.add_argument("--hidden-size", type=int, default=None, help="default: 2048 on CUDA, 128 on CPU")
    parser.add_argument("--num-attention-heads", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 5504 on CUDA, 352 on CPU")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per ratio (after one warm-up)")
    parser.add_argument("--min-tensor-mib", type=float, default=None, help="default: 1 on CUDA, 0 on CPU")
    parser.add_argument("--no-search", action="store_true", help="skip the longest-sequence search")
    parser.add_argument("--search-granularity", type=int, default=8192, help="tokens (CUDA search)")
    parser.add_argument("--host-memory-gib", type=float, default=96.0, help="pinned host memory a trial may use")
    parser.add_argument("--cpu-budget-mib", type=float, default=64.0, help="notional activation budget on CPU")
    parser.add_argument("--output", default=str(RESULTS))
    return parser.parse_args(argv)


def model_shape(args: argparse.Namespace, cuda: bool) -> ModelShape:
    def pick(value, gpu, cpu):
        return value if value is not None else (gpu if cuda else cpu)

    heads = pick(args.num_attention_heads, 16, 4)
    return ModelShape(
        num_layers=pick(args.num_layers, 4, 4),
        hidden_size=pick(args.hidden_size, 2048, 128),
        num_attention_heads=heads,
        num_query_groups=heads,
        ffn_hidden_size=pick(args.ffn_hidden_size, 5504, 352),
        vocab_size=args.vocab_size,
    )


def saved_bytes(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps for one step's backward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    del loss
    return sum(storages.values())


def run_step(model, offloader, batch, ratio, device) -> dict:
    """One forward + backward; seconds, peak activation bytes (CUDA) and the offload stats."""
    cuda = device.type == "cuda"
    model.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with offloader.microbatch(ratio=ratio):
        loss = model(*batch)
    loss.backward()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    stats = offloader.pop_step_stats()
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return {"seconds": seconds, "activation_peak_bytes": peak, "stats": stats}


def make_batch(shape: ModelShape, seq_len: int, device: torch.device):
    gen = torch.Generator().manual_seed(seq_len)
    tokens = torch.randint(0, shape.vocab_size, (1, seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def trial(model, offloader, shape, seq_len, ratio, device, host_bytes_per_token, host_budget) -> str | None:
    """None when one step of `seq_len` tokens runs, else what ran out ('gpu memory' or 'host budget')."""
    if host_bytes_per_token * seq_len > host_budget:
        return "host budget"
    try:
        run_step(model, offloader, make_batch(shape, seq_len, device), ratio, device)
        return None
    except torch.cuda.OutOfMemoryError:
        return "gpu memory"
    finally:
        offloader.pop_step_stats()
        offloader.pool.clear()  # buffers of other sizes would pile up over the trials
        model.zero_grad(set_to_none=False)
        torch.cuda.empty_cache()


def longest_fitting(model, offloader, shape, ratio, device, start, granularity, host_per_token, host_budget):
    """Largest multiple of `granularity` from `start` up that runs (doubling, then bisection), and what
    stopped the next size."""
    def fails(n):
        return trial(model, offloader, shape, n, ratio, device, host_per_token, host_budget)

    limit = fails(start)
    if limit:
        return 0, limit
    low, high = start, 2 * start
    while not (limit := fails(high)):
        low, high = high, 2 * high
    while high - low > granularity:
        mid = (low + high) // 2 // granularity * granularity
        if mid <= low:
            break
        reason = fails(mid)
        if reason:
            high, limit = mid, reason
        else:
            low = mid
    return low, limit


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = model_shape(args, cuda)
    seq_len = args.seq_len or (65536 if cuda else 2048)
    ratios = [float(r) for r in args.ratios.split(",")]
    dtype = torch.bfloat16 if cuda else torch.float32
    min_mib = args.min_tensor_mib if args.min_tensor_mib is not None else (1.0 if cuda else 0.0)
    torch.manual_seed(0)
    model = ReferenceGPT(shape, device=device, dtype=dtype)
    offloader = ActivationOffloader(
        layers=model.layers, config=OffloadConfig(min_tensor_bytes=int(min_mib * 2**20)), device=device
    )
    batch = make_batch(shape, seq_len, device)
    total_saved = saved_bytes(model, batch)
    rows = []
    for ratio in ratios:
        run_step(model, offloader, batch, ratio, device)  # warm-up: kernels, allocator, pinned pool
        runs = [run_step(model, offloader, batch, ratio, device) for _ in range(args.steps)]
        stats = runs[-1]["stats"]
        rows.append({
            "ratio": ratio,
            "step_time_s": statistics.median(r["seconds"] for r in runs),
            "activation_peak_bytes": runs[-1]["activation_peak_bytes"],
            "saved_bytes_resident": total_saved - stats.bytes_offloaded,
            "bytes_offloaded": stats.bytes_offloaded,
            "bytes_prefetched": stats.bytes_prefetched,
            "exposed_wait_s": statistics.median(r["stats"].exposed_wait_s for r in runs),
        })
    # The searches come after every ratio is timed: a trial that runs out of GPU memory can leave the
    # allocator fragmented, which must not weigh on the timed rows.
    for row in rows:
        if args.no_search:
            row["longest_seq_len"], row["longest_kind"] = None, "not searched"
        elif cuda:
            row["longest_seq_len"], limit = longest_fitting(
                model, offloader, shape, row["ratio"], device, seq_len, args.search_granularity,
                row["bytes_offloaded"] / seq_len, args.host_memory_gib * 2**30,
            )
            row["longest_kind"] = f"measured (search; next size stopped by {limit})"
        else:
            per_token = row["saved_bytes_resident"] / seq_len
            row["longest_seq_len"] = int(args.cpu_budget_mib * 2**20 / per_token)
            row["longest_kind"] = f"estimated: {args.cpu_budget_mib:g} MiB / resident saved bytes per token"
    report(rows, shape, seq_len, device, args)
    return 0


def report(rows: list[dict], shape: ModelShape, seq_len: int, device: torch.device, args) -> None:
    memory_key = "activation_peak_bytes" if device.type == "cuda" else "saved_bytes_resident"
    base = next((r for r in rows if r["ratio"] == 0.0), None)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'host copies'}), "
          f"{seq_len} tokens, {shape}")
    print(f"{'ratio':>6} {'step s':>9} {'slowdown':>9} {'act MiB':>10} {'saved':>7} {'moved MiB':>10} "
          f"{'exposed ms':>11} {'longest':>9}")
    for row in rows:
        if base:
            row["slowdown"] = row["step_time_s"] / base["step_time_s"] - 1
            row["activation_saving"] = 1 - row[memory_key] / base[memory_key]
        print(f"{row['ratio']:>6.2f} {row['step_time_s']:>9.4f} {row.get('slowdown', 0) * 100:>8.1f}% "
              f"{row[memory_key] / 2**20:>10.1f} {row.get('activation_saving', 0) * 100:>6.1f}% "
              f"{row['bytes_offloaded'] / 2**20:>10.1f} {row['exposed_wait_s'] * 1e3:>11.2f} "
              f"{row['longest_seq_len'] if row['longest_seq_len'] is not None else '-':>9}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/offload_bench.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "memory": "torch.cuda.max_memory_allocated - allocated before the step" if device.type == "cuda"
        else "saved-tensor accounting (bytes autograd keeps minus bytes moved)",
        "seq_len": seq_len,
        "shape": shape.__dict__,
        "rows": rows,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
