"""The one configuration of HDP: Megatron flags, the CLI and the planner all read these fields.

Field names are the flag names: Megatron's `ArgumentGroupFactory` turns `hdp_capacity` into
`--hdp-capacity` (and the field docstrings into the flag help), so no rename table exists anywhere.
Pure Python: importable by the planner, which never imports torch or Megatron.
"""

# No `from __future__ import annotations` here: Megatron's ArgumentGroupFactory reads `field.type`, which
# must be the real type (bool, int, Optional[str], Literal[...]), not its string.
import argparse
import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

PolicyName = Literal["balance", "naive", "naive-offload", "static", "megatron-hybrid-cp", "megatron-dynamic-cp"]
POLICIES: tuple[str, ...] = get_args(PolicyName)

OverlongDocuments = Literal["error", "truncate"]
OVERLONG_DOCUMENTS: tuple[str, ...] = get_args(OverlongDocuments)

AttentionBackendName = Literal["auto", "te_fused", "flash_attn", "torch_varlen", "flex", "cpu_flash"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)
"""`megatron_hdp.attention.backends.BACKENDS` by name, plus auto (named here: the config imports no torch)."""

RingKindName = Literal["auto", "kv", "latent"]
RING_KIND_NAMES: tuple[str, ...] = get_args(RingKindName)
"""`megatron_hdp.plan.cost.model.RING_KIND_SETTINGS` (named here: the config imports nothing of the planner)."""

HardwareName = Literal["a100", "h100", "h200", "b200", "b300", "gb200"]
HARDWARE_NAMES: tuple[str, ...] = get_args(HardwareName)
"""`megatron_hdp.plan.cost.presets.HARDWARE` by name (named here: the config imports nothing of the planner)."""

MockMixName = Literal["byted", "github", "rl-rollouts", "wikipedia", "prolong", "wlbllm"]
MOCK_MIXES: tuple[str, ...] = get_args(MockMixName)
"""`megatron_hdp.plan.lengths.DISTRIBUTIONS` by name (named here: the config imports no numpy)."""


@dataclass
class HDPConfig:
    """Hybrid Data Parallelism (ByteScale): one dynamic pool of DP x CP ranks, planned per step."""

    hdp: bool = False
    """Turn Hybrid Data Parallelism on: Megatron's data-parallel group becomes the HDP pool. HDP plans
    documents, not --seq-length windows: each document of a GPT/blended/mock dataset is one sequence (a
    document longer than --seq-length becomes consecutive pieces of at most --seq-length tokens, each its
    own sequence), each SFT conversation one sequence; --reset-attention-mask/--reset-position-ids are
    then implied (no-ops) and --eod-mask-loss masks EOD positions as Megatron does."""

    hdp_capacity: int = 4096
    """Tokens one rank holds in one micro-batch (C). A sequence longer than C is split over a ring."""

    hdp_policy: PolicyName = "balance"
    """Step planner: balance (ByteScale Alg. 2 + refinement), naive (Alg. 1), naive-offload (Alg. 1 with
    selective offload), static (DP x CP), megatron-hybrid-cp (Megatron-Core's BalancedCPScheduler),
    megatron-dynamic-cp (Megatron-LM dev's DefaultDynamicCPScheduler; needs MEGATRON_LM_DIR)."""

    hdp_offload: bool = field(
        default=True,
        # The factory would generate only --no-hdp-offload for a bool that defaults to True; users asked
        # for the on/off pair.
        metadata={"argparse_meta": {"arg_names": ["--hdp-offload"], "action": argparse.BooleanOptionalAction}},
    )
    """Let long sequences offload activations to host memory so they need fewer ranks (ByteScale Eq. 3)."""

    hdp_max_offload_ratio: float = 1.0
    """Largest fraction of a micro-batch's activations the planner may offload."""

    hdp_offload_min_tensor_bytes: Optional[int] = None
    """Saved activations smaller than this many bytes stay on the device when offloading (their copy costs
    more launch overhead than it frees). Unset: the offloader's default, 1 MiB; 0 moves every tensor
    (tiny test models)."""

    hdp_cost_model: Optional[str] = None
    """JSON of measured cost-model coefficients (from `megatron-hdp calibrate`); analytic if unset."""

    hdp_ranks_per_node: Optional[int] = None
    """HDP ranks per node for the planner's topology: rings that fit a node are placed inside one and run
    on its fast links (the cost model's `intra_node_bandwidth`). Unset: the hardware's NVLink domain
    (8 GPUs; 72 on GB200 NVL72) divided by the tensor-parallel size."""

    hdp_hardware: Optional[HardwareName] = None
    """The GPU the planner's cost model describes (its FLOP/s, links and NVLink domain; presets with their
    sources in plan/cost/presets.py). Unset: detected from the CUDA device's name; a GPU without a preset needs
    this flag or --hdp-cost-model; a run without a GPU plans as h100."""

    hdp_ring_kind: Optional[RingKindName] = None
    """Which ring a split document runs with --multi-latent-attention: kv (K and V circulate), latent (the
    normalised latent and the shared RoPE key circulate and every member up-projects them: about 9x fewer
    bytes at TP 8 for DeepSeek-V3), or auto (per ring call the one the cost model times faster). Unset:
    the cost model's setting (auto). Without multi-latent attention, or with --hdp-policy
    megatron-hybrid-cp, only kv runs: latent is refused there, auto says so once."""

    hdp_global_batch_tokens: Optional[int] = None
    """Tokens per global batch; the sampler takes whole documents until this budget is reached.
    Unset: the global batch is Megatron's --global-batch-size documents."""

    hdp_log_interval: int = 1
    """Steps between HDP statistics lines (balance, rings, attention bytes, offload)."""

    hdp_online_refit: bool = False
    """Refit the cost model's compute coefficients from the measured per-rank compute of every step,
    plan with the refitted model, and save it with each checkpoint (restored by --load)."""

    hdp_refit_warmup_steps: int = 2
    """Steps measured before --hdp-online-refit first changes the cost model."""

    hdp_overlong_documents: OverlongDocuments = "error"
    """A sequence longer than this run can train: error (stop, naming the document and the limit) or
    truncate (keep its first tokens that fit). The limit is the smaller of two: the model's maximum
    sequence length (Megatron's --seq-length, which the loader gets as max_length; RoPE tables and
    position embeddings are sized by it) and the longest document the whole HDP pool can hold
    (hdp_capacity x the pool's ranks, stretched by the offload ratio the cost model lets hide). GPT,
    blended and mock documents are already cut at --seq-length; SFT conversations are not."""

    hdp_attention_backend: AttentionBackendName = "auto"
    """Local attention kernel of HDP's attention (each ring step and each whole document): auto takes
    the fastest one installed for the device and dtype (logged once); naming one pins it, e.g. to
    compare kernels or to avoid one."""

    hdp_save_plans: Optional[str] = None
    """Directory where rank 0 writes each training step's StepPlan JSON (iter_0000001.json, ...), each
    sequence with its "source": dataset path prefix (or "mock"), document id and token offset."""

    hdp_mock_mix: Optional[MockMixName] = None
    """With --mock-data: draw the mock documents' lengths from this named mix (megatron_hdp.plan.lengths)
    instead of Megatron's uniform 1-4095 tokens, to try HDP on realistic lengths without data."""

    def __post_init__(self) -> None:
        if isinstance(self.hdp_capacity, bool) or not isinstance(self.hdp_capacity, numbers.Integral):
            raise ValueError(f"hdp_capacity must be an integer token count, got {self.hdp_capacity!r}")
        if self.hdp_capacity <= 0:
            raise ValueError(f"hdp_capacity must be a positive token count, got {self.hdp_capacity}")
        if self.hdp_overlong_documents not in OVERLONG_DOCUMENTS:
            raise ValueError(
                f"hdp_overlong_documents {self.hdp_overlong_documents!r} is not one of {', '.join(OVERLONG_DOCUMENTS)}"
            )
        if self.hdp_policy not in POLICIES:
            raise ValueError(f"hdp_policy {self.hdp_policy!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.hdp_max_offload_ratio <= 1.0:
            raise ValueError(f"hdp_max_offload_ratio must be in [0, 1], got {self.hdp_max_offload_ratio}")
        if self.hdp_offload_min_tensor_bytes is not None and self.hdp_offload_min_tensor_bytes < 0:
            raise ValueError(f"hdp_offload_min_tensor_bytes must be >= 0, got {self.hdp_offload_min_tensor_bytes}")
        if self.hdp_global_batch_tokens is not None and self.hdp_global_batch_tokens <= 0:
            raise ValueError(f"hdp_global_batch_tokens must be positive, got {self.hdp_global_batch_tokens}")
        if self.hdp_attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"hdp_attention_backend {self.hdp_attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.hdp_ring_kind is not None and self.hdp_ring_kind not in RING_KIND_NAMES:
            raise ValueError(f"hdp_ring_kind {self.hdp_ring_kind!r} is not one of {', '.join(RING_KIND_NAMES)}")
        if self.hdp_hardware is not None and self.hdp_hardware not in HARDWARE_NAMES:
            raise ValueError(f"hdp_hardware {self.hdp_hardware!r} is not one of {', '.join(HARDWARE_NAMES)}")
        if self.hdp_mock_mix is not None and self.hdp_mock_mix not in MOCK_MIXES:
            raise ValueError(f"hdp_mock_mix {self.hdp_mock_mix!r} is not one of {', '.join(MOCK_MIXES)}")
        if self.hdp_log_interval <= 0:
            raise ValueError(f"hdp_log_interval must be positive, got {self.hdp_log_interval}")
        if self.hdp_refit_warmup_steps < 0:
            raise ValueError(f"hdp_refit_warmup_steps must be >= 0, got {self.hdp_refit_warmup_steps}")

    @property
    def max_offload_ratio(self) -> float:
        """The offload ratio the planner may use: 0 when offloading is off."""
        return self.hdp_max_offload_ratio if self.hdp_offload else 0.0

    @classmethod
    def from_namespace(cls, args: object) -> "HDPConfig":
        """Read the fields from an argparse namespace (Megatron's `get_args()` or the CLI's)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(args, name) for name in names if hasattr(args, name)})
