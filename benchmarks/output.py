"""What every benchmark prints and writes: a table's rows as they come, then the table, then the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def print_new_rows(table: Callable[[list], str], new: list, *, header_lines: int = 2) -> None:
    """Print the rows `table` makes of the `new` records without its header, flushed: a long benchmark
    shows each result as it is measured."""
    print("\n".join(table(new).splitlines()[header_lines:]), flush=True)


def finish(table_text: str, result: dict, path: str | Path, *, indent: int = 1) -> None:
    """Print the whole table, then write `result` (with its command and date) as JSON to `path`."""
    print()
    print(table_text)
    write_result(path, result, indent=indent)


def write_result(path: str | Path, result: dict, *, indent: int = 1) -> None:
    """Write a benchmark's result JSON (creating results/ if needed) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    print(f"\nwrote {path}")
