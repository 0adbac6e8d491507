"""`megatron-hdp plan | simulate | demo | calibrate`.

Each subcommand lives in `megatron_hdp/commands/<name>.py` with `add_arguments(parser)` and
`run(args) -> int`, imported only when chosen (so `plan` never pays for importing torch).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "plan": "Plan one global batch with each policy and compare them side by side.",
    "simulate": "Predict step time and throughput of each policy on a simulated cluster.",
    "demo": "Train a tiny Llama-style GPT with HDP on 4 gloo CPU ranks, next to static DP x CP.",
    "calibrate": "Measure the cost-model coefficients and bandwidths on this machine; write JSON.",
    "selftest": "Check a GPU machine: GPU tests, ring/offload benchmarks, calibrate, 2-step runs; Markdown report.",
}


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand, import its module, run it."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megatron-hdp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(f"megatron_hdp.commands.{name}").add_arguments(sub_parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return int(importlib.import_module(f"megatron_hdp.commands.{args.command}").run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
