"""HDP flags through Megatron-LM's real argument parsing (`parse_args` + `validate_args`) and our checks."""

import dataclasses
import json
import logging
from argparse import ArgumentParser

import pytest

from megatron_hdp.attention.backends import BACKENDS
from megatron_hdp.config import POLICIES, HDPConfig
from megatron_hdp.megatron.args import add_hdp_args, parse_and_check, token_multiple, validate_hdp_args

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128"
).split()
HDP = ["--hdp", "--calculate-per-token-loss"]


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
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], "1", "virtual"),
    (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], "8", "use Megatron DDP"),
    (["--enable-cuda-graph"], "1", "drop the CUDA-graph flag"),
    (["--external-cuda-graph"], "1", "--cuda-graph-impl transformer_engine"),
    (["--cuda-graph-impl", "local"], "1", "--cuda-graph-impl local"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], "1", "drop --tp-comm-overlap"),
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


@pytest.mark.parametrize("extra,multiple", [
    ([], 1),
    (["--fp8-format", "e4m3"], 16),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    (["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 32),
])
def test_fp8_runs_with_micro_batches_padded_to_16_tokens_per_tp_rank(extra, multiple):
    """FP8 is supported, not refused: every micro-batch is padded (masked) to 16 tokens per TP rank."""
    import numpy as np

    from megatron_hdp.data.collate import collate_microbatch
    from megatron_hdp.plan.hand_plan import plan_from_rings

    args, _ = parse_and_check(TINY + HDP + extra, world_size=4, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert token_multiple(args) == multiple
    plan = plan_from_rings([37, 5, 300], [(0,), (1,), (0, 1)], [0, 0, 0], num_ranks=2, capacity=256)
    for rank in range(2):
        (mb,) = plan.microbatches(rank)
        packed = collate_microbatch(plan, mb, lambda s, a, b: np.arange(a, b, dtype=np.int64),
                                    pad_to_multiple=token_multiple(args), rank=rank)
        assert packed.num_tokens % multiple == 0 and packed.num_loss_tokens == mb.num_tokens


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
    with caplog.at_level(logging.WARNING, logger="megatron_hdp.megatron.args"):
        assert validate_hdp_args(args) is None
    assert [r.getMessage() for r in caplog.records] == ["HDP is off (no --hdp): ignoring --hdp-capacity"]
