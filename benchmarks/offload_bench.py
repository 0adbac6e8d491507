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
`--repeat N` times every ratio in N runs, one after the other (slowdowns taken within a run), and
reports median and range over the runs (`repeats.py`); the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_hdp.offload import ActivationOffloader, OffloadConfig
from megatron_hdp.offload.reference_model import ReferenceGPT
from megatron_hdp.plan.cost.presets import ModelShape
from output import write_result
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement

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
    add_repeat_argument(parser)
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
    """Bytes of the distinct storages autograd keeps for one step's backward (parameters excluded), from a
    forward that is never backpropagated: the pack hook keeps nothing. Returning the tensor itself would
    keep the whole graph alive after the loss is gone (a saved output refers back to its own node, a
    cycle through autograd the garbage collector cannot see: on the H100, 22.4 GiB held through every
    later trial of the longest-sequence search)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, torch.UntypedStorage] = {}  # held until the end, as a backward would: no address reuse

    def pack(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("saved_bytes' forward is for counting only: it cannot be backpropagated")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(*batch)
    return sum(storage.nbytes() for storage in storages.values())


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


def time_ratios(model, offloader, batch, ratios: list[float], device: torch.device, steps: int,
                total_saved: int) -> list[dict]:
    """One run: every ratio, one after the other (each after a warm-up step); slowdown and saving against
    ratio 0 of the same run."""
    memory_key = "activation_peak_bytes" if device.type == "cuda" else "saved_bytes_resident"
    rows = []
    for ratio in ratios:
        run_step(model, offloader, batch, ratio, device)  # warm-up: kernels, allocator, pinned pool
        runs = [run_step(model, offloader, batch, ratio, device) for _ in range(steps)]
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
    base = next((r for r in rows if r["ratio"] == 0.0), None)
    for row in rows if base else ():
        row["slowdown"] = row["step_time_s"] / base["step_time_s"] - 1
        row["activation_saving"] = 1 - row[memory_key] / base[memory_key]
    return rows


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
    print(f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'host copies'}), "
          f"{seq_len} tokens, {shape}")
    runs = repeat_measurement(
        lambda: {"rows": time_ratios(model, offloader, batch, ratios, device, args.steps, total_saved)},
        args.repeat, report=lambda _, result: print_rows(result["rows"], device))
    combined = over_runs(runs)
    # The searches come after every run is timed: a trial that runs out of GPU memory can leave the
    # allocator fragmented, which must not weigh on the timed rows. Memory does not vary between runs.
    for row in combined["rows"]:
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
    print(f"\n{'median' if args.repeat > 1 else 'result'} with the longest sequence:")
    print_rows(combined["rows"], device)
    if args.repeat > 1:
        print(f"\nover {args.repeat} runs: median [min, max]")
        print_rows(combined["spread"]["rows"], device)
    write_result(args.output, {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/offload_bench.py", *argv]),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "memory": "torch.cuda.max_memory_allocated - allocated before the step" if cuda
        else "saved-tensor accounting (bytes autograd keeps minus bytes moved)",
        "seq_len": seq_len,
        "shape": shape.__dict__,
        **combined,
    }, indent=2)
    return 0


def print_rows(rows: list[dict], device: torch.device) -> None:
    """The table of one run, of the medians, or of `repeats.over_runs`'s spread (median [min, max])."""
    memory_key = "activation_peak_bytes" if device.type == "cuda" else "saved_bytes_resident"

    def cell(row: dict, key: str, scale: float, fmt: str) -> str:
        return format_spread(row.get(key, 0), fmt, scale=scale)

    print(f"{'ratio':>6} {'step s':>24} {'slowdown':>24} {'act MiB':>10} {'saved':>7} {'moved MiB':>10} "
          f"{'exposed ms':>24} {'longest':>9}")
    for row in rows:
        longest = row.get("longest_seq_len")
        print(f"{row['ratio']:>6.2f} {cell(row, 'step_time_s', 1, '{:.4f}'):>24} "
              f"{cell(row, 'slowdown', 100, '{:.1f}%'):>24} {cell(row, memory_key, 2**-20, '{:.1f}'):>10} "
              f"{cell(row, 'activation_saving', 100, '{:.1f}%'):>7} {cell(row, 'bytes_offloaded', 2**-20, '{:.1f}'):>10} "
              f"{cell(row, 'exposed_wait_s', 1e3, '{:.2f}'):>24} {longest if longest is not None else '-':>9}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
