"""Megatron's attention options under HDP: deterministic_mode reaches every kernel call; sinks
(`softmax_type`) are Megatron's own `softmax_offset` and reach the kernels; the options HDP cannot give
their meaning (attention dropout, MTP, ...) stop the run in one line, on the Megatron-LM command line and
on the Core API alike (issue 21, item 6)."""

import inspect
import sys

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_flags import HDP, TINY
from flash_attn_stand_in import fake_flash_attn
from flash_attn_stand_in import install as install_flash_attn
from te_stand_in import install_fake_te

from megatron_hdp.attention import local_varlen_attention, simulated_ring_attention
from megatron_hdp.attention.backends import KernelShape, flash_attn_varlen, te_fused
from megatron_hdp.attention.backends.flex import FlexBackend
from megatron_hdp.attention.backends.torch_varlen import TorchVarlenBackend
from megatron_hdp.megatron.layers import packed_seq
from megatron_hdp.megatron.layers import spec as layer_spec
from megatron_hdp.megatron.pretrain.args import parse_and_check
from megatron_hdp.megatron.layers.options import REFUSALS, check_config
from kernel_stand_ins import cleared_caches

CPU = torch.device("cpu")


def _record(module, name: str) -> list[dict]:
    """Wrap `module.name` (a stand-in with a checked signature) so that its keyword calls are recorded."""
    original, calls = getattr(module, name), []

    def call(**kwargs):
        calls.append(kwargs)
        return original(**kwargs)

    call.__signature__ = inspect.signature(original)
    setattr(module, name, call)
    return calls


def _attend_both_ways(backend: str, deterministic: bool) -> None:
    """One local call and one simulated ring of 3 through `backend`, forward and backward."""
    seqlens = [3, 9, 14]
    q, k, v = (torch.randn(sum(seqlens), h, 8, requires_grad=True) for h in (4, 2, 2))
    local = local_varlen_attention(q, k, v, seqlens=seqlens, backend=backend, deterministic=deterministic)
    ring = simulated_ring_attention(q, k, v, seqlens=seqlens, ring_size=3, backend=backend, deterministic=deterministic)
    (local.sum() + ring.sum()).backward()


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_reaches_every_flash_attn_backward(monkeypatch, deterministic):
    with cleared_caches(flash_attn_varlen._flash_api, flash_attn_varlen.flash_attn_problem):
        install_flash_attn(monkeypatch, fake_flash_attn("2.7.4"), "2.7.4")
        monkeypatch.setattr(flash_attn_varlen.FlashAttnVarlenBackend, "supports", classmethod(lambda c, d, t: True))
        calls = _record(sys.modules["flash_attn.flash_attn_interface"], "_flash_attn_varlen_backward")
        _attend_both_ways("flash_attn", deterministic)
    assert len(calls) > 3 and {c["deterministic"] for c in calls} == {deterministic}


@pytest.mark.parametrize("version", ["2.10", "2.18"])
def test_deterministic_mode_reaches_every_te_backward_and_its_kernel_choice(monkeypatch, version):
    with cleared_caches(te_fused._te_api, te_fused.te_version_problem):
        monkeypatch.setattr(te_fused, "_STATS_LAYOUT", {})
        selected = install_fake_te(monkeypatch, version)
        calls = _record(sys.modules["transformer_engine.pytorch.cpp_extensions.fused_attn"], "fused_attn_bwd")
        _attend_both_ways("te_fused", True)
    assert len(calls) > 3 and all(c["deterministic"] is True for c in calls)
    # TE >= 2.12 picks its kernel by determinism too: the selector is asked for deterministic kernels
    assert (selected["select deterministic"] > 0) == (version == "2.18") and selected["select"] > 0


def test_pytorch_cuda_kernels_step_aside_under_deterministic_mode():
    """varlen_attn and flex take no deterministic flag: 'auto' skips them, a named one says why."""
    for deterministic in (False, True):
        shape = KernelShape(CPU, torch.bfloat16, 4, 2, 64, 1024, deterministic)
        for backend in (TorchVarlenBackend, FlexBackend):
            assert (backend.shape_problem(shape) is not None) == deterministic


def test_hdp_core_attention_passes_the_configs_deterministic_mode(monkeypatch):
    seen = []
    monkeypatch.setattr(layer_spec, "hdp_core_attention", lambda *a, **kw: seen.append(kw["deterministic"]))
    for mode in (True, False):
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, attention_dropout=0.0,
                                   deterministic_mode=mode)
        core = layer_spec.HDPCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
        params = packed_seq.HDPPackedSeqParams(qkv_format="thd", hdp=object())
        x = torch.zeros(3, 2, 4)
        core(x, x, x, packed_seq_params=params)
    assert seen == [True, False]


# (flag arguments, the line that must be in the error)
REFUSED_FLAGS = [
    ([], "--attention-dropout 0.1: attention dropout is Megatron's default"),
    (["--attention-dropout", "0.05"], "use --attention-dropout 0.0"),
    (["--window-size", "(128,4)"], "--window-size (128, 4): HDP honours causal sliding windows (left, 0)"),
    (["--multi-latent-attention", "--mla-down-proj-fusion"], "--mla-down-proj-fusion: the fused q/kv down projection"),
]


@pytest.mark.parametrize("argv,line", REFUSED_FLAGS)
def test_refused_options_stop_the_command_line_in_one_line(argv, line):
    base = [a for a in TINY if a not in ("--attention-dropout", "0.0")]  # Megatron's own default: 0.1
    with pytest.raises(ValueError) as raised:
        parse_and_check(base + HDP + (["--attention-dropout", "0.0"] if argv else []) + argv, world_size=2)
    assert line in str(raised.value)
    assert len(str(raised.value).splitlines()) == 2, str(raised.value)  # the heading and one line


def test_without_hdp_megatrons_defaults_pass():
    base = [a for a in TINY if a not in ("--attention-dropout", "0.0")]
    _, config = parse_and_check(base + ["--mtp-num-layers", "1", "--position-embedding-type", "rope"], world_size=2)
    assert config is None


BAD_AND_GOOD = {
    "attention_dropout": (0.1, 0.0), "mtp_hsm": (True, False),
    "window_size": ((128, 4), (128, 0)), "experimental_attention_variant": ("dsa", None),
}


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda r: r.field)
def test_core_api_config_refuses_the_same_options(refusal):
    """Each refused field, with an offending value, stops the HDP core attention's construction."""
    bad, good = BAD_AND_GOOD.get(refusal.field, (True, False))
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, attention_dropout=0.0)
    object.__setattr__(config, refusal.field, bad)  # past __post_init__'s checks of what else it needs
    with pytest.raises(ValueError, match=f"{refusal.field}="):
        layer_spec.HDPCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    object.__setattr__(config, refusal.field, good)
    check_config(config)


def test_core_api_default_config_is_refused_for_its_attention_dropout():
    """TransformerConfig's own default attention_dropout is 0.1 too."""
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="attention_dropout=0.1.*set attention_dropout=0.0"):
        check_config(config)


def test_mup_softmax_scale_reaches_the_kernels(monkeypatch):
    """With use_mup, Megatron sets config.softmax_scale (1/d_head instead of 1/sqrt(d_head)); the HDP core
    attention hands that scale to the kernels."""
    seen = []
    monkeypatch.setattr(layer_spec, "hdp_core_attention", lambda *a, **kw: seen.append(kw["softmax_scale"]))
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=0.0, use_mup=True)
    core = layer_spec.HDPCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    x = torch.zeros(3, 4, 16)
    core(x, x, x, packed_seq_params=packed_seq.HDPPackedSeqParams(qkv_format="thd", hdp=object()))
    assert seen == [pytest.approx(1 / 16)]


def test_sliding_window_reaches_the_kernels_on_the_layers_megatron_picks(monkeypatch):
    """`--window-size (left, 0)` runs under --hdp; each layer's HDP core attention passes `left` to the
    kernels on the layers Megatron's own `is_layer_window_attention` picks (`window_attn_skip_freq`),
    None on the others; (-1, 0) is no window."""
    from megatron.core.transformer.utils import is_layer_window_attention

    base = [a for a in TINY if a not in ("--attention-dropout", "0.0")] + ["--attention-dropout", "0.0"]
    args, _ = parse_and_check(base + HDP + ["--window-size", "(5,0)"], world_size=2)
    assert tuple(args.window_size) == (5, 0)
    seen = []
    monkeypatch.setattr(layer_spec, "hdp_core_attention", lambda *a, **kw: seen.append(kw["window"]))
    x = torch.zeros(3, 2, 4)
    params = packed_seq.HDPPackedSeqParams(qkv_format="thd", hdp=object())
    for window, skip in [((5, 0), None), ((5, 0), 2), ((5, 0), [1, 0, 0, 1]), ((-1, 0), None), (None, None)]:
        config = TransformerConfig(num_layers=4, hidden_size=8, num_attention_heads=2, attention_dropout=0.0,
                                   window_size=window, window_attn_skip_freq=skip)
        seen.clear()
        for layer in range(1, 5):
            layer_spec.HDPCoreAttention(config, layer_number=layer, attn_mask_type=AttnMaskType.causal)(
                x, x, x, packed_seq_params=params
            )
        megatron = [is_layer_window_attention(window, skip, n) and window[0] >= 0 for n in range(1, 5)]
        assert seen == [5 if picked else None for picked in megatron], (window, skip)


class _TensorParallel:
    """A stand-in TP group of `size` ranks for building one attention module (only its size is read)."""

    def __init__(self, size):
        self.tp = self
        self._size = size

    def size(self):
        return self._size


@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
@pytest.mark.parametrize("tp", [1, 2])
def test_sinks_are_megatrons_softmax_offset_and_reach_the_kernels(monkeypatch, kind, tp):
    """`--softmax-type off-by-one | learnable` runs under --hdp. The HDP core attention holds the sink as the
    core attention it replaces does: against Megatron's own `DotProductAttention` built from the same config
    and seed, the same `softmax_offset` (heads per TP rank, dtype, values drawn by `init_method`), a parameter
    only when learnable (so the same state-dict keys); the TE spec's leaf makes it as TE does (float32 zeros).
    Every call hands it to the kernels."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base = [a for a in TINY if a not in ("--attention-dropout", "0.0")] + ["--attention-dropout", "0.0"]
    args, _ = parse_and_check(base + HDP + ["--softmax-type", kind], world_size=2)
    assert args.softmax_type == kind
    monkeypatch.setattr(torch.cuda, "current_device", lambda: CPU)  # what the CPU shims do: Megatron's device
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, attention_dropout=0.0,
                               softmax_type=kind, params_dtype=torch.bfloat16)
    built = {}
    for name, cls in (("megatron", DotProductAttention), ("hdp", layer_spec.HDPCoreAttention),
                      ("hdp-te", layer_spec.HDPCoreAttentionForTE)):
        torch.manual_seed(3)
        built[name] = cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                          pg_collection=_TensorParallel(tp))
    megatron, hdp, te = built["megatron"], built["hdp"], built["hdp-te"]
    assert hdp.softmax_offset.shape == (4 // tp,) and hdp.softmax_offset.dtype == torch.bfloat16
    assert torch.equal(hdp.softmax_offset, megatron.softmax_offset)
    assert list(hdp.state_dict()) == list(megatron.state_dict()) == (["softmax_offset"] if kind == "learnable" else [])
    assert isinstance(hdp.softmax_offset, torch.nn.Parameter) == (kind == "learnable")
    assert te.softmax_offset.dtype == torch.float32 and not te.softmax_offset.any()
    if kind == "learnable":
        assert hdp.softmax_offset.std() > 0  # drawn by init_method, not left at zero
    seen = []
    monkeypatch.setattr(layer_spec, "hdp_core_attention", lambda *a, **kw: seen.append(kw["sink"]))
    x = torch.zeros(3, 4 // tp, 4)
    hdp(x, x, x, packed_seq_params=packed_seq.HDPPackedSeqParams(qkv_format="thd", hdp=object()))
    assert seen == [hdp.softmax_offset]
