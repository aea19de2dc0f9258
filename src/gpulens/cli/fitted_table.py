"""A table of rows sized to the terminal from what its cells hold (``runs list``).

Fixed columns (a run id, a status, a rate) take the width their header and cells need. The
flexible ones (a workload, a device, a name) share what is left, by rank: the first is given
all it needs where the others can still have their minimum, so that a
typical label (``train_tracked.py``) is whole at 80 columns. Where even the minimums do not fit,
the columns named in the drop order go first, and then the flexible ones get narrower still.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

# A folding column narrower than this cuts its text instead.
MIN_FOLD_WIDTH = 8


@dataclass(frozen=True)
class Column:
    """``cell(row)`` under ``header``. A fixed column is as wide as its header and cells; a
    ``flexible`` one is sized from what is left, at least ``min_width`` where the terminal
    allows (its text cut or folded, as ``options["overflow"]`` says), served before the
    flexible columns of a higher ``rank``."""

    header: str
    cell: Callable[[dict[str, Any]], Text | str]
    min_width: int
    options: dict[str, Any] = field(default_factory=dict)
    flexible: bool = False
    rank: int = 1


def table_overhead(n_columns: int) -> int:
    """What the borders and padding of the table below take: an edge each side, one divider
    between columns, one space of padding inside each divider (``pad_edge=False``)."""
    return 3 * n_columns - 1 if n_columns else 0


def _natural(column: Column, cells: list[Text]) -> int:
    return max([Text(column.header).cell_len, *(c.cell_len for c in cells)])


def fit_widths(
    columns: Sequence[Column],
    cells: dict[str, list[Text]],
    width: int,
    drop_order: Sequence[str] = (),
) -> list[tuple[Column, int]]:
    """The columns kept and the width of each, for a terminal ``width`` columns wide."""
    kept = list(columns)
    natural = {c.header: _natural(c, cells[c.header]) for c in kept}

    def least(c: Column) -> int:
        return min(natural[c.header], c.min_width) if c.flexible else natural[c.header]

    for header in drop_order:
        if sum(least(c) for c in kept) + table_overhead(len(kept)) <= width:
            break
        kept = [c for c in kept if c.header != header]
    left = width - table_overhead(len(kept)) - sum(least(c) for c in kept if not c.flexible)
    flexible = sorted((c for c in kept if c.flexible), key=lambda c: c.rank)
    given: dict[str, int] = {}
    for i, column in enumerate(flexible):
        later = sum(least(c) for c in flexible[i + 1 :])
        # below its minimum (to 4) only on a terminal too narrow for the fixed columns
        need = min(natural[column.header], left - later)
        given[column.header] = max(min(natural[column.header], 4), need)
        left -= given[column.header]
    return [(c, given.get(c.header, natural[c.header])) for c in kept]


def fitted_table(
    title: str,
    rows: list[dict[str, Any]],
    columns: Sequence[Column],
    width: int,
    drop_order: Sequence[str] = (),
) -> Table:
    """``rows`` under the ``columns`` that fit ``width`` (see the module docstring)."""
    cells = {
        c.header: [Text(v) if isinstance(v, str) else v for v in (c.cell(r) for r in rows)]
        for c in columns
    }
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    fitted = fit_widths(columns, cells, width, drop_order)
    for column, size in fitted:
        options = dict(column.options)
        if options.get("overflow") == "fold" and size < MIN_FOLD_WIDTH:
            options["overflow"] = "ellipsis"  # a label in 3-letter slices reads as nothing
        folds = options.get("overflow") == "fold"
        table.add_column(column.header, no_wrap=not folds, width=size, **options)
    for i in range(len(rows)):
        table.add_row(*(cells[c.header][i] for c, _ in fitted))
    return table
