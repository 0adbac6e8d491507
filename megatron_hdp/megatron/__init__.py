"""megatron layer of megatron_hdp: the integration with Megatron-Core / Megatron-LM APIs, and only that
(flags, install(), initialize, layer spec, model building, forward step and schedule, datasets, CPU
shims, Megatron's own policies), and the only layer that imports Megatron; what drives it for evidence
(CPU training runs, exactness references, GPU smoke, dataset building) lives in `harness/` and reaches
Megatron through these modules' functions.

The Megatron-LM entry points are exported lazily, so importing this package does not import
megatron.training (which is slow and needs the version check in `training_compat`). The module behind
`install` is `training_install`, not `install`: a submodule named like the function would replace it as
this package's attribute once imported. Importing the package registers the Megatron layer's planner
policies (`policies`: `megatron-hybrid-cp`) with plan/'s registry.
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
