"""Which dtype the ring backward's dK/dV partials should travel in: accuracy against traffic.

    python benchmarks/ring_grad_precision.py                 # bf16, one 1,024-token document, k = 1..64

The backward of zigzag ring attention passes each position's dK/dV partials around the ring (k hops),
every member adding its block gradient. Sent in fp32 (the accumulation dtype), the sum is rounded to
bf16 once at the owner; sent in bf16, it is rounded at every hop, so its error can grow with k. This
runs the same document (fixed length, fixed seed) through `simulated_ring_attention` (the runtime's ring
programs, k virtual members in one process) for k = 1, 2, 4, ..., 64 with both transports, and reports
the relative error (||x - ref|| / ||ref||) of dK, dV, dQ and out against a float64 reference (the local
kernel in float64 on the same rounded inputs), with the bytes each member sends per token of K/V
(units of one K+V buffer: forward k-1, backward k-1 K+V plus k dK+dV). Results go to
benchmarks/results/ring_grad_precision.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from megatron_hdp.attention import simulated_ring_attention


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _run(q, k, v, dout, *, seq_len: int, ring_size: int, grad_dtype) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = simulated_ring_attention(*leaves, seqlens=[seq_len], ring_size=ring_size, backend="auto",
                                   grad_dtype=grad_dtype)
    out.backward(dout)
    return [out.detach(), *(x.grad for x in leaves)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--ring-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ring_grad_precision.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype, element = torch.bfloat16, 2
    rows = []
    for k in args.ring_sizes:
        errors: dict[str, dict[str, list[float]]] = {"fp32": {}, "bf16": {}}
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            q, kk, v, dout = (torch.randn(args.seq_len, args.heads, args.head_dim, generator=gen).to(dtype)
                              for _ in range(4))
            want = _run(*(x.double() for x in (q, kk, v, dout)), seq_len=args.seq_len, ring_size=1, grad_dtype=None)
            for name, grad_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                got = _run(q, kk, v, dout, seq_len=args.seq_len, ring_size=k, grad_dtype=grad_dtype)
                for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                    errors[name].setdefault(label, []).append(_relative_error(g, w))
        units = {name: 2 * (k - 1) + k * size / element for name, size in (("fp32", 4), ("bf16", 2))}
        row = {"ring_size": k, **{f"{name}_{label}": max(v) for name in errors for label, v in errors[name].items()},
               "fp32_kv_units": units["fp32"] if k > 1 else 0, "bf16_kv_units": units["bf16"] if k > 1 else 0}
        rows.append(row)
        print(f"k={k:3d}  dK err fp32 {row['fp32_dk']:.2e} bf16 {row['bf16_dk']:.2e}   dV err fp32 "
              f"{row['fp32_dv']:.2e} bf16 {row['bf16_dv']:.2e}   dQ {row['fp32_dq']:.2e} out {row['fp32_out']:.2e}"
              f"   KV units/member fp32 {row['fp32_kv_units']:.0f} bf16 {row['bf16_kv_units']:.0f}", flush=True)
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim, "seeds": args.seeds,
              "dtype": "bfloat16", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
