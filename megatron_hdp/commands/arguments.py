"""Argument types shared by the subcommands: each checks one value and names it when it is wrong.

argparse turns an `ArgumentTypeError` into `megatron-hdp CMD: error: argument --flag: <message>` (one line,
exit code 2, see `megatron_hdp.cli`), so a bad value is refused with its flag before any work starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Sequence

_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text: str) -> int:
    """'32M' -> 33554432, '4096' -> 4096 (binary suffixes K, M, G); positive."""
    text = str(text).strip()
    scale = _SUFFIXES.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count such as 4096, 256K or 32M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _converted(text: str, convert: Callable[[str], Any], what: str) -> Any:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _converted(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, bytes/s, GiB)."""
    value = _converted(text, float, "a number")
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _converted(text, float, "a number")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def existing_file(text: str) -> str:
    """A path to a file that exists (read later; refused now rather than after minutes of work)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def existing_path(text: str) -> str:
    """A path to a file or a directory that exists."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r}")
    return text


def one_of(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """A name from `choices` (case-insensitive), refused with the list of known names."""
    known = {c.lower(): c for c in choices}

    def parse(text: str) -> str:
        if text.lower() not in known:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; known: {', '.join(choices)}")
        return known[text.lower()]

    parse.__name__ = what
    return parse


def names_from(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty list of names from `choices` (duplicates dropped, order kept)."""

    def parse(text: str) -> list[str]:
        names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
        if not names:
            raise argparse.ArgumentTypeError(f"names no {what}: {text!r}")
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(choices)}")
        return names

    parse.__name__ = what
    return parse


def count_list(text: str) -> list[int]:
    """A comma-separated, non-empty list of positive counts ('128,256,1K')."""
    values = [p.strip() for p in text.split(",") if p.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"names no value: {text!r}")
    return [parse_count(v) for v in values]


def policy_names() -> tuple[str, ...]:
    """Every planner policy the commands offer: plan/'s own and those the Megatron layer registers when
    it is imported (its package imports without Megatron-Core; a Megatron policy imports it on first use)."""
    import megatron_hdp.megatron  # noqa: F401  (registers the Megatron layer's policies)
    from megatron_hdp.plan.planner import POLICIES

    return tuple(POLICIES)


def add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    """--ep and --etp: the MoE all-to-all couples the HDP ranks of an expert-parallel group, which the
    planner plans together (`plan.search.expert_units`)."""
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="expert-parallel size (Megatron's --expert-model-parallel-size): the planner runs the "
                             "HDP ranks of an EP group through every micro-batch together")
    parser.add_argument("--etp", type=positive_int, default=None,
                        help="expert tensor-parallel size (--expert-tensor-parallel-size; default: --tp)")


def expert_unit(args: argparse.Namespace, *, num_ranks: int) -> int:
    """HDP ranks one MoE all-to-all couples for --tp, --ep, --etp (`plan.cost.experts.expert_unit_size`);
    ValueError naming the flags when they do not divide the HDP pool of `num_ranks` ranks."""
    from megatron_hdp.plan.cost.experts import expert_unit_size

    unit = expert_unit_size(tp_size=args.tp, ep_size=args.ep, etp_size=args.etp)
    if num_ranks % unit:
        raise ValueError(f"the HDP pool of {num_ranks} ranks is not divisible by the {unit} HDP ranks an expert-"
                         f"parallel group spans (--ep {args.ep}, --etp {args.etp or args.tp}, --tp {args.tp}): choose "
                         "--ep (and --etp) so that they divide it")
    return unit
