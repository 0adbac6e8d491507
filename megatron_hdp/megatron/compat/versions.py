"""Import `megatron.training` from the installed megatron-core, and say which releases HDP runs on.

Every module of ours that touches `megatron.training` calls `require_megatron_training()` first. It never
stops a run: a patched `pretrain_gpt.py` without `--hdp` must train on any release, so on a release we
have not checked it only warns (once) and Megatron runs as it would unpatched. `install()` with `--hdp`
calls `check_megatron_version(hdp=True)`, which refuses such a release with its exact version before
anything is wrapped, instead of failing deep inside a monkeypatch.
"""

import logging
import sys
import typing

logger = logging.getLogger(__name__)

SUPPORTED_MCORE = ((0, 19), (0, 20))
"""The megatron-core release lines whose `megatron.training` our flags, patch and install() were checked
on: 0.19 (Megatron-LM tag core_v0.19.0, the megatron-core 0.19.x wheels) and 0.20 (Megatron-LM main)."""

_warned: list[str] = []


def mcore_version() -> str:
    """The installed megatron-core version string, e.g. '0.19.2'."""
    from megatron.core import package_info

    return package_info.__version__


def mcore_release() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core, e.g. (0, 20)."""
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def _supported_lines() -> str:
    return " and ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_MCORE)


def check_megatron_version(*, hdp: bool) -> bool:
    """True when the installed megatron-core is a supported release line.

    Otherwise: with `hdp` (the run asked for --hdp) a RuntimeError naming the exact version found; without
    it one warning that --hdp is unavailable on it, and False (plain Megatron runs unchanged).
    """
    if mcore_release() in SUPPORTED_MCORE:
        return True
    found = mcore_version()
    if hdp:
        raise RuntimeError(
            f"--hdp: megatron_hdp's Megatron-LM integration supports megatron-core {_supported_lines()}, found "
            f"{found}; install one of those (Megatron-LM core_v0.19.0 or main at megatron-core 0.20), or run "
            "without --hdp (plain Megatron is not changed)"
        )
    if found not in _warned:
        _warned.append(found)
        logger.warning(
            "megatron-core %s is not a release megatron_hdp was checked on (%s): --hdp is unavailable, "
            "training runs as plain Megatron", found, _supported_lines()
        )
    return False


def require_megatron_training() -> None:
    """Make `megatron.training` importable here; warn (never raise) on an unchecked megatron-core release.

    megatron.training imports `typing.override` (Python 3.12). On Python 3.11 (the CPU set-up of this
    project installs megatron-core without its Python pin) we bind the documented backport,
    `typing_extensions.override`, which is the same identity decorator.
    """
    check_megatron_version(hdp=False)
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
