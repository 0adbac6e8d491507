"""The megatron-core version gate: 0.19 and 0.20 run HDP; an unknown release warns and trains plain Megatron
without --hdp, and is refused with its exact version only when --hdp is set (before anything is wrapped).

The installed megatron-core (0.19.x) is made to report another release by patching its `package_info`;
the flags go through Megatron's real parser and validate_args (`parse_and_check`).
"""

import logging
from unittest import mock

import pytest

from megatron_hdp.megatron.compat.versions import check_megatron_version, require_megatron_training

require_megatron_training()

from megatron.core import package_info  # noqa: E402
from megatron.training import training  # noqa: E402

from megatron_hdp.megatron.compat import versions as training_compat  # noqa: E402
from megatron_hdp.megatron.pretrain.args import parse_and_check  # noqa: E402
from megatron_hdp.megatron.pretrain.install import install  # noqa: E402

FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer "
    "--vocab-size 256 --mock-data --transformer-impl local --calculate-per-token-loss --attention-dropout 0.0"
).split()


def _release(major: int, minor: int, patch: int):
    """Make the installed megatron-core report `major.minor.patch`."""
    version = f"{major}.{minor}.{patch}"
    return mock.patch.multiple(package_info, MAJOR=major, MINOR=minor, PATCH=patch, __version__=version)


@pytest.mark.parametrize("release", [(0, 19, 2), (0, 20, 0)])
def test_supported_releases_pass_with_and_without_hdp(release):
    with _release(*release):
        assert check_megatron_version(hdp=True) and check_megatron_version(hdp=False)


def test_unknown_release_warns_once_without_hdp_and_runs_plain(caplog):
    training_compat._warned.clear()
    before = training.setup_model_and_optimizer
    with _release(0, 21, 3), caplog.at_level(logging.WARNING, logger=training_compat.__name__):
        args, config = parse_and_check(FLAGS, world_size=4)  # add_hdp_args + validate_args: no refusal
        assert config is None and install(args) is None
        require_megatron_training()
    warnings = [r.getMessage() for r in caplog.records if "0.21.3" in r.getMessage()]
    assert len(warnings) == 1 and "--hdp is unavailable" in warnings[0]
    assert training.setup_model_and_optimizer is before  # nothing wrapped


def test_unknown_release_is_refused_with_its_version_under_hdp():
    wrapped_before = {name: getattr(training, name) for name in ("setup_model_and_optimizer", "training_log")}
    with _release(0, 21, 3):
        args, config = parse_and_check(FLAGS + ["--hdp", "--hdp-capacity", "32"], world_size=4)
        assert config is not None
        with pytest.raises(RuntimeError, match=r"supports megatron-core 0\.19\.x and 0\.20\.x, found 0\.21\.3"):
            install(args)
    assert {name: getattr(training, name) for name in wrapped_before} == wrapped_before  # nothing wrapped
