"""Tables and progress bars on the terminal (rich), the same for every command."""
from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped output keeps whole rows on a line instead of wrapping at 80 columns.
    return Console(file=stream, width=None if stream.isatty() else 200, highlight=False)


def print_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    from rich import box
    from rich.table import Table

    table = Table(*columns, box=box.SIMPLE_HEAD, pad_edge=False)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console().print(table)
