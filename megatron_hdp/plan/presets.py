"""Model shapes and hardware profiles, and the analytic cost model they imply.

The ByteScale paper's models (LLaMA-7B/13B/30B/70B, Mixtral-8x7B/8x22B) plus Llama-3-8B, gpt-oss-20b and
DeepSeek-V3 (with its multi-token prediction; plain attention for its MLA, see MODELS),
and H100/H200/A100-class GPUs. Analytic FLOPs per token per layer (forward; training = 3x), with q the
width of all query heads (h unless the head dim is set apart from h / heads, as gpt-oss's 64 x 64 on h = 2880):

    linear = 2 * (h * (q + 2 * kv) + q * h + n_mlp * h * ffn * top_k)    (QKV, proj, MLP; n_mlp = 3 for SwiGLU)
    attention(s) = 2 * s^2 * q                                          (QK^T and PV, causal half of 4 s^2 q)

plus the LM head 2 * h * vocab per token, spread over the layers. Activations (bf16, flash attention, no
recompute, sequence parallel over TP) keep ~ 2 * (6h + 2kv + 4ffn * top_k) bytes per token per layer.

Multi-token prediction of depth D (`mtp_num_layers`, DeepSeek-V3's MTP as Megatron builds it) adds D
transformer layers like the decoder's last (attention and MLP or MoE), each with its projection of the
concatenated [embedding; hidden state] (2h -> h) and three norms, and D more LM heads (one per depth on
the same weights): per token 2 * (2h^2 + 3h) + 2 * h * vocab per depth on top of a layer's linear FLOPs,
the same per-layer counts Megatron's `num_floating_point_operations` uses. Each MTP layer keeps a layer's
activations plus its projection's input (2h per token). The cost model stays per decoder layer, so the
MTP work is spread over the L decoder layers like the LM head: exact for a whole step without pipeline
parallelism; with PP Megatron puts the MTP block on the last stage, which the per-stage share
under-counts unless the layout moves decoder layers off that stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hdp.plan.cost_model import RECOMPUTE_GRANULARITIES, CostModel


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    num_experts: int = 0
    moe_router_topk: int = 1
    gated_mlp: bool = True
    head_dim: int = 0
    """Channels per attention head (Megatron's --kv-channels); 0: hidden_size / num_attention_heads."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth D (Megatron's --mtp-num-layers; 0: none): D extra transformer layers,
    projections and LM-head passes per token (module docstring)."""

    def __post_init__(self) -> None:
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")

    @property
    def channels_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_channels(self) -> int:
        """Width of Q (and of the attention output) over all query heads."""
        return self.channels_per_head * self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of K (or V) over all KV heads."""
        return self.channels_per_head * self.num_query_groups

    @property
    def active_experts(self) -> int:
        """MLPs each token runs through (1 for dense models)."""
        return self.moe_router_topk if self.num_experts else 1

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once each way; MoE counts every expert)."""
        h, q, kv, ffn = self.hidden_size, self.q_channels, self.kv_channels, self.ffn_hidden_size
        mlp = (3 if self.gated_mlp else 2) * h * ffn * max(1, self.num_experts)
        layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
        mtp_layer = layer + 2 * h * h + 3 * h  # its projection and norms; embedding and head are shared
        return self.num_layers * layer + self.mtp_num_layers * mtp_layer + 2 * self.vocab_size * h

    def expert_parameters(self) -> int:
        """Of `num_parameters`, the experts' (every expert's MLP in every layer; 0 for a dense model): what
        expert parallelism shards over EP x expert-TP ranks instead of TP."""
        if not self.num_experts:
            return 0
        return self.num_layers * (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size * self.num_experts


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and its links."""

    peak_flops: float
    """Dense bf16 FLOP/s."""
    efficiency: float
    """Fraction of peak reached by the linear layers (MFU of GEMMs)."""
    attention_efficiency: float
    """Fraction of peak reached by the attention kernel."""
    ring_bandwidth: float
    """Bytes/s of the point-to-point link a ring uses (inter-node per GPU)."""
    d2h_bandwidth: float
    h2d_bandwidth: float
    memory_bytes: float
    kernel_overhead: float = 20e-6
    """Seconds of launch overhead per layer per micro-batch."""
    host_memory_bytes: float = 256e9
    """Pinned host memory per GPU for offloaded activations (a 2 TB, 8-GPU node)."""
    intra_node_bandwidth: float = 450e9
    """Bytes/s of a point-to-point link inside a node (NVLink 4 per direction; `ring_bandwidth` is the
    link between nodes)."""


MODELS: dict[str, ModelShape] = {
    "llama-7b": ModelShape(32, 4096, 32, 32, 11008, 32000),
    "llama-13b": ModelShape(40, 5120, 40, 40, 13824, 32000),
    "llama-30b": ModelShape(60, 6656, 52, 52, 17920, 32000),
    "llama-70b": ModelShape(80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": ModelShape(32, 4096, 32, 8, 14336, 128256),
    "mixtral-8x7b": ModelShape(32, 4096, 32, 8, 14336, 32000, num_experts=8, moe_router_topk=2),
    "mixtral-8x22b": ModelShape(56, 6144, 48, 8, 16384, 32768, num_experts=8, moe_router_topk=2),
    # openai/gpt-oss-20b's config.json: 24 layers, hidden 2880, 64 query / 8 KV heads of 64 channels, 32 experts
    # of ffn 2880 with top-4, vocab 201088; attention sinks and a 128-token window on alternate layers change
    # neither FLOPs per token (a window only caps the attention term of half the layers) nor activations
    "gpt-oss-20b": ModelShape(24, 2880, 64, 8, 2880, 201088, num_experts=32, moe_router_topk=4, head_dim=64),
    # DeepSeek-V3-class (its config.json: 61 layers, hidden 7168, 128 heads, 256 routed experts of ffn 2048
    # with top-8 plus one shared expert, vocab 129280, one MTP module). Top-9: the shared expert runs for
    # every token like a routed one, and the first 3 dense layers' ffn 18432 = 9 x 2048, so every layer's
    # MLP FLOPs are DeepSeek-V3's. Attention is plain multi-head with 128 channels (v_head_dim) until the
    # cost model has multi-latent attention: its projections count 470M multiply-adds per token per layer
    # against MLA's 187M (the linear term ~48% high), its attention 128 channels per head against MLA's
    # mean of 192 (QK) and 128 (PV) (~20% low), its ring K/V 2 x 128 x 128 values per token against MLA's
    # 128 x (192 + 128) (K and V up-projected before the ring)
    "deepseek-v3": ModelShape(61, 7168, 128, 128, 2048, 129280, num_experts=256, moe_router_topk=9,
                              head_dim=128, mtp_num_layers=1),
}

HARDWARE: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(989e12, 0.55, 0.45, 50e9, 25e9, 25e9, 80e9),
    "h200": HardwareProfile(989e12, 0.55, 0.45, 50e9, 25e9, 25e9, 141e9),
    "a100": HardwareProfile(312e12, 0.55, 0.45, 25e9, 12e9, 12e9, 80e9, intra_node_bandwidth=300e9),
}


def _lookup(table: dict, name: str, what: str):
    try:
        return table[name.lower()]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}") from None


def model_shape(name: str) -> ModelShape:
    """The preset model shape called `name` (e.g. 'llama-7b')."""
    return _lookup(MODELS, name, "model")


def hardware_profile(name: str) -> HardwareProfile:
    """The preset hardware profile called `name` (e.g. 'h100')."""
    return _lookup(HARDWARE, name, "hardware")


def analytic_cost_model(
    model: ModelShape | str,
    hardware: HardwareProfile | str = "h100",
    *,
    tp_size: int = 1,
    dtype_bytes: int = 2,
    recompute_granularity: str = "none",
) -> CostModel:
    """Cost model from FLOP counts: every term divided by the TP size (sequence parallel).

    `recompute_granularity` (Megatron's flag): full keeps only each layer's input (h bytes per token) and
    runs the forward again in the backward (training FLOPs 4x the forward instead of 3x); selective
    (Megatron's default core_attn) runs attention's forward again and keeps what flash attention keeps
    anyway, so only the a1 term grows."""
    shape = model_shape(model) if isinstance(model, str) else model
    hw = hardware_profile(hardware) if isinstance(hardware, str) else hardware
    if tp_size <= 0:
        raise ValueError(f"tp_size must be positive, got {tp_size}")
    h, kv, ffn, experts = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size, shape.active_experts
    q = shape.q_channels
    n_mlp = 3 if shape.gated_mlp else 2
    layers, depth = shape.num_layers, shape.mtp_num_layers
    per_layer = (layers + depth) / layers  # MTP's transformer layers, spread over the decoder's (docstring)
    linear_flops = 2 * (h * (q + 2 * kv) + q * h + n_mlp * h * ffn * experts) * per_layer
    linear_flops += (depth * 2 * (2 * h * h + 3 * h) + (1 + depth) * 2 * h * shape.vocab_size) / layers
    attention_flops = 2 * q * per_layer  # per token^2 of a whole causal document
    if recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {recompute_granularity!r}")
    training = 3.0  # forward + backward
    attention_training = training + (recompute_granularity != "none")
    linear_training = training + (recompute_granularity == "full")
    kept = h if recompute_granularity == "full" else 6 * h + 2 * kv + 4 * ffn * experts
    kept = kept * per_layer + depth * 2 * h / layers  # each MTP layer also keeps its projection's input
    return CostModel(
        a1=attention_training * attention_flops / tp_size / (hw.peak_flops * hw.attention_efficiency),
        b1=linear_training * linear_flops / tp_size / (hw.peak_flops * hw.efficiency),
        g=hw.kernel_overhead,
        a2=dtype_bytes * kept / tp_size,
        b2=0.0,
        kv_bytes_per_token=dtype_bytes * 2 * kv / tp_size,
        activation_dtype_bytes=dtype_bytes,
        num_layers=shape.num_layers,
        ring_bandwidth=hw.ring_bandwidth,
        d2h_bandwidth=hw.d2h_bandwidth,
        h2d_bandwidth=hw.h2d_bandwidth,
        host_memory_bytes=hw.host_memory_bytes,
        intra_node_bandwidth=hw.intra_node_bandwidth,
        recompute_granularity=recompute_granularity,
    )
