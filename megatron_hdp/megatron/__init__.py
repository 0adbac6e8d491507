"""megatron layer of megatron_hdp: the integration with Megatron-Core / Megatron-LM, and only that; the
only layer that imports Megatron. Sub-packages, bottom to top (tests/test_layers.py holds the order):
`compat/` (supported releases, CPU shims), `layers/` (the layer spec with HDP's core attention, MLA, MTP,
the MoE aux loss) and `datasets/` (Megatron's datasets as document sources), `core_api/` (initialize,
model building, forward step, `HDPTrainer`), `pretrain/` (Megatron-LM: flags, `install()` and the
functions it wraps); `comparison/` (Megatron's own schedulers as planner policies) beside them, never
importing the pretrain path. What drives the integration for evidence lives in `harness/`.

The Megatron-LM entry points (`install`, `add_hdp_args`, `validate_hdp_args`) are exported lazily, so
importing this package does not import megatron.training (slow, and checked by `compat.versions`).
Importing it registers Megatron's schedulers with plan/'s policy registry (`comparison.registry`).
"""

from megatron_hdp.megatron.comparison import registry as _registry  # noqa: F401  (registers the policies)

_LAZY = {
    "add_hdp_args": "megatron_hdp.megatron.pretrain.args",
    "validate_hdp_args": "megatron_hdp.megatron.pretrain.args",
    "install": "megatron_hdp.megatron.pretrain.install",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
