"""HDP flags through Megatron-LM's real argument parsing (`parse_args` + `validate_args`) and our checks."""

import dataclasses
import json
import logging
from argparse import ArgumentParser

import pytest
from megatron_flags import HDP, TINY

from megatron_hdp.attention.backends import BACKENDS
from megatron_hdp.config import POLICIES, HDPConfig
from megatron_hdp.data.quantization import token_multiple
from megatron_hdp.megatron.pretrain.args import add_hdp_args, parse_and_check, validate_hdp_args



def test_every_field_is_a_flag_with_its_docstring_as_help():
    """Field name = flag name, docstring = help: no rename table anywhere."""
    parser = add_hdp_args(ArgumentParser())
    by_dest = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(HDPConfig):
        action = by_dest[field.name]
        assert "--" + field.name.replace("_", "-") in action.option_strings
        assert action.help, field.name
    assert set(by_dest["hdp_policy"].choices) == set(POLICIES)
    assert set(by_dest["hdp_attention_backend"].choices) == {"auto", *BACKENDS}  # the config names every kernel
    assert by_dest["hdp_offload"].option_strings == ["--hdp-offload", "--no-hdp-offload"]


def test_good_flags_parse_into_the_config(tmp_path):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({}))
    argv = TINY + HDP + [
        "--hdp-capacity", "512", "--hdp-policy", "naive", "--no-hdp-offload", "--hdp-max-offload-ratio", "0.5",
        "--hdp-cost-model", str(cost), "--hdp-global-batch-tokens", "4096", "--hdp-log-interval", "7",
        "--hdp-overlong-documents", "truncate", "--hdp-attention-backend", "flash_attn",
        "--hdp-save-plans", str(tmp_path / "plans"), "--hdp-mock-mix", "github",
    ]
    args, config = parse_and_check(argv, world_size=4)
    assert args.data_parallel_size == 4
    assert config == HDPConfig(
        hdp=True, hdp_capacity=512, hdp_policy="naive", hdp_offload=False, hdp_max_offload_ratio=0.5,
        hdp_cost_model=str(cost), hdp_global_batch_tokens=4096, hdp_log_interval=7,
        hdp_overlong_documents="truncate", hdp_attention_backend="flash_attn",
        hdp_save_plans=str(tmp_path / "plans"), hdp_mock_mix="github",
    )
    assert config.max_offload_ratio == 0.0


def test_defaults_and_off():
    _, config = parse_and_check(TINY + HDP, world_size=2)
    assert config == HDPConfig(hdp=True)
    assert config.max_offload_ratio == 1.0
    _, off = parse_and_check(TINY, world_size=2)
    assert off is None


def test_virtual_pipeline_stages_are_accepted():
    """--hdp with Megatron's interleaved schedule: the ring rule pads pipelines' counts (data.prepare)."""
    argv = TINY + HDP + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"]
    args, config = parse_and_check(argv, world_size=4)
    assert args.virtual_pipeline_model_parallel_size == 2 and config is not None


def test_tp_sp_capacity_multiple_is_accepted():
    argv = TINY + HDP + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--hdp-capacity", "1024"]
    args, config = parse_and_check(argv, world_size=8, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert (args.data_parallel_size, config.hdp_capacity) == (4, 1024)


BAD = [
    (["--context-parallel-size", "2"], "1", "--context-parallel-size 2"),
    (["--hybrid-context-parallel", "--dataloader-type", "single"], "1", "--hybrid-context-parallel"),
    (["--micro-batch-size", "2"], "1", "--micro-batch-size 1"),
    (["--rampup-batch-size", "2", "2", "8"], "1", "--rampup-batch-size"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"], "8", "FSDP"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--hdp-capacity", "1001"], "1", "multiple of"),
    (["--pipeline-model-parallel-size", "2", "--hdp-policy", "megatron-hybrid-cp"], "1", "use --hdp-policy balance"),
    (["--hdp-cost-model", "/nonexistent/cost.json"], "1", "megatron-hdp calibrate"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
      "--overlap-moe-expert-parallel-comm"], "1", "drop --overlap-moe-expert-parallel-comm"),
    (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], "8", "use Megatron DDP"),
    (["--enable-cuda-graph"], "1", "drop the CUDA-graph flag"),
    (["--external-cuda-graph"], "1", "--cuda-graph-impl transformer_engine"),
    (["--cuda-graph-impl", "local"], "1", "--cuda-graph-impl local"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], "1", "drop --tp-comm-overlap"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], "1",  # Megatron's default dispatcher: allgather
     "--moe-token-dispatcher-type allgather with --expert-model-parallel-size 2: "),
    (["--num-experts", "6", "--expert-model-parallel-size", "3", "--moe-token-dispatcher-type", "alltoall"], "1",
     "--expert-model-parallel-size 3 with --expert-tensor-parallel-size 1: an expert-parallel group spans 3 HDP"),
]


@pytest.mark.parametrize("extra,connections,needle", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_combinations_say_what_to_change(extra, connections, needle):
    """Megatron accepts each of these; HDP must reject it, naming the flag and the fix."""
    with pytest.raises(ValueError, match="--hdp cannot run") as err:
        parse_and_check(TINY + HDP + extra, world_size=4, env={"CUDA_DEVICE_MAX_CONNECTIONS": connections})
    assert needle in str(err.value)


def test_dynamic_context_parallel_is_refused():
    """Newer Megatron-LM's --dynamic-context-parallel (not a flag of 0.19/0.20 yet: set on the namespace)."""
    args, _ = parse_and_check(TINY + HDP, world_size=4)
    args.dynamic_context_parallel = True
    with pytest.raises(ValueError, match="drop --dynamic-context-parallel"):
        validate_hdp_args(args)


TE_ROWS = {"tensorwise": 16, "mxfp8": 32, "blockwise": 16, "nvfp4": 32}
"""Reference: token rows of one GEMM input each TE recipe accepts, written out from TE's shape checks
(v2.8: utils.assert_dim_for_fp8_exec and Megatron's get_fp8_align_size 16; tensor/mxfp8_tensor.py
MXFP8_BLOCK_SCALING_SIZE 32; nvfp4_tensor.py 16 rows and 2 tokens per byte of 16-byte TMA rows: 32)."""
TE_SP_SHARD_ROWS = {"tensorwise": 1, "mxfp8": 32, "blockwise": 128, "nvfp4": 16}
"""Reference: rows of a TP rank's shard the quantized sequence-parallel all-gather accepts
(`Quantizer.is_quantizable` of each tensor class: base True, MXFP8 32, Float8Block block_len 128, NVFP4 16)."""

FP8_RUNS = [
    ([], None),
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], "tensorwise"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "mxfp8"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], "blockwise"),
    (["--fp4-format", "e2m1"], "nvfp4"),
]
PARALLEL = [[], ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
            ["--tensor-model-parallel-size", "4", "--sequence-parallel"], ["--tensor-model-parallel-size", "2"]]


def _parse_quantized(argv: list[str], world_size: int = 8):
    """parse_and_check, with Megatron's 'TE >= 2.7 for --fp4-format' check answered as on a GPU with TE."""
    from unittest import mock

    from megatron.training import arguments

    with mock.patch.object(arguments, "is_te_min_version", lambda *a, **k: True):
        return parse_and_check(argv, world_size=world_size, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


@pytest.mark.parametrize("parallel", PARALLEL, ids=["tp1", "tp2-sp", "tp4-sp", "tp2"])
@pytest.mark.parametrize("quantized,recipe", FP8_RUNS, ids=[r or "bf16" for _, r in FP8_RUNS])
def test_every_microbatch_reaches_the_gemms_in_a_shape_its_recipe_quantizes(quantized, recipe, parallel):
    """Each Megatron FP8/FP4 recipe HDP accepts, with and without sequence parallelism: every micro-batch
    a rank runs (collated ones and the 1-token padding micro-batch of an idle rank alike) gives each TP
    rank's GEMM input a token count TE's checks for that recipe accept (reference tables above)."""
    import numpy as np

    from megatron_hdp.data.collate import collate_microbatch
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.data.prepare import pad_microbatches

    args, _ = _parse_quantized(TINY + HDP + quantized + parallel)
    sp_size = args.tensor_model_parallel_size if args.sequence_parallel else 1
    plan = plan_from_rings([37, 5, 300], [(0,), (0,), (0, 1)], [0, 1, 0], num_ranks=3, capacity=256)
    from megatron_hdp.comm.domain import HDPState

    for rank in range(3):  # rank 2 has nothing planned: it runs padding micro-batches only
        state = HDPState(hdp_rank=rank, hdp_global_ranks=(0, 1, 2), tp_size=1, pp_size=1, pp_rank=0, vpp_size=1,
                         ep_size=3, ep_hdp_ranks=(0, 1, 2))
        batches = [collate_microbatch(plan, mb, lambda s, a, b: np.arange(a, b, dtype=np.int64),
                                      pad_to_multiple=token_multiple(args), rank=rank)
                   for mb in plan.microbatches(rank)]
        batches = pad_microbatches(plan, batches, state=state, pad_to_multiple=token_multiple(args))
        assert len(batches) == 2
        for mb in batches:
            assert mb.num_tokens % sp_size == 0, "sequence parallelism splits the tokens evenly"
            shard = mb.num_tokens // sp_size
            if recipe is not None:
                gemm_rows = shard * sp_size  # after the all-gather (or the whole micro-batch without SP)
                assert gemm_rows % TE_ROWS[recipe] == 0 and shard % TE_ROWS[recipe] == 0, (recipe, mb.num_tokens)
                if sp_size > 1:
                    assert shard % TE_SP_SHARD_ROWS[recipe] == 0, (recipe, shard)
        assert sum(mb.num_loss_tokens for mb in batches) == sum(mb.num_tokens for mb in plan.microbatches(rank))


@pytest.mark.parametrize("quantized,needle", [
    (["--fp8-format", "hybrid"], "--fp8-recipe delayed (the default of --fp8-format)"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "delayed"], "use --fp8-recipe tensorwise, mxfp8, blockwise"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "custom", "--fp8-quantizer-factory", "my.factory"],
     "--fp8-recipe custom"),
    (["--fp4-format", "e2m1", "--fp4-recipe", "custom", "--fp4-quantizer-factory", "my.factory"],
     "use --fp4-recipe nvfp4"),
])
def test_fp8_delayed_and_custom_recipes_are_refused_in_one_line(quantized, needle):
    """Delayed scaling all-reduces amaxes over TP x DP per micro-batch (HDP ranks run different counts);
    a custom recipe's shape rules are unknown. Both stop the launch naming the flag and the fix."""
    with pytest.raises(ValueError, match="--hdp cannot run") as err:
        _parse_quantized(TINY + HDP + quantized)
    (line,) = [line for line in str(err.value).splitlines() if "recipe" in line]
    assert needle in line


def test_missing_per_token_loss_and_cp_are_reported_together():
    with pytest.raises(ValueError) as err:
        argv = TINY + ["--hdp", "--context-parallel-size", "2"]
        parse_and_check(argv, world_size=4, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "add --calculate-per-token-loss" in str(err.value)
    assert "use --context-parallel-size 1" in str(err.value)


def test_config_value_errors_surface_as_value_error():
    with pytest.raises(ValueError, match="hdp_capacity"):
        parse_and_check(TINY + HDP + ["--hdp-capacity", "0"], world_size=2)
    with pytest.raises(SystemExit):  # argparse rejects a policy outside the choices itself
        parse_and_check(TINY + HDP + ["--hdp-policy", "greedy"], world_size=2)


def test_hdp_flags_without_hdp_warn_once(caplog):
    args, _ = parse_and_check(TINY + ["--hdp-capacity", "512"], world_size=2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_hdp.megatron.pretrain.args"):
        assert validate_hdp_args(args) is None
    assert [r.getMessage() for r in caplog.records] == ["HDP is off (no --hdp): ignoring --hdp-capacity"]


def test_dynamic_cp_policy_without_a_checkout_is_refused(monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    with pytest.raises(ValueError, match="--hdp-policy megatron-dynamic-cp: .*set MEGATRON_LM_DIR"):
        parse_and_check(TINY + HDP + ["--hdp-policy", "megatron-dynamic-cp"], world_size=4,
                        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


@pytest.mark.parametrize("parallel,unit", [
    (["--expert-model-parallel-size", "4"], 4),
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 2),
    (["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "4"], 2),
    (["--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"], 1),
])
def test_the_planner_couples_the_hdp_ranks_of_an_expert_parallel_group(parallel, unit):
    """install()'s cost model carries the HDP ranks one MoE all-to-all couples: EP with expert TP = TP,
    lcm(TP, ETP x EP) / TP otherwise (Megatron's expert grid over the dense one), so the planner plans
    them together; here checked against a layout counted by hand: global rank t + TP d is HDP rank d, and
    an expert group is ETP x EP consecutive global ranks."""
    from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model

    argv = TINY + HDP + ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall"] + parallel
    args, config = parse_and_check(argv, world_size=8, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    tp, etp, ep = args.tensor_model_parallel_size, args.expert_tensor_parallel_size, args.expert_model_parallel_size
    coupled = {0}  # global ranks running global rank 0's micro-batches with it: TP groups and expert groups
    while True:
        grown = {h for g in coupled for h in range(g - g % tp, g - g % tp + tp)}
        grown |= {h for g in grown for h in range(g - g % (etp * ep), g - g % (etp * ep) + etp * ep)}
        if grown == coupled:
            break
        coupled = grown
    assert len({g // tp for g in coupled}) == unit
    assert _cost_model(args, config).expert_parallel_size == unit


MLA_FLAGS = ("--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8 "
             "--v-head-dim 8").split()


def test_the_latent_ring_runs_under_a_sink_and_core_attention_recompute():
    """A sink and core-attention recompute take latent rings (the sink after the merge, the latent through
    the checkpointed call's arguments): `--hdp-ring-kind latent` keeps its meaning, auto (the default)
    stays the cost model's choice."""
    from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model

    for setting in (["--softmax-type", "learnable"], ["--recompute-granularity", "selective"]):
        args, config = parse_and_check(TINY + HDP + MLA_FLAGS + setting + ["--hdp-ring-kind", "latent"], world_size=4)
        assert _cost_model(args, config).ring_kind == "latent"
        args, config = parse_and_check(TINY + HDP + MLA_FLAGS + setting, world_size=4)
        assert _cost_model(args, config).ring_kind == "auto"


@pytest.mark.parametrize("extra,needle", [
    (["--hdp-policy", "megatron-hybrid-cp"] + MLA_FLAGS,
     "--hdp-ring-kind latent with --hdp-policy megatron-hybrid-cp: that policy plans K/V rings only"),
    ([], "--hdp-ring-kind latent without --multi-latent-attention"),
])
def test_a_latent_ring_kind_no_latent_ring_can_honour_is_refused(extra, needle):
    """`--hdp-ring-kind latent` with a policy that plans K/V rings only, or without multi-latent attention:
    refused at flag validation, in one line naming both flags, before anything starts."""
    with pytest.raises(ValueError) as error:
        parse_and_check(TINY + HDP + extra + ["--hdp-ring-kind", "latent"], world_size=4)
    lines = [line for line in str(error.value).splitlines() if "--hdp-ring-kind" in line]
    assert len(lines) == 1 and needle in lines[0], str(error.value)


@pytest.mark.parametrize("extra,kind,why", [
    (["--hdp-ring-kind", "auto"], "auto", "no --multi-latent-attention"),
    (["--hdp-ring-kind", "auto", "--hdp-policy", "megatron-hybrid-cp"] + MLA_FLAGS, "auto",
     "--hdp-policy megatron-hybrid-cp plans K/V rings only"),
    (["--hdp-policy", "megatron-hybrid-cp"] + MLA_FLAGS, "auto", "--hdp-policy megatron-hybrid-cp plans K/V"),
    (MLA_FLAGS, "auto", None),
    ([], None, None),
])
def test_auto_falling_back_to_kv_rings_says_why_once(caplog, extra, kind, why):
    """`auto` (given, or left out with MLA) that can plan K/V rings only logs why, once, at flag validation,
    and the cost model is then set to kv; where latent rings can run, or no ring kind is in question, no
    line."""
    from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_hdp.megatron.pretrain.args"):
        args, config = parse_and_check(TINY + HDP + extra, world_size=4)
    lines = [r.getMessage() for r in caplog.records if "ring" in r.getMessage()]
    if why is None:
        assert lines == []
        assert _cost_model(args, config).ring_kind == (kind or "auto")
    else:
        assert len(lines) == 1 and lines[0].startswith("--hdp-ring-kind auto: split documents run K/V rings: ")
        assert why in lines[0]
        assert _cost_model(args, config).ring_kind == "kv"
