"""Import `megatron.training` from the installed megatron-core, refusing releases we have not checked.

Every module of ours that touches `megatron.training` calls `require_megatron_training()` first, so an
unsupported release fails once, early, with a message that says which release to install, instead of
deep inside a monkeypatch.
"""

import logging
import sys
import typing

logger = logging.getLogger(__name__)

SUPPORTED_MCORE = (0, 19)
"""The megatron-core release line whose `megatron.training` our flags, patch and install() were checked on."""


def mcore_version() -> str:
    """The installed megatron-core version string, e.g. '0.19.2'."""
    from megatron.core import package_info

    return package_info.__version__


def check_megatron_version() -> None:
    """Raise RuntimeError unless the installed megatron-core is a 0.19.x release."""
    from megatron.core import package_info

    found = (package_info.MAJOR, package_info.MINOR)
    if found != SUPPORTED_MCORE:
        wanted = ".".join(map(str, SUPPORTED_MCORE))
        raise RuntimeError(
            f"megatron_hdp's Megatron-LM integration supports megatron-core {wanted}.x, found "
            f"{mcore_version()}: install megatron-core=={wanted}.* (the patch in patches/ is for Megatron-LM "
            f"core_v{wanted}.0), or use megatron_hdp's Megatron-Core API without megatron.training."
        )


def require_megatron_training() -> None:
    """Make `megatron.training` importable here and check the megatron-core version.

    megatron.training 0.19 imports `typing.override` (Python 3.12). On Python 3.11 (the CPU set-up of
    this project installs megatron-core without its Python pin) we bind the documented backport,
    `typing_extensions.override`, which is the same identity decorator.
    """
    check_megatron_version()
    if not hasattr(typing, "override"):
        assert sys.version_info < (3, 12)
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
        logger.debug("bound typing.override to typing_extensions.override for megatron.training on Python 3.11")


def use_prebuilt_dataset_helpers() -> None:
    """Skip `megatron.training`'s `make` of the dataset C++ helpers when the wheel ships them compiled.

    `initialize_megatron` runs `make -C megatron/core/datasets` on rank 0; a Megatron-LM checkout has the
    Makefile, the megatron-core wheel has no Makefile but ships `helpers_cpp` already built, so the
    `make` fails and Megatron exits. Only when `helpers_cpp` imports is the compile step skipped.
    """
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None
