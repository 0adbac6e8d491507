"""The cost model of one mesh, built in one place: `mesh_cost_model`.

install() (Megatron-LM's training loop), the Core-API trainer, `megatron-hdp plan | simulate | calibrate`
and the simulator's `ClusterSpec` all call it, so a mesh gets the same model whichever door it came in by.
What decides each field:

- the hardware, named (`--hdp-hardware`, `--hardware`) or detected from the device's name
  (`hardware_for_device`), never assumed: its FLOP/s, links and NVLink domain (`presets.HARDWARE`);
- the model shape and the run's TP and recompute: the analytic coefficients (`presets.analytic_cost_model`);
- a measured file (`megatron-hdp calibrate`, or a Core-API caller's own CostModel) replaces what it
  measured: a1, b1, g, a2, b2, the bandwidths, latency, jitter, ring block overhead, host memory, the
  activation dtype and its K/V bytes. A field the run needs that it lacks (0: `expert_share` and
  `expert_alltoall_bytes_per_token` of a MoE model, `latent_bytes_per_token` / `up_projection_time` of multi-latent attention; None:
  `intra_node_bandwidth`) is completed from the analytic model, with one log line naming the fields;
  the analytic times are scaled to the file's (the up-projection is a linear layer: the file's b1 times
  the analytic ratio), so only ratios and byte counts come from the analytic model;
- the run's flags, whatever a file says: ranks per node, the HDP ranks an MoE all-to-all couples
  (`timing.expert_unit_size` of TP, EP, expert TP), the ring kind (already resolved by the caller; None:
  auto) and, for the analytic model, the recompute granularity (a file keeps the one it was measured
  under, which `megatron.pretrain.args` warns about when it differs from the run's).

Ranks per node, the one rule: the explicit setting (`--hdp-ranks-per-node`, `--ranks-per-node`,
`ClusterSpec.gpus_per_node` / TP), else the hardware's NVLink domain / TP (8 / TP on HGX nodes, 72 / TP
on a GB200 NVL72 rack: the ring topology takes the NVLink domain as the node), else (a measured file on a
GPU without a preset, or without a GPU) no topology: every ring link at the file's ring bandwidth.

Pure: no torch, no Megatron.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.presets import (
    HARDWARE, HardwareProfile, ModelShape, analytic_cost_model, hardware_profile, model_shape,
)
from megatron_hdp.plan.cost.experts import expert_unit_size

logger = logging.getLogger(__name__)

CPU_HARDWARE = "h100"
"""The preset a run without a GPU plans with (CPU gloo runs, tests): what every run used before the
hardware was named, kept so that CPU runs plan as they did."""

_DEVICE_PRESETS = (("GB200", "gb200"), ("B300", "b300"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"),
                   ("A100", "a100"))
"""(substring of a CUDA device name, preset), most specific first ("NVIDIA GB200" also holds "B200")."""

_COMPLETED = {"expert_share": "a MoE model's expert-work spread",
              "expert_alltoall_bytes_per_token": "the MoE all-to-all's transfers", "latent_bytes_per_token": "the latent ring",
              "up_projection_time": "the latent ring", "intra_node_bandwidth": "rings inside an NVLink domain"}
"""Fields a measured file may lack that a run can need (module docstring), each with what needs it."""


def hardware_for_device(name: str) -> Optional[str]:
    """The preset for a CUDA device called `name` (torch.cuda.get_device_name()), or None without one.

    "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA GB200" -> gb200. A Grace superchip other than GB200 (GH200,
    GB300: "G" before the GPU's name) has no preset: its NVLink domain and links are not the HGX part's."""
    upper = name.upper()
    for key, preset in _DEVICE_PRESETS:
        if key in upper:
            return None if key != "GB200" and f"G{key}" in upper else preset
    return None


def resolve_hardware(*, flag: Optional[str], device_name: Optional[str], measured: bool) -> Optional[str]:
    """The hardware preset a run plans with: `flag` when given; else, with a `measured` cost model on a
    device without a preset (no GPU: `device_name` None, or an unknown one), None: the file's figures, no
    topology; else the preset of the CUDA device `device_name`, or `CPU_HARDWARE` without a GPU.
    ValueError for a GPU without a preset, a flag or a measured file."""
    if flag is not None:
        hardware_profile(flag)  # unknown name -> ValueError naming the known ones
        return flag
    preset = hardware_for_device(device_name) if device_name is not None else None
    if preset is not None or measured:
        return preset
    if device_name is None:
        return CPU_HARDWARE
    raise ValueError(f"GPU {device_name!r} has no hardware preset: name the closest with --hdp-hardware (one of "
                     f"{', '.join(sorted(HARDWARE))}) or measure it with `megatron-hdp calibrate` and pass "
                     "--hdp-cost-model")


def mesh_cost_model(
    *,
    model: ModelShape | str | None,
    hardware: HardwareProfile | str | None,
    tp_size: int = 1,
    ep_size: int = 1,
    etp_size: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
    ring_kind: Optional[str] = None,
    recompute_granularity: str = "none",
    measured: CostModel | str | Path | None = None,
) -> CostModel:
    """The cost model of a mesh (module docstring): analytic from `model` on `hardware` with TP
    `tp_size`, or `measured` (a CostModel or its JSON path) completed from that analytic model; then
    this run's ranks per node (explicit, else `hardware.nvlink_domain` // TP), expert unit
    (`expert_unit_size(tp_size, ep_size, etp_size)`) and `ring_kind` (None: auto).

    `model` may be None only with a `measured` model (nothing is completed then); `hardware` may be None
    only with a `measured` model (no topology unless `ranks_per_node` is given)."""
    if model is None and measured is None or hardware is None and measured is None:
        raise ValueError("mesh_cost_model needs a model shape and hardware, or a measured cost model")
    hw = hardware_profile(hardware) if isinstance(hardware, str) else hardware
    shape = model_shape(model) if isinstance(model, str) else model
    if measured is None:
        cost = analytic_cost_model(shape, hw, tp_size=tp_size, recompute_granularity=recompute_granularity)
    else:
        cost = _measured(measured, shape=shape, hardware=hw, tp_size=tp_size)
    if ranks_per_node is None and hw is not None:
        ranks_per_node = max(1, hw.nvlink_domain // tp_size)
    return dataclasses.replace(cost, ranks_per_node=ranks_per_node, ring_kind=ring_kind or "auto",
                               expert_parallel_size=expert_unit_size(tp_size=tp_size, ep_size=ep_size,
                                                                     etp_size=etp_size))


def _measured(measured: CostModel | str | Path, *, shape: Optional[ModelShape], hardware: Optional[HardwareProfile],
              tp_size: int) -> CostModel:
    """`measured` (read when a path) with the fields the run needs and it lacks completed (module docstring)."""
    where = "the given cost model"
    if not isinstance(measured, CostModel):
        where = str(measured)
        try:
            measured = CostModel.from_dict(json.loads(Path(measured).read_text()))
        except (ValueError, TypeError, OSError) as error:
            raise ValueError(f"cost model {where}: not a cost model JSON ({error}); write one with "
                             "`megatron-hdp calibrate`") from None
    fill: dict[str, float] = {}
    if shape is not None:
        # only its ratios and byte counts are used, so any preset serves when the GPU has none
        analytic = analytic_cost_model(shape, hardware or CPU_HARDWARE, tp_size=tp_size,
                                       dtype_bytes=measured.activation_dtype_bytes,
                                       recompute_granularity=measured.recompute_granularity)
        scale = measured.b1 / analytic.b1 if analytic.b1 else 0.0
        wanted = {"expert_share": analytic.expert_share, "latent_bytes_per_token": analytic.latent_bytes_per_token,
                  "expert_alltoall_bytes_per_token": analytic.expert_alltoall_bytes_per_token,
                  "up_projection_time": analytic.up_projection_time * scale}
        fill = {name: value for name, value in wanted.items() if value and not getattr(measured, name)}
    if hardware is not None and measured.intra_node_bandwidth is None:
        fill["intra_node_bandwidth"] = hardware.intra_node_bandwidth
    if fill:
        logger.warning("cost model %s lacks %s, which this run needs (%s): completed from the analytic model%s",
                       where, ", ".join(name for name in _COMPLETED if name in fill),
                       "; ".join(dict.fromkeys(why for name, why in _COMPLETED.items() if name in fill)),
                       " (times scaled to its b1)" if "up_projection_time" in fill else "")
    return dataclasses.replace(measured, **fill)
