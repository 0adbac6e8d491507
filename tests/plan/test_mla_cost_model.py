"""Multi-latent attention in the cost model, the presets and the plan: bytes, FLOPs, the ring kind.

Independent arithmetic from the published configs (DeepSeek-V3, Moonlight-16B-A3B) and hand formulas;
the gloo byte counts of both rings are in tests/comm/test_ring_traffic.py, the planner / timing / simulator
agreement with both kinds in tests/plan/test_timing_model.py and tests/plan/test_plan_sim_agreement.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import MODELS, ModelShape, analytic_cost_model, hardware_profile, model_shape
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.sim.cluster import ClusterSpec

DEEPSEEK = analytic_cost_model(dataclasses.replace(model_shape("deepseek-v3"), mtp_num_layers=0), tp_size=8)
"""DeepSeek-V3's decoder layers at TP 8 (the preset's MTP layer would add 1/61 to every per-layer term)."""
LINK = 50e9  # the h100 preset's link between nodes


def test_deepseek_v3_and_moonlight_presets_have_their_published_sizes():
    """671B parameters of which 37B active (DeepSeek-V3 report), 685B with its MTP module (its model card:
    671B of the main model and 14B of MTP weights); Moonlight "16B total, 3B active"."""
    assert model_shape("deepseek-v3").num_parameters() == pytest.approx(685e9, rel=0.01)
    for name, total, active in (("deepseek-v3", 671e9, 37e9), ("moonlight-16b-a3b", 16e9, 3e9)):
        shape = dataclasses.replace(model_shape(name), mtp_num_layers=0)  # the main model
        experts = shape.expert_parameters()
        activated = shape.num_parameters() - experts + experts * shape.moe_router_topk / shape.num_experts
        assert shape.num_parameters() == pytest.approx(total, rel=0.01), name
        assert activated == pytest.approx(active, rel=0.1), name


def test_per_token_ring_bytes_and_up_projection_of_deepseek_v3_at_tp8():
    """Issue 34's numbers: 16 heads x (192 + 128) x 2 B = 10,240 B of K/V per token, 576 x 2 B = 1,152 B of
    latent (not split by TP), 2 x 512 x 16 x 256 FLOPs to up-project one token; attention FLOPs per token
    pair 2.5x LLaMA-70B's."""
    assert DEEPSEEK.kv_bytes_per_token == 16 * (192 + 128) * 2
    assert DEEPSEEK.latent_bytes_per_token == 576 * 2
    assert DEEPSEEK.kv_grad_bytes_per_token == 2 * DEEPSEEK.kv_bytes_per_token  # fp32 partials
    assert DEEPSEEK.grad_bytes_per_token("latent") == 576 * 4
    hw = hardware_profile("h100")
    assert DEEPSEEK.up_projection_time == pytest.approx(2 * 512 * 16 * 256 / (hw.peak_flops * hw.efficiency))
    assert DEEPSEEK.a1 / analytic_cost_model("llama-70b", tp_size=8).a1 == pytest.approx(128 * 320 / (2 * 8192))
    # TP 1: 70x fewer bytes per token on the latent ring (128 x 320 / 576)
    full = analytic_cost_model("deepseek-v3", tp_size=1)
    assert full.kv_bytes_per_token / full.latent_bytes_per_token == pytest.approx(128 * 320 / 576)


def _old_formula(shape: ModelShape, tp: int) -> dict:
    """The analytic cost model as it was before multi-latent attention (standard attention only)."""
    h, kv, ffn, experts = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size, shape.active_experts
    linear = 2 * (h * (h + 2 * kv) + h * h + 3 * h * ffn * experts) + 2 * h * shape.vocab_size / shape.num_layers
    hw = hardware_profile("h100")
    return dict(a1=3 * 2 * h / tp / (hw.peak_flops * hw.attention_efficiency),
                b1=3 * linear / tp / (hw.peak_flops * hw.efficiency),
                a2=2 * (6 * h + 2 * kv + 4 * ffn * experts) / tp, kv_bytes_per_token=2 * 2 * kv / tp)


@pytest.mark.parametrize("name", ["llama-7b", "llama-13b", "llama-30b", "llama-70b", "llama3-8b", "mixtral-8x7b",
                                  "mixtral-8x22b"])
def test_standard_attention_presets_keep_their_numbers(name):
    model = analytic_cost_model(name, tp_size=8)
    for field, value in _old_formula(MODELS[name], 8).items():
        assert getattr(model, field) == pytest.approx(value, rel=1e-12), field
    assert (model.latent_bytes_per_token, model.up_projection_time) == (0, 0)
    assert model.ring_kind_for(num_tokens=100, attention=0.0, ring_size=4) == "kv"


def test_latent_ring_time_by_hand():
    """One member of a ring of 4 holding 1,000 tokens of a 4,000-token document: per layer b1 t + max(a1 s t
    + (4 x 3 + 1) t u, latent traffic) against b1 t + max(a1 s t, K/V traffic); the cheaper is chosen."""
    s, t, k, ring = 4000, 1000, 4, (0, 1, 2, 3)
    attention = DEEPSEEK.a1 * s * t
    up = 13 * t * DEEPSEEK.up_projection_time
    messages = (3 * k - 2) * DEEPSEEK.ring_latency
    traffic = {kind: (2 * (k - 1) * per + k * 2 * per) * t / LINK + messages
               for kind, per in (("kv", 10240), ("latent", 1152))}
    latent = DEEPSEEK.g + DEEPSEEK.b1 * t + max(attention + up, traffic["latent"])
    kv = DEEPSEEK.g + DEEPSEEK.b1 * t + max(attention, traffic["kv"])
    layers = DEEPSEEK.num_layers
    assert DEEPSEEK.microbatch_time([(s, t, ring, "latent")]) == pytest.approx(latent * layers)
    assert DEEPSEEK.microbatch_time([(s, t, ring, "kv")]) == pytest.approx(kv * layers)
    assert traffic["kv"] > attention + up  # a K/V ring short enough to be traffic-bound: auto takes the latent
    assert DEEPSEEK.microbatch_time([(s, t, ring)]) == pytest.approx(latent * layers)
    # a long document hides the K/V traffic under its attention: the up-projection then only costs
    long = 200_000
    assert DEEPSEEK.ring_kind_for(num_tokens=long // k, attention=DEEPSEEK.a1 * long * long / k, ring_size=k) == "kv"
    forced = {kind: dataclasses.replace(DEEPSEEK, ring_kind=kind) for kind in ("kv", "latent")}
    for kind, model in forced.items():
        assert model.microbatch_time([(s, t, ring)]) == pytest.approx({"kv": kv, "latent": latent}[kind] * layers)
    assert DEEPSEEK.ring_bytes(num_tokens=t, ring_size=k, kind="latent") == (6 * 1152 + 8 * 1152) * t * layers
    # the transient bytes of a ring's backward: 2 held + 3 partial buffers, and the latent ring's block
    assert DEEPSEEK.layer_ring_buffer_bytes(num_tokens=t, ring_size=k) == (2 + 6) * 10240 * t
    assert DEEPSEEK.layer_ring_buffer_bytes(num_tokens=t, ring_size=k, kind="latent") == (2 + 6 + 2 * 10240 / 1152) * 1152 * t


def test_plan_reports_the_peak_ring_buffer_with_the_latent_rings_up_projected_kv():
    """`megatron-hdp plan`'s `ring MB`: the largest transient ring memory of a member's ring call in one layer,
    counted by hand for DeepSeek-V3 at TP 8 (10,240 K/V bytes, 1,152 latent bytes per token): a latent ring
    call of 2 documents on ranks (0, 1) holds 2,000 + 300 tokens per member, 2 latent + 3 fp32 partial
    buffers (8 x 1,152 B) and the up-projected K/V with its gradient (2 x 10,240 B) per token: 68.3 MB; it
    outweighs a K/V ring of 500 tokens per member (8 x 10,240 B: 41.0 MB) only because of that K/V."""
    from megatron_hdp.commands.plan import peak_ring_buffer_bytes

    plan = plan_from_rings([4000, 600, 1000, 50], [(0, 1), (0, 1), (1, 0), (0,)], [0, 0, 1, 1], num_ranks=2,
                           capacity=4000)
    latent = tuple(dataclasses.replace(s, ring_kind="latent") if s.id < 2 else s for s in plan.sequences)
    plan = dataclasses.replace(plan, sequences=latent).validate()
    assert peak_ring_buffer_bytes(plan, DEEPSEEK) == (8 * 1152 + 2 * 10240) * 2300 == 68_300_800
    kv_only = dataclasses.replace(plan, sequences=tuple(dataclasses.replace(s, ring_kind="kv") for s in latent))
    assert peak_ring_buffer_bytes(kv_only, DEEPSEEK) == 8 * 10240 * 2300
    assert peak_ring_buffer_bytes(plan_from_rings([50], [(0,)], [0], num_ranks=2, capacity=4000), DEEPSEEK) == 0


def test_ring_kind_is_validated():
    with pytest.raises(ValueError, match="ring_kind must be one of"):
        dataclasses.replace(DEEPSEEK, ring_kind="mla")
    with pytest.raises(ValueError, match="needs latent_bytes_per_token > 0"):
        dataclasses.replace(analytic_cost_model("llama-7b"), ring_kind="latent")
    with pytest.raises(ValueError, match="multi-latent attention needs"):
        ModelShape(2, 64, 4, 4, 128, 100, kv_lora_rank=16)
    with pytest.raises(ValueError, match="ring_kind must be one of"):
        ClusterSpec("deepseek-v3", num_gpus=2048, tp_size=8, ep_size=32, ring_kind="mla")
    assert CostModel.from_dict(DEEPSEEK.to_dict()) == DEEPSEEK


def test_expert_parallelism_shards_the_routed_experts():
    """DeepSeek-V3 at TP 8 does not fit an H100 without EP; with EP 32 each GPU holds 1/8 of the shared
    weights and 1/256 of the routed experts."""
    shape = model_shape("deepseek-v3")
    spec = ClusterSpec("deepseek-v3", num_gpus=2048, tp_size=8, ep_size=32)
    experts = shape.expert_parameters()
    assert sum(spec.parameters_per_gpu()) == pytest.approx((shape.num_parameters() - experts) / 8 + experts / 256)
    assert spec.cost_model().expert_parallel_size == 32 and spec.memory_capacity() >= 8192
    with pytest.raises(ValueError, match="leaves no memory"):
        ClusterSpec("deepseek-v3", num_gpus=2048, tp_size=8).memory_capacity()


def test_plans_record_the_ring_kind_and_check_it():
    """The planner records each ring call's kind; the JSON carries it only for latent rings; a plan that
    gives one ring call two kinds, or a whole sequence a latent ring, is refused."""
    config = HDPConfig(hdp_capacity=4096)
    cost = dataclasses.replace(DEEPSEEK, ring_kind="latent")
    plan = make_plan([10000, 3000, 200], num_ranks=4, config=config, cost_model=cost, policy="balance")
    assert {s.ring_kind for s in plan.sequences if len(s.ring) > 1} == {"latent"}
    assert {s.ring_kind for s in plan.sequences if len(s.ring) == 1} == {"kv"}
    data = plan.to_dict()
    assert [s.get("ring_kind") for s in data["sequences"]] == [
        "latent" if len(s.ring) > 1 else None for s in plan.sequences]
    assert StepPlan.from_dict(data) == plan and StepPlan.from_dict(data).digest() == plan.digest()
    kv_plan = make_plan([10000, 3000, 200], num_ranks=4, config=config, cost_model=dataclasses.replace(cost, ring_kind="kv"),
                        policy="balance")
    assert all("ring_kind" not in s for s in kv_plan.to_dict()["sequences"])  # plans without latent rings as before
    two = plan_from_rings([800, 900], [(0, 1), (0, 1)], [0, 0], num_ranks=2, capacity=2000)
    mixed = dataclasses.replace(two, sequences=(two.sequences[0], dataclasses.replace(two.sequences[1], ring_kind="latent")))
    with pytest.raises(ValueError, match="share ring \\(0, 1\\) in micro-batch 0 but their ring kinds differ"):
        mixed.validate()
    whole = plan_from_rings([800], [(1,)], [0], num_ranks=2, capacity=2000)
    with pytest.raises(ValueError, match="is whole .* but its ring_kind is 'latent'"):
        dataclasses.replace(whole, sequences=(dataclasses.replace(whole.sequences[0], ring_kind="latent"),)).validate()
    with pytest.raises(ValueError, match="ring_kind 'mla' is not one of"):
        dataclasses.replace(two, sequences=tuple(dataclasses.replace(s, ring_kind="mla") for s in two.sequences)).validate()


def test_absorbed_form_crossover_of_docs_cost_model():
    """docs/cost_model.md: Megatron's absorbed MLA attends over the latent in MQA form (K 576, V 512 wide),
    3.4x the attention FLOPs per token pair; its extra attention per received token (t/2 causal queries
    each, training = 3x forward) exceeds the latent ring's 4 up-projections once a member holds > 910
    tokens, at any TP."""
    shape = model_shape("deepseek-v3")
    heads, rank, rope = shape.num_attention_heads, shape.kv_lora_rank, shape.qk_pos_emb_head_dim
    absorbed_pair = heads * (rank + rope + rank)
    assert absorbed_pair / shape.attention_pair_flops == pytest.approx(3.4, abs=0.01)
    extra_per_pair = 3 * (absorbed_pair - shape.attention_pair_flops)
    crossover = 4 * shape.up_projection_flops / (extra_per_pair / 2)
    assert 905 < crossover < 915
    # the K/V ring's traffic hides under attention once a member holds ~18K (k = 2) to ~24K tokens
    for k, tokens in ((2, 17_800), (64, 23_600)):
        traffic = (4 * k - 2) * DEEPSEEK.kv_bytes_per_token / LINK
        assert traffic / (DEEPSEEK.a1 * k * tokens) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("ring_kind", ["auto", "kv", "latent"])
def test_shard_time_is_the_overlap_of_the_kind_ring_kind_for_picks(ring_kind):
    """`layer_shard_time` times each kind once and keeps the least (auto); that must be the float of the
    kind `ring_kind_for` picks, timed again, as the ring sizing read it before (ties and fractional tokens
    included)."""
    base = dataclasses.replace(analytic_cost_model("deepseek-v3", "h100", tp_size=8), ring_kind=ring_kind)
    models = [base, dataclasses.replace(base, ranks_per_node=1)]
    if ring_kind != "latent":  # a latent ring needs a latent
        models.append(dataclasses.replace(base, latent_bytes_per_token=0.0))
    for model in models:
        for s in (4096, 65_536, 131_072, 1_200_000):
            for k in (1, 2, 3, 8, 31, 365, 2048):
                for t in (-(-s // k), s / k):
                    attention = model.a1 * s * t
                    bandwidth = model.size_bandwidth(k)
                    kind = model.ring_kind_for(num_tokens=t, attention=attention, ring_size=k, bandwidth=bandwidth)
                    expected = model.b1 * t + model.layer_ring_overlap_time(
                        num_tokens=t, attention=attention, ring_size=k, bandwidth=bandwidth, kind=kind)
                    assert model.layer_shard_time(seq_len=s, num_tokens=t, ring_size=k) == expected
