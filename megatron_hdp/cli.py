"""`megatron-hdp plan | simulate | demo | calibrate`.

Each subcommand lives in `megatron_hdp/commands/<name>.py` with `add_arguments(parser)` and
`run(args) -> int`, and is registered by one line in `COMMANDS`; its module is imported only when chosen
(so `plan` never pays for importing torch). What every subcommand gets from `main`:

- `--verbose`: without it, warnings and log lines below ERROR from third-party code (Megatron, TE, Apex,
  torch) are kept out of the output; our own INFO lines and warnings still show.
- one-line errors: a bad flag value (argparse) or an error raised by `run` prints
  `megatron-hdp CMD: error: ...` on stderr and exits with 2; the traceback only with `--verbose`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
import traceback
import warnings
from typing import Iterator

COMMANDS = {
    "plan": "Plan one global batch with each policy and compare them side by side, or draw saved plans.",
    "simulate": "Predict step time and throughput of each policy on a simulated cluster.",
    "demo": "Train a tiny Llama-style GPT with HDP on 4 gloo CPU ranks, next to static DP x CP.",
    "calibrate": "Measure the cost-model coefficients and bandwidths on this machine; write JSON.",
    "report": "Dashboard PNG and Markdown summary of a training run's measured telemetry and plans.",
}

USER_ERRORS = (ValueError, OSError, KeyError, ImportError, argparse.ArgumentTypeError)
"""What bad input raises (a wrong value, a missing file, an optional package not installed): exit code 2.
Anything else is a bug of ours: also one line (exit code 1), naming its type, so it can be reported."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (usage stays with --help) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _OursOrErrors(logging.Filter):
    """Log records of megatron_hdp at any level; everyone else's only from ERROR up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] == "megatron_hdp" or record.levelno >= logging.ERROR


@contextlib.contextmanager
def configured_output(*, verbose: bool) -> Iterator[None]:
    """Log to stderr; unless `verbose`, drop third-party warnings and third-party log lines below ERROR
    (undone on exit, so that `main` called in-process leaves its caller's settings as they were)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        yield
        return
    handlers, only_ours = list(logging.getLogger().handlers), _OursOrErrors()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        warnings.filterwarnings("default", module=r"megatron_hdp(\.|$)")  # (inserted first, so it wins)
        for handler in handlers:
            handler.addFilter(only_ours)
        try:
            yield
        finally:
            for handler in handlers:
                handler.removeFilter(only_ours)


def describe(error: BaseException) -> str:
    """`error` as one line: its message, newlines folded; an OSError's message and path."""
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror}: {error.filename!r}" if error.filename else error.strerror
    elif isinstance(error, KeyError) and error.args:
        text = f"missing key {error.args[0]!r}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    """The parser of every subcommand; only the chosen one's module is imported for its flags."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true",
                        help="show third-party warnings and log lines, and tracebacks of errors")
    parser = OneLineParser(prog="megatron-hdp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        if name == chosen:
            importlib.import_module(f"megatron_hdp.commands.{name}").add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand, import its module, run it; bad input ends in one line on stderr, exit code 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with configured_output(verbose="--verbose" in argv):  # before any command module (and its imports) loads
        return _parse_and_run(argv)


def _parse_and_run(argv: list[str]) -> int:
    chosen = next((a for a in argv if a in COMMANDS), None)
    try:
        args = build_parser(chosen).parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a refused flag value (2, its line already printed)
        return int(exit_.code or 0)
    try:
        return int(importlib.import_module(f"megatron_hdp.commands.{args.command}").run(args) or 0)
    except Exception as error:  # noqa: BLE001  (every error ends as one line; the traceback is --verbose's)
        if args.verbose:
            traceback.print_exc()
        prog = f"megatron-hdp {args.command}"
        if isinstance(error, USER_ERRORS):
            print(f"{prog}: error: {describe(error)}", file=sys.stderr)
            return 2
        print(f"{prog}: internal error ({type(error).__name__}): {describe(error)}"
              f"{'' if args.verbose else ' (run with --verbose for the traceback)'}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
