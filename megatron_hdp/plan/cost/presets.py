"""Model shapes and hardware profiles, and the analytic cost model they imply.

The ByteScale paper's models (LLaMA-7B/13B/30B/70B, Mixtral-8x7B/8x22B) plus Llama-3-8B, gpt-oss-20b, two
multi-latent attention MoE models (DeepSeek-V3 with its multi-token prediction, and Moonlight-16B-A3B, their
published configs), and A100, H100, H200, B200, B300 and GB200 NVL72 GPUs (`HARDWARE`, each figure with its
source). Analytic FLOPs per token per layer (forward; training =
3x), with q the width of all query heads (h unless the head dim is set apart from h / heads, as gpt-oss's
64 x 64 on h = 2880):

    linear = 2 * (attention projections + n_mlp * h * ffn * top_k)      (n_mlp = 3 for SwiGLU)
             attention projections: h * (q + 2 * kv) + q * h (QKV, proj); multi-latent attention's
             q (down + up, or one projection), kv down, kv up and proj (`ModelShape.attention_linear`)
    attention(s) = s^2 * (H * Dqk + H * Dv)                             (QK^T and PV, causal half; 2 s^2 q
                                                                         without multi-latent attention)

plus the LM head 2 * h * vocab per token, spread over the layers; MoE models with dense first layers or
shared experts average the MLP over the layers. Activations (bf16, flash attention, no recompute, sequence
parallel over TP) keep ~ 2 * (4h + 2q + 2kv + 4ffn * top_k) bytes per token per layer (multi-latent
attention: its q, k, v, output and latents in place of 2q + 2kv).

Multi-token prediction of depth D (`mtp_num_layers`, DeepSeek-V3's MTP as Megatron builds it) adds D
transformer layers like the decoder's last (attention and MLP or MoE), each with its projection of the
concatenated [embedding; hidden state] (2h -> h) and three norms, and D more LM heads (one per depth on
the same weights): per token 2 * (2h^2 + 3h) + 2 * h * vocab per depth on top of a layer's linear FLOPs,
the same per-layer counts Megatron's `num_floating_point_operations` uses. Each MTP layer keeps a layer's
activations plus its projection's input (2h per token). The cost model stays per decoder layer, so the
MTP work is spread over the L decoder layers like the LM head: exact for a whole step without pipeline
parallelism; with PP Megatron puts the MTP block on the last stage, which the per-stage share
under-counts unless the layout moves decoder layers off that stage.

Ring attention per token and TP rank: the K/V ring moves K and V of this TP rank's heads, H/TP x (Dqk +
Dv) values (2 kv / TP without multi-latent attention); the latent ring (`attention.latent_ring`) moves
the latent and RoPE key, kv_lora_rank + qk_pos_emb_head_dim values on every TP rank, and up-projects
every received token: 2 kv_lora_rank H/TP (qk_head_dim + v_head_dim) FLOPs forward, 3x that backward
(recompute, latent gradient, weight gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hdp.plan.cost.model import RECOMPUTE_GRANULARITIES, CostModel


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (Megatron's argument names)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    """The MLP's hidden size: of every layer, or with `num_dense_layers` of the dense ones."""
    vocab_size: int
    num_experts: int = 0
    moe_router_topk: int = 1
    gated_mlp: bool = True
    head_dim: int = 0
    """Channels per attention head (Megatron's --kv-channels); 0: hidden_size / num_attention_heads."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth D (Megatron's --mtp-num-layers; 0: none): D extra transformer layers,
    projections and LM-head passes per token (module docstring)."""
    moe_ffn_hidden_size: Optional[int] = None
    """An expert's hidden size (None: `ffn_hidden_size`)."""
    moe_shared_expert_intermediate_size: int = 0
    """Hidden size of the shared experts every token runs (all of them together; 0: none)."""
    num_dense_layers: int = 0
    """The first layers' MLPs are dense (`ffn_hidden_size`), the rest MoE (Megatron's moe_layer_freq
    [0]*n+[1]*(L-n)); only with experts."""
    kv_lora_rank: Optional[int] = None
    """Multi-latent attention's latent width (None: standard attention; then the fields below are unused)."""
    q_lora_rank: Optional[int] = None
    """Multi-latent attention's query latent width (None: queries projected from the hidden state)."""
    qk_head_dim: int = 0
    """Multi-latent attention: the head dim of q and k without RoPE."""
    qk_pos_emb_head_dim: int = 0
    """Multi-latent attention: the RoPE part of q's and k's head dim (k's shared by all heads)."""
    v_head_dim: int = 0
    """Multi-latent attention: V's head dim."""

    def __post_init__(self) -> None:
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if self.is_mla and min(self.kv_lora_rank, self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim) < 1:
            raise ValueError(f"multi-latent attention needs kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim and "
                             f"v_head_dim >= 1, got {self}")
        if not 0 <= self.num_dense_layers <= self.num_layers or (self.num_dense_layers and not self.num_experts):
            raise ValueError(f"num_dense_layers {self.num_dense_layers} needs experts and at most num_layers "
                             f"{self.num_layers}")

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-latent (DeepSeek-V2/V3's)."""
        return self.kv_lora_rank is not None

    @property
    def channels_per_head(self) -> int:
        """Channels per head of standard attention."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_channels(self) -> int:
        """Width of Q (and of the attention output) over all query heads (standard attention)."""
        return self.channels_per_head * self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of K (or V) over all KV heads (standard attention)."""
        return self.channels_per_head * self.num_query_groups

    @property
    def kv_ring_channels(self) -> int:
        """Values of K and V of one token over all heads: what the K/V ring moves per token (before TP)."""
        if self.is_mla:
            return self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim)
        return 2 * self.kv_channels

    @property
    def latent_channels(self) -> int:
        """Values of the latent and RoPE key of one token (what the latent ring moves; 0 without MLA)."""
        return self.kv_lora_rank + self.qk_pos_emb_head_dim if self.is_mla else 0

    @property
    def up_projection_flops(self) -> int:
        """FLOPs of the K/V up-projection of one token over all heads (forward; 0 without MLA)."""
        heads = self.num_attention_heads
        return 2 * self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim) if self.is_mla else 0

    @property
    def attention_pair_flops(self) -> int:
        """Forward FLOPs per token pair of a causal document's attention: s^2 times this for s tokens."""
        if self.is_mla:
            return self.num_attention_heads * (self.qk_head_dim + self.qk_pos_emb_head_dim + self.v_head_dim)
        return 2 * self.q_channels

    @property
    def attention_linear(self) -> int:
        """Weights of one layer's attention projections (= forward FLOPs per token / 2)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            return h * (self.q_channels + 2 * self.kv_channels) + self.q_channels * h
        q_width = heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
        q = h * q_width if self.q_lora_rank is None else self.q_lora_rank * (h + q_width)
        kv = h * self.latent_channels + self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    @property
    def attention_activations(self) -> int:
        """Values of the attention block's tensors kept per token for the backward beyond the layer's 4h."""
        if not self.is_mla:
            return 2 * self.q_channels + 2 * self.kv_channels  # Q, output, K, V
        heads = self.num_attention_heads
        qk, v = heads * (self.qk_head_dim + self.qk_pos_emb_head_dim), heads * self.v_head_dim
        return 2 * qk + 2 * v + (self.q_lora_rank or 0) + self.latent_channels  # Q, K, V, output, latents

    @property
    def active_experts(self) -> int:
        """MLPs each token runs through (1 for dense models)."""
        return self.moe_router_topk if self.num_experts else 1

    def mlp_widths(self) -> float:
        """Mean over layers of the MLP hidden widths one token runs through (top-k experts, shared experts,
        dense layers): the MLP's FLOPs and activations per token scale with it."""
        if not self.num_experts:
            return float(self.ffn_hidden_size)
        dense = self.num_dense_layers
        return (dense * self.ffn_hidden_size + (self.num_layers - dense) * self.last_layer_mlp_width()) / self.num_layers

    def last_layer_mlp_width(self) -> float:
        """The MLP hidden width one token runs through in the decoder's last layer (an MTP layer's): its
        top-k experts and shared experts, or the dense MLP."""
        if not self.num_experts:
            return float(self.ffn_hidden_size)
        expert = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return float(expert * self.moe_router_topk + self.moe_shared_expert_intermediate_size)

    def routed_expert_widths(self) -> float:
        """Mean over the decoder's layers of the routed experts' hidden widths one token runs through, the
        MTP layers' included (spread over the decoder's as `analytic_cost_model` does): the MLP work the
        expert-parallel all-to-all moves to the experts' owners (0 for a dense model)."""
        if not self.num_experts:
            return 0.0
        expert = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return expert * self.moe_router_topk * self._moe_layers() / self.num_layers

    def routed_copies_per_token(self) -> float:
        """Mean over the decoder's layers (the MTP layers' spread over them) of the routed copies of one
        token the expert-parallel all-to-all dispatches: top-k in an MoE layer, 0 in a dense one."""
        return self.moe_router_topk * self._moe_layers() / self.num_layers if self.num_experts else 0.0

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once each way; MoE counts every expert; routers and norms
        of the latents left out). An MTP layer is one more layer like the decoder's last, with its
        projection and norms (its embedding and head are the model's)."""
        h, n_mlp, depth = self.hidden_size, 3 if self.gated_mlp else 2, self.mtp_num_layers
        dense = self.num_dense_layers if self.num_experts else self.num_layers + depth
        mlps = dense * n_mlp * h * self.ffn_hidden_size + self.expert_parameters()
        mlps += self._moe_layers() * n_mlp * h * self.moe_shared_expert_intermediate_size
        mtp = depth * (2 * h * h + 3 * h)
        return (self.num_layers + depth) * (self.attention_linear + 2 * h) + mlps + mtp + 2 * self.vocab_size * h

    def _moe_layers(self) -> int:
        """Layers with routed experts: the decoder's after its dense ones, and the MTP layers."""
        return self.num_layers - self.num_dense_layers + self.mtp_num_layers if self.num_experts else 0

    def expert_parameters(self) -> int:
        """Of `num_parameters`, the routed experts' (every expert's MLP in every MoE layer; 0 for a dense
        model): what expert parallelism shards over EP x expert-TP ranks instead of TP."""
        if not self.num_experts:
            return 0
        n_mlp = 3 if self.gated_mlp else 2
        expert = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return self._moe_layers() * n_mlp * self.hidden_size * expert * self.num_experts


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
    nvlink_domain: int = 8
    """GPUs one NVLink fabric joins: 8 in an HGX/DGX node, 72 in a GB200 NVL72 rack. The ring topology
    takes it as the node (`plan.cost.mesh.mesh_cost_model`: ranks per node = nvlink_domain / TP)."""


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
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 query / 4 KV heads of head_dim 128, every
    # layer MoE (mlp_only_layers []) with 128 experts of moe_intermediate_size 768, top-8, no shared expert,
    # vocab 151936 (30.5B parameters, 3.3B active); the RL frameworks' dynamic-CP reports use it (issue 39)
    "qwen3-30b-a3b": ModelShape(48, 2048, 32, 4, 6144, 151936, num_experts=128, moe_router_topk=8,
                                moe_ffn_hidden_size=768, head_dim=128),
    # deepseek-ai/DeepSeek-V3 config.json (= inference/configs/config_671B.json): 61 layers, the first 3
    # dense (intermediate_size 18432), then 256 routed experts (moe_intermediate_size 2048) + 1 shared,
    # top-8; MLA with q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; one MTP module
    # (num_nextn_predict_layers 1).
    "deepseek-v3": ModelShape(61, 7168, 128, 128, 18432, 129280, num_experts=256, moe_router_topk=8,
                              moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, num_dense_layers=3,
                              kv_lora_rank=512, q_lora_rank=1536, qk_head_dim=128, qk_pos_emb_head_dim=64,
                              v_head_dim=128, mtp_num_layers=1),
    # moonshotai/Moonlight-16B-A3B config.json: 27 layers, the first dense (intermediate_size 11264), 64
    # routed experts (1408) + 2 shared, top-6; MLA without a query latent (q_lora_rank null).
    "moonlight-16b-a3b": ModelShape(27, 2048, 16, 16, 11264, 163840, num_experts=64, moe_router_topk=6,
                                    moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2 * 1408,
                                    num_dense_layers=1, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                    v_head_dim=128),
}

HARDWARE: dict[str, HardwareProfile] = {
    # Per GPU: peak dense BF16 FLOP/s, HBM bytes, the NIC a GPU's ring crosses nodes over (`ring_bandwidth`,
    # one direction), NVLink one direction (`intra_node_bandwidth`: the datasheets' bidirectional figure / 2)
    # and the NVLink domain (GPUs one NVLink/NVSwitch fabric joins). Efficiencies and the D2H/H2D figures are
    # the project's working assumptions, not datasheet numbers.
    # H100 SXM datasheet: 989 TFLOPS dense BF16 (1,979 with sparsity), 80 GB HBM3, NVLink 900 GB/s; DGX H100
    # (docs.nvidia.com/dgx-basepod, core components): 8 GPUs, ConnectX-7 400 Gb/s per GPU.
    "h100": HardwareProfile(989e12, 0.55, 0.45, 50e9, 25e9, 25e9, 80e9),
    # H200 SXM: the H100's compute and NVLink (989 TFLOPS dense BF16, 900 GB/s) with 141 GB HBM3e; DGX H200:
    # 8 GPUs, ConnectX-7 400 Gb/s per GPU (same BasePOD page).
    "h200": HardwareProfile(989e12, 0.55, 0.45, 50e9, 25e9, 25e9, 141e9),
    # A100 SXM 80GB datasheet: 312 TFLOPS dense BF16, 80 GB, NVLink 600 GB/s (NVSwitch gen 2); DGX A100:
    # 8 GPUs, one ConnectX-6 200 Gb/s HDR NIC per GPU (not ConnectX-7: that came with DGX H100).
    "a100": HardwareProfile(312e12, 0.55, 0.45, 25e9, 12e9, 12e9, 80e9, intra_node_bandwidth=300e9),
    # HGX B200 datasheet: 36 PFLOPS dense BF16 and 1.44 TB HBM3e for 8 GPUs (2.25 PF, 180 GB each), NVLink 5
    # 1.8 TB/s per GPU; DGX B200 (BasePOD page): 8x ConnectX-7 400 Gb/s. PCIe Gen5 to the host as on H100.
    "b200": HardwareProfile(2.25e15, 0.55, 0.45, 50e9, 25e9, 25e9, 180e9, intra_node_bandwidth=900e9),
    # HGX B300 (Blackwell Ultra): dense BF16 as B200's, 2.25 PF (NVIDIA's uplift is FP4 and attention's
    # exponentials), 288 GB HBM3e (2.3 TB for 8), NVLink 5 1.8 TB/s; ConnectX-8 800 Gb/s per GPU; PCIe Gen6
    # to the host (twice Gen5's lanes' rate).
    "b300": HardwareProfile(2.25e15, 0.55, 0.45, 100e9, 50e9, 50e9, 288e9, intra_node_bandwidth=900e9),
    # GB200 NVL72 datasheet: 180 PFLOPS dense BF16 for 72 GPUs (2.5 PF each), 13.4 TB HBM3e (186 GB each),
    # one 72-GPU NVLink 5 domain at 1.8 TB/s per GPU; ConnectX-7 400 Gb/s per GPU between racks; the Grace
    # CPU's NVLink-C2C (900 GB/s for two GPUs) is the offload link, taken as 4x PCIe Gen5's figure.
    "gb200": HardwareProfile(2.5e15, 0.55, 0.45, 50e9, 100e9, 100e9, 186e9, intra_node_bandwidth=900e9,
                             nvlink_domain=72),
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
    h, layers, depth = shape.hidden_size, shape.num_layers, shape.mtp_num_layers
    n_mlp = 3 if shape.gated_mlp else 2
    per_layer = (layers + depth) / layers  # MTP's transformer layers, spread over the decoder's (docstring)
    layer_linear = 2 * (shape.attention_linear + n_mlp * h * shape.mlp_widths())
    mtp_linear = 2 * (shape.attention_linear + n_mlp * h * shape.last_layer_mlp_width() + 2 * h * h + 3 * h)
    linear_flops = layer_linear + (depth * mtp_linear + (1 + depth) * 2 * h * shape.vocab_size) / layers
    if recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {recompute_granularity!r}")
    training = 3.0  # forward + backward
    attention_training = training + (recompute_granularity != "none")
    linear_training = training + (recompute_granularity == "full")
    kept = h if recompute_granularity == "full" else 4 * h + shape.attention_activations + 4 * shape.mlp_widths()
    kept = kept * per_layer + depth * 2 * h / layers  # each MTP layer also keeps its projection's input
    return CostModel(
        a1=attention_training * shape.attention_pair_flops * per_layer / tp_size / (hw.peak_flops * hw.attention_efficiency),
        b1=linear_training * linear_flops / tp_size / (hw.peak_flops * hw.efficiency),
        g=hw.kernel_overhead,
        a2=dtype_bytes * kept / tp_size,
        b2=0.0,
        kv_bytes_per_token=dtype_bytes * shape.kv_ring_channels / tp_size,
        activation_dtype_bytes=dtype_bytes,
        num_layers=shape.num_layers,
        ring_bandwidth=hw.ring_bandwidth,
        d2h_bandwidth=hw.d2h_bandwidth,
        h2d_bandwidth=hw.h2d_bandwidth,
        host_memory_bytes=hw.host_memory_bytes,
        intra_node_bandwidth=hw.intra_node_bandwidth,
        recompute_granularity=recompute_granularity,
        latent_bytes_per_token=dtype_bytes * shape.latent_channels,
        up_projection_time=shape.up_projection_flops / tp_size / (hw.peak_flops * hw.efficiency),
        expert_share=2 * n_mlp * h * shape.routed_expert_widths() / linear_flops,
        expert_alltoall_bytes_per_token=dtype_bytes * h * shape.routed_copies_per_token() / tp_size,
    )
