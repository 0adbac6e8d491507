"""examples/: every launch script is valid bash, and each model's flags pass Megatron's parser + ours.

The flags are not copied into the test: each launcher runs in DRY_RUN mode, which prints the environment
and the exact argument list it would pass to the training script, and that list goes through
Megatron-LM's `parse_args`/`validate_args` (with `add_hdp_args`) and `validate_hdp_args` for the job's
world size.
"""

import subprocess
from pathlib import Path

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.megatron.pretrain.args import parse_and_check
from megatron_hdp.plan.cost.presets import model_shape

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODELS = sorted((EXAMPLES / "models").glob("*.sh"))
DEEPSEEK_V3 = dict(
    num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, multi_latent_attention=True,
    q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True,
    rope_type="yarn", rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0, num_experts=256, moe_router_topk=8,
    moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58,
    moe_router_num_groups=8, moe_router_group_topk=4, moe_router_score_function="sigmoid",
    moe_router_topk_scaling_factor=2.5, vocab_size=129280, layernorm_epsilon=1e-6, mtp_num_layers=1,
    mtp_loss_scaling_factor=0.1,
)
"""DeepSeek-V3's published shape (its config.json, as Megatron-LM's flags name it; the MTP loss weight from its report)."""
# model file -> (preset, or the model's flag values, tensor, pipeline, expert parallel size, longest
# document): what each claims.
CLAIMS = {
    "deepseek_v3_128k.sh": (DEEPSEEK_V3, 8, 8, 64, 128 * 1024),
    "llama3_8b_256k.sh": ("llama3-8b", 2, 1, 1, 256 * 1024),
    "llama_70b_512k.sh": ("llama-70b", 8, 4, 1, 512 * 1024),
    "mixtral_8x7b_1m.sh": ("mixtral-8x7b", 4, 1, 8, 1024 * 1024),
    "mixtral_8x22b_2m.sh": ("mixtral-8x22b", 8, 4, 8, 2048 * 1024),
    "gpt_oss_20b_128k.sh": ("gpt-oss-20b", 2, 1, 8, 128 * 1024),
}
# model file -> flags beyond the shape that make the model what its name says (gpt-oss: sinks, windows, GLU)
FEATURES = {
    "gpt_oss_20b_128k.sh": dict(softmax_type="learnable", window_size=(128, 0), window_attn_skip_freq=2,
                                quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0),
}


def dry_run(launcher: str, model: Path) -> tuple[dict[str, str], int, list[str]]:
    """(environment, world size, script arguments) that `launcher` would use for `model`."""
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "MODEL": str(model), "SLURM_SUBMIT_DIR": str(ROOT)}
    out = subprocess.run(
        ["bash", str(EXAMPLES / launcher), str(model)], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    environ, world, argv = {}, 0, []
    for line in out.splitlines():
        kind, _, value = line.partition(" ")
        if kind == "env":
            key, _, val = value.partition("=")
            environ[key] = val
        elif kind == "world_size":
            world = int(value)
        elif kind == "arg":
            argv.append(value)
    return environ, world, argv


def test_every_script_is_valid_bash():
    scripts = sorted(EXAMPLES.rglob("*.sh")) + sorted((ROOT / "patches").glob("*.sh"))
    assert len(scripts) >= 8
    for script in scripts:
        run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert run.returncode == 0, f"{script}: {run.stderr}"


def test_every_model_is_claimed():
    assert sorted(p.name for p in MODELS) == sorted(CLAIMS)


@pytest.mark.parametrize("model", MODELS, ids=[p.stem for p in MODELS])
def test_model_flags_parse_and_validate(model):
    environ, world, argv = dry_run("torchrun_hdp.sh", model)
    assert (environ, world, argv) == dry_run("sbatch_hdp.sh", model)  # both launchers run the same job
    args, config = parse_and_check(argv, world_size=world, env=environ)
    preset, tp, pp, ep, longest = CLAIMS[model.name]
    if isinstance(preset, dict):
        assert {field: getattr(args, field) for field in preset} == preset
    else:
        shape = model_shape(preset)
        assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (
            shape.num_layers, shape.hidden_size, shape.ffn_hidden_size,
        )
        assert (args.num_attention_heads, args.num_query_groups) == (shape.num_attention_heads, shape.num_query_groups)
        assert args.kv_channels == shape.channels_per_head
        assert (args.num_experts or 0, args.moe_router_topk) == (shape.num_experts, shape.moe_router_topk if shape.num_experts else args.moe_router_topk)
    assert {field: getattr(args, field) for field in FEATURES.get(model.name, {})} == FEATURES.get(model.name, {})
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    assert args.expert_model_parallel_size == ep and args.context_parallel_size == 1
    assert args.seq_length == longest
    assert isinstance(config, HDPConfig) and config.hdp
    # the comment's promise: the HDP pool (data-parallel ranks) can hold the longest document
    assert args.data_parallel_size * config.hdp_capacity >= longest
    assert config.hdp_capacity % tp == 0


def test_gpt_oss_preset_is_the_published_model():
    """openai/gpt-oss-20b's model card: 20.91B parameters in all; head dim 64 apart from hidden / heads
    (2880 / 64 = 45), so queries are 4096 wide and K/V 512."""
    shape = model_shape("gpt-oss-20b")
    assert (shape.q_channels, shape.kv_channels) == (4096, 512)
    assert shape.num_parameters() == pytest.approx(20.91e9, rel=1e-3)
