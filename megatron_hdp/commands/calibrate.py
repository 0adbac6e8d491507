"""`megatron-hdp calibrate`: measure T(s), Act(s) and the offload bandwidths here; write the planner's JSON.

    megatron-hdp calibrate --model llama-7b --output cost_model.json        # on the GPU machine
    ... then train with the Megatron flag --hdp-cost-model cost_model.json

    megatron-hdp calibrate --from-run CHECKPOINT_DIR_OR_JSON --output cost_model.json
    megatron-hdp calibrate --from-run RUN_DIR --model llama-7b --output cost_model.json

`--from-run` exports what a run learned instead of measuring: the cost model --hdp-online-refit saved
(hdp_cost_model.json in the --save directory, or that file), or, from a run directory with the
TensorBoard telemetry and saved plans, the compute coefficients fitted to its measured per-rank times
(the rest of the model comes from --model and the shape flags).

The JSON is `CostModel.to_json` (what `--hdp-cost-model` reads); the measured points, the fit's
prediction for each and where the bandwidths came from go next to it (`--report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from megatron_hdp.commands.arguments import count_list, one_of, positive_float, positive_int

_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
_DTYPES = ("bfloat16", "float16", "float32")
_DEVICES = ("cuda", "cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the calibrate subcommand."""
    from megatron_hdp.plan.cost.presets import HARDWARE, MODELS

    parser.add_argument("--model", type=one_of(sorted(MODELS), "model"), default="llama-7b",
                        help="model shape preset (see plan/cost/presets.py)")
    for name in _SHAPE_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=None,
                            help=f"override the preset's {name}")
    parser.add_argument(
        "--seq-lens",
        type=count_list,
        default=None,
        help="comma-separated document lengths to time (default: 2K..32K on CUDA, 128..1024 on CPU)",
    )
    parser.add_argument("--device", type=one_of(_DEVICES, "device"), default=None,
                        help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", type=one_of(_DTYPES, "dtype"), default=None,
                        help=f"{', '.join(_DTYPES)} (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per length (fastest kept)")
    parser.add_argument("--hardware", type=one_of(sorted(HARDWARE), "hardware"), default="h100",
                        help="preset whose ring bandwidth is recorded (not measured)")
    parser.add_argument("--ring-bandwidth", type=positive_float, default=None,
                        help="bytes/s of a ring link (overrides --hardware)")
    parser.add_argument("--bandwidth-mib", type=positive_int, default=256, help="MiB per timed D2H/H2D copy")
    parser.add_argument(
        "--host-memory-gib",
        type=positive_float,
        default=None,
        help="pinned host memory one rank may fill with activations (default: half this machine's RAM "
        "shared by its GPUs)",
    )
    parser.add_argument(
        "--from-run",
        default=None,
        help="export a run's learned cost model instead of measuring: its --save directory or "
        "hdp_cost_model.json (--hdp-online-refit), or its run directory (TensorBoard telemetry + saved plans)",
    )
    parser.add_argument(
        "--recompute-granularity",
        choices=("none", "full"),
        default="none",
        help="measure under Megatron's activation recomputation (full: only each layer's input is kept, its "
        "forward runs twice); recorded in the JSON, and a run whose --recompute-granularity differs is warned",
    )
    parser.add_argument("--output", default="cost_model.json", help="where the cost model JSON goes")
    parser.add_argument("--report", default=None, help="measurements JSON (default: <output>.measurements.json)")


def _from_run(args: argparse.Namespace, shape) -> int:
    """Write the cost model a run learned (saved by its refit, or fitted to its telemetry)."""
    from megatron_hdp.plan.cost.model import CostModel
    from megatron_hdp.plan.cost.fit import fit_relative, fitted_cost_model
    from megatron_hdp.plan.cost.online_refit import REFIT_FILE, RefitSettings, compute_features
    from megatron_hdp.plan.cost.mesh import mesh_cost_model
    from megatron_hdp.run_logs import per_rank_series, read_plans, read_scalars

    source = Path(args.from_run)
    saved = source if source.is_file() else source / REFIT_FILE
    if saved.is_file():
        data = json.loads(saved.read_text())
        model = CostModel.from_dict(data["cost_model"] if "cost_model" in data else data)
        how = f"learned online over {data.get('steps_seen', '?')} steps ({saved})"
    else:
        compute = per_rank_series(read_scalars(source), "hdp/rank/compute-s")
        plans = read_plans(source)
        steps = sorted(set(plans) & set.intersection(*(set(v) for v in compute.values()))) if compute else []
        if not steps:
            raise ValueError(f"{source}: no {REFIT_FILE}, and no step with both telemetry and a saved plan")
        base = mesh_cost_model(model=shape, hardware=args.hardware)
        features = [compute_features(plans[s], num_layers=base.num_layers) for s in steps]
        measured = [[compute[r][s] for r in sorted(compute)] for s in steps]
        coefficients = fit_relative(np.concatenate(features), np.concatenate(measured),
                                    outlier_mads=RefitSettings().outlier_mads)
        model = fitted_cost_model(coefficients, base=base)
        how = f"fitted to the measured compute of {len(steps)} steps x {len(compute)} ranks ({source})"
    model.to_json(args.output)
    print(f"a1={model.a1:.3e} b1={model.b1:.3e} g={model.g:.3e}: {how}")
    print(f"wrote {args.output}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Calibrate, write the JSON files, print the fit next to the measurements."""
    import torch

    from megatron_hdp.harness.calibrate import calibrate
    from megatron_hdp.plan.cost.presets import hardware_profile, model_shape

    shape = model_shape(args.model)
    overrides = {name: getattr(args, name) for name in _SHAPE_FLAGS if getattr(args, name) is not None}
    shape = dataclasses.replace(shape, **overrides)
    if args.from_run is not None:
        return _from_run(args, shape)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    default_lens = [2048, 4096, 8192, 16384, 32768] if device.type == "cuda" else [128, 256, 512, 1024]
    seq_lens = args.seq_lens or default_lens
    ring_bandwidth = args.ring_bandwidth or hardware_profile(args.hardware).ring_bandwidth
    if args.host_memory_gib is not None:
        host_memory = args.host_memory_gib * 2**30
    else:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_memory = physical / 2 / max(1, torch.cuda.device_count())
    result = calibrate(
        shape=shape,
        seq_lens=seq_lens,
        device=device,
        dtype=dtype,
        ring_bandwidth=ring_bandwidth,
        repeats=args.repeats,
        bandwidth_bytes=args.bandwidth_mib << 20,
        host_memory_bytes=host_memory,
        recompute=args.recompute_granularity,
    )
    output = Path(args.output)
    report = Path(args.report) if args.report else output.with_suffix(".measurements.json")
    result.cost_model.to_json(output)
    report.write_text(json.dumps(result.report(), indent=2) + "\n")
    print(f"{'tokens':>8} {'measured ms':>12} {'fit ms':>9} {'act MiB':>9}")
    for sample in result.samples:
        print(
            f"{sample.seq_len:>8} {sample.seconds * 1e3:>12.3f} {result.predicted_seconds(sample.seq_len) * 1e3:>9.3f} "
            f"{sample.activation_bytes / 2**20:>9.1f}"
        )
    cm = result.cost_model
    print(f"a1={cm.a1:.3e} b1={cm.b1:.3e} g={cm.g:.3e} a2={cm.a2:.1f} b2={cm.b2:.1f}")
    print(
        f"d2h={cm.d2h_bandwidth / 1e9:.1f} GB/s h2d={cm.h2d_bandwidth / 1e9:.1f} GB/s ({result.bandwidth.source}); "
        f"ring {ring_bandwidth / 1e9:.1f} GB/s from {'--ring-bandwidth' if args.ring_bandwidth else args.hardware}; "
        f"host memory per rank {host_memory / 2**30:.1f} GiB"
    )
    print(f"wrote {output} and {report}")
    return 0
