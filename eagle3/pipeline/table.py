"""A stage table that fits the terminal: the columns that matter most always, the rest as room allows.

Columns marked ``keep`` (stage, state, elapsed) are always shown whole. The others follow in
the order given while they fit: a fixed column needs its widest cell; a folded one (a note: a
reason, the serve URL) needs a readable minimum, takes the room left and folds its text onto
more lines. A column with nothing in it is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table
from rich.text import Text

MIN_NOTE = 16  # a note narrower than this is more noise than help
EDGE = 1  # a table's left border
PER_COLUMN = 3  # a column's padding either side and its right border


@dataclass(frozen=True)
class Column:
    name: str
    keep: bool = False  # never dropped
    fold: bool = False  # takes the room left, text folded onto more lines


def fit(title: str, columns: list[Column], rows: list[list[str]], width: int,
        styles: dict[str, str] | None = None, style_column: str = "state") -> Table:
    """A rich Table of ``rows`` (plain strings, one per column) with the columns that fit ``width``."""
    widths = {c.name: max([len(c.name)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)}
    chosen = [c for c in columns if c.keep]
    used = EDGE + sum(widths[c.name] + PER_COLUMN for c in chosen)
    for i, c in enumerate(columns):  # in order; a folded column claims only its minimum here and takes what is left
        need = (min(widths[c.name], MIN_NOTE) if c.fold else widths[c.name]) + PER_COLUMN
        empty = all(r[i] in ("", "-") for r in rows)
        if not c.keep and not empty and used + need <= width:
            chosen.append(c)
            used += need
    chosen.sort(key=columns.index)
    table = Table(title=title, title_justify="left", expand=False)
    for c in chosen:
        table.add_column(c.name, no_wrap=not c.fold, overflow="fold" if c.fold else "ellipsis",
                         min_width=widths[c.name] if not c.fold else None)
    index = [columns.index(c) for c in chosen]
    state_at = next(i for i, c in enumerate(columns) if c.name == style_column)
    for r in rows:
        cells = [Text(r[i]) for i in index]
        style = (styles or {}).get(r[state_at])
        if style and state_at in index:
            cells[index.index(state_at)].stylize(style)
        table.add_row(*cells)
    return table
