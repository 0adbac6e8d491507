"""An HDP model's checkpoint holds plain Megatron's keys, so checkpoints move both ways between plain and --hdp.

For Megatron's local spec (dense and MoE) and for its Transformer Engine spec, an HDP GPTModel and a plain
one built from the same config have the same `state_dict` keys and shapes (`--ckpt-format torch`) and the
same `sharded_state_dict` keys, global shapes and sharding (`torch_dist`); each loads the other's
state dict strictly. HDP changes one leaf of the TE spec, the core attention, so the TE spec is checked
through a stand-in for TE's DotProductAttention (TE cannot be installed here) that saves what the real one
saves: `_extra_state` as TE 2.x's `TransformerEngineBaseModule.get_extra_state` writes it (an empty uint8
tensor without FP8; pickled FP8 metadata with it: transformer_engine/pytorch/module/base.py), and, for
`torch_dist`, Megatron's own `TEDotProductAttention.sharded_state_dict`, compiled from the installed
Megatron's source (the class itself cannot be built without TE). The other TE-spec leaves (TE linears,
their own `_extra_state`) are the same modules in both models and stay the local ones here. A TE FP8
attention state, which HDP's attention would drop, is refused on load in one line.

The model-level half of the file-level checks in tests/megatron/test_checkpoints.py (the checkpoint
files of a plain and an HDP run hold the same keys).
"""

import __future__
import ast
import pickle
from pathlib import Path

import pytest
import torch

from megatron_hdp.comm.launch import run_gloo


def _te_dot_product_attention_sharded_state_dict():
    """Megatron's `TEDotProductAttention.sharded_state_dict`, compiled from the installed Megatron's source
    in its module's namespace."""
    from megatron.core.extensions import transformer_engine as te_module

    source = Path(te_module.__file__).read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TEDotProductAttention")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sharded_state_dict")
    namespace = dict(vars(te_module))
    code = compile(ast.Module(body=[method], type_ignores=[]), te_module.__file__, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - Megatron's own method, read from its installed file
    return namespace["sharded_state_dict"]


def _stand_in_te_attention():
    """A stand-in for Megatron's TEDotProductAttention, checkpoint-wise (module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class StandInTEDotProductAttention(DotProductAttention):
        sharded_state_dict = _te_dot_product_attention_sharded_state_dict()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._tp_group = ps.get_tensor_model_parallel_group()
            self.fp8_state = None  # what FP8 attention would have recorded

        def get_extra_state(self) -> torch.Tensor:  # TE 2.x TransformerEngineBaseModule.get_extra_state
            if self.fp8_state is None:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(bytearray(pickle.dumps(self.fp8_state)), dtype=torch.uint8)

        def set_extra_state(self, state) -> None:  # TE 2.x TransformerEngineBaseModule.set_extra_state
            if state is None or state.numel() == 0:
                return
            self.fp8_state = pickle.loads(state.detach().cpu().numpy().tobytes())

    return StandInTEDotProductAttention


def _keys(model):
    """(state_dict keys and shapes, sharded_state_dict keys with global shapes, offsets and replica ids)."""
    plain = {key: tuple(getattr(value, "shape", ())) for key, value in model.state_dict().items()}
    sharded = {}
    for key, value in model.sharded_state_dict().items():
        sharded[key] = (type(value).__name__, getattr(value, "key", None), tuple(getattr(value, "global_shape", ())),
                        tuple(getattr(value, "global_offset", ())), getattr(value, "replica_id", None))
    return plain, sharded


def _compare_checkpoint_keys(rank, world_size):
    from unittest import mock

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims
    from megatron_hdp.megatron.layers.spec import get_gpt_layer_with_hdp_spec
    from megatron_hdp.megatron.core_api.model import build_gpt

    apply_cpu_shims()
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    results = {}
    for name, experts in (("dense", None), ("moe", 4)):
        config = tiny_llama_config(num_moe_experts=experts)
        plain = build_gpt(config, vocab_size=256, max_sequence_length=64, hdp=False)
        hdp = build_gpt(config, vocab_size=256, max_sequence_length=64, hdp=True)
        results[name] = (_keys(plain), _keys(hdp))
        hdp.load_state_dict(plain.state_dict(), strict=True)
        plain.load_state_dict(hdp.state_dict(), strict=True)

    # the TE spec: Megatron's spec function stands in as the local spec with TE's core attention
    stand_in = _stand_in_te_attention()

    def te_spec(**kwargs):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
        spec.submodules.self_attention.submodules.core_attention = stand_in
        return spec

    config = tiny_llama_config()
    with mock.patch.object(gpt_layer_specs, "HAVE_TE", True), \
            mock.patch.object(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec):
        hdp_spec = get_gpt_layer_with_hdp_spec(backend="transformer_engine", normalization="RMSNorm")
    kwargs = dict(vocab_size=256, max_sequence_length=64)
    plain = build_gpt(config, hdp=False, transformer_layer_spec=te_spec(normalization="RMSNorm"), **kwargs)
    hdp = build_gpt(config, hdp=True, transformer_layer_spec=hdp_spec, **kwargs)
    results["te"] = (_keys(plain), _keys(hdp))
    hdp.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(hdp.state_dict(), strict=True)
    plain.decoder.layers[1].self_attention.core_attention.fp8_state = {"recipe": "delayed", "scale_fwd": [1.0]}
    try:
        hdp.load_state_dict(plain.state_dict(), strict=True)
        refused = None
    except ValueError as error:
        refused = str(error)
    ps.destroy_model_parallel()
    return results, refused


def test_hdp_checkpoint_keys_equal_plain_megatrons_for_the_local_and_te_specs():
    results, refused = run_gloo(_compare_checkpoint_keys, 1, timeout_s=240)[0]
    for name, ((plain_keys, plain_sharded), (hdp_keys, hdp_sharded)) in results.items():
        assert hdp_keys == plain_keys, name
        assert hdp_sharded == plain_sharded, name
        assert any("mlp.experts" in key for key in plain_keys) == (name == "moe")
    (te_keys, te_sharded), _ = results["te"]
    # the stand-in behaves as TE's attention: its extra state is in the torch-format keys, not in torch_dist's
    extra = [key for key in te_keys if key.endswith("core_attention._extra_state")]
    assert extra == ["decoder.layers.0.self_attention.core_attention._extra_state",
                     "decoder.layers.1.self_attention.core_attention._extra_state"]
    assert not [key for key in te_sharded if "core_attention" in key]
    assert refused is not None and "\n" not in refused
    assert refused.startswith("layer 2's core_attention._extra_state in the checkpoint holds Transformer Engine's FP8")

