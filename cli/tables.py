"""Tables for the terminal that never break a number, a key or a date across lines: at the
terminal's width the least important columns are left out instead (``--json`` has them all).
Only the one text column a table may have (figures or settings, one to a line) wraps, and
only between its entries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    name: str
    rank: int = 0  # the highest-ranked columns stay longest; 0 is left out first
    text: bool = False  # entries separated by newlines: it may wrap between them


def short_time(value: Any) -> str:
    """``2026-12-01T06:35:50.123Z`` -> ``2026-12-01 06:35``: a date read at a glance."""
    text = "" if value is None else str(value)
    return text[:16].replace("T", " ") if len(text) >= 16 and text[10:11] == "T" else text


def fitted(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None = None):
    """A rich Table of ``rows`` at most ``width`` columns wide (the console's by default),
    with the fewest low-ranked columns left out; a note names those that were."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=width) if width else Console()

    def needs(index: int) -> int:
        """The narrowest this column can be without breaking an entry: its widest line."""
        lines = [columns[index].name]
        lines += [line for row in rows for line in Text.from_markup(row[index]).plain.split("\n")]
        return max(len(line) for line in lines)

    kept = list(range(len(columns)))
    # Each column has a space either side and a rule after it, and the table one rule before.
    while sum(needs(i) + 3 for i in kept) + 1 > console.width and len(kept) > 1:
        kept.remove(min(kept, key=lambda i: (columns[i].rank, -i)))  # the lowest rank, the rightmost first
    table = Table(title=title)
    for index in kept:
        column = columns[index]
        table.add_column(column.name, no_wrap=not column.text, min_width=needs(index) if column.text else None)
    for row in rows:
        table.add_row(*(row[index] for index in kept))
    left_out = [columns[i].name for i in range(len(columns)) if i not in kept]
    if left_out:
        table.caption = f"left out at this width: {', '.join(left_out)} (see --json)"
    return table
