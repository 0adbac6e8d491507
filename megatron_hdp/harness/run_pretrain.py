"""Run a Megatron-LM pretrain script (e.g. Megatron-LM's `pretrain_gpt.py`) on a CPU-only PyTorch.

    python -m megatron_hdp.harness.run_pretrain /path/to/Megatron-LM/pretrain_gpt.py <Megatron flags>
    torchrun --nproc-per-node 4 -m megatron_hdp.harness.run_pretrain <script> <flags>

With or without `--hdp`: the plain-Megatron comparison run needs the same CPU patches as the HDP run,
and a patched `pretrain_gpt.py` applies them only through `install()` when `--hdp` is set. This entry
point, before the script runs: binds `typing.override` on Python 3.11 (`require_megatron_training`),
skips Megatron's `make` of the dataset helpers when `helpers_cpp` already imports (the wheel ships it),
applies the CPU shims when CUDA is absent (`cpu_shims`) and then, under torchrun, starts the default
process group with gloo (env:// rendezvous) unless one exists, puts the script's directory first on `sys.path`
(as `python script.py` would, so `model_provider`, `gpt_builders` etc. import), and runs it as
`__main__` (main-only: processes it spawns do not re-run it) with the remaining arguments as its
`sys.argv`. On a machine with CUDA it changes nothing but the path and argv.
"""

import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Optional


def run_script(script: str, argv: list[str]) -> None:
    """Run `script` as `__main__` with `argv`, after the Python 3.11 and CPU set-up (module docstring)."""
    path = Path(script).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"pretrain script {script} not found")
    from megatron_hdp.megatron.compat.versions import require_megatron_training, use_prebuilt_dataset_helpers

    require_megatron_training()
    use_prebuilt_dataset_helpers()
    from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims, apply_training_cpu_shims

    if apply_cpu_shims():
        apply_training_cpu_shims()
        import os

        import torch.distributed as dist

        if not dist.is_initialized() and "MASTER_ADDR" in os.environ:  # torchrun's env:// rendezvous
            dist.init_process_group("gloo")
    sys.path.insert(0, str(path.parent))
    sys.argv = [str(path), *argv]
    _run_as_main(path)


def _run_as_main(path: Path) -> None:
    """Run `path` as `__main__`, as `python path` would, marked as main-only code for multiprocessing.

    Megatron's torch_dist checkpoint writer starts a multiprocessing Manager (a spawned process), and a
    spawned child first re-runs its parent's main script, unless that module's `__spec__` is named
    `__main__` (multiprocessing/spawn.py, `_fixup_main_from_name`: main-only code is not re-run).
    `runpy.run_path` leaves `__spec__` None, so the child re-ran pretrain_gpt.py, whose imports of
    megatron.training lack this process's set-up (Python 3.11's `typing.override`): the Manager died and
    every torch_dist save failed with EOFError.
    """
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    module.__spec__ = importlib.machinery.ModuleSpec("__main__", None, origin=str(path))
    previous = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)  # noqa: S102 - the user's script
    finally:
        sys.modules["__main__"] = previous


def main(argv: Optional[list[str]] = None) -> int:
    """Command line: `run_pretrain SCRIPT [FLAGS...]`; exit code 2 with one line on stderr for a bad call."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: python -m megatron_hdp.harness.run_pretrain SCRIPT [Megatron flags ...]", file=sys.stderr)
        return 2 if not argv else 0
    if not Path(argv[0]).is_file():
        print(f"error: pretrain script {argv[0]} not found", file=sys.stderr)
        return 2
    run_script(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
