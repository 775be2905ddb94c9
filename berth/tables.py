"""Declared tables for the console: one line per record.

A table names its columns; each column says how to read a cell from a row and, optionally, where
the cell links. The template keeps every row on one line (headers never wrap, long text is clipped
with the whole of it on hover) and drops columns that are empty on every row. Views prefetch what
their columns read: a table never queries on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from django.utils import timezone

Accessor = str | Callable[[Any], Any]


def when(value) -> str | None:
    """A moment as a cell shows it (local time, to the minute); None stays absent."""
    return None if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M")


def read(accessor: Accessor, row: Any) -> Any:
    """``accessor`` applied to ``row``: called, or followed as a dotted path (None past a missing step)."""
    if callable(accessor):
        return accessor(row)
    value = row
    for part in accessor.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return None
    return value


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    value: Accessor
    link: Callable[[Any], str | None] | None = None
    numeric: bool = False  # right-aligned, tabular figures
    empty: str = "—"  # shown for an absent value (unknown is not zero)
    action: str = ""  # names what a link does (``data-action``), for a link that acts rather than shows
    # What the browser sorts the column by when its header is clicked (static/berth/sort.js): by
    # default the cell's own value (numbers as numbers); an accessor where the text is a formatted
    # figure ("1.2 GB", "3 minutes"); False for a column it makes no sense to sort.
    sort: Accessor | bool = True

    @property
    def sortable(self) -> bool:
        return self.sort is not False

    def read(self, row: Any) -> Any:
        return read(self.value, row)


@dataclasses.dataclass(frozen=True)
class Cell:
    text: str
    href: str | None
    numeric: bool
    absent: bool
    action: str = ""
    sort: str = ""  # the key the browser sorts by, where it is not the text itself


class Table:
    columns: tuple[Column, ...] = ()
    empty_message = "Nothing here yet."

    def __init__(self, rows: Iterable[Any], empty_message: str | None = None):
        self.rows = list(rows)
        if empty_message:
            self.empty_message = empty_message
        raw = [[column.read(row) for column in self.columns] for row in self.rows]
        # A column empty on every row says nothing: hide it (but keep all columns of an empty table).
        keep = [i for i in range(len(self.columns)) if not self.rows or any(r[i] not in (None, "") for r in raw)]
        self.visible_columns = [self.columns[i] for i in keep]
        self.lines = [
            [self._cell(self.columns[i], row, values[i]) for i in keep]
            for row, values in zip(self.rows, raw)
        ]

    @property
    def sortable(self) -> bool:
        """Whether sorting means anything: two rows or more."""
        return len(self.lines) > 1

    @staticmethod
    def _cell(column: Column, row: Any, value: Any) -> Cell:
        absent = value is None or value == ""
        text = column.empty if absent else str(value)
        href = column.link(row) if column.link and not absent else None
        return Cell(text=text, href=href, numeric=column.numeric, absent=absent, action=column.action,
                    sort=Table._sort_key(column, row, value))

    @staticmethod
    def _sort_key(column: Column, row: Any, value: Any) -> str:
        """The cell's sort key when the text would sort wrongly: a raw number, or the column's own
        accessor's value ("" where the text does: the browser sorts by the text)."""
        if not column.sortable:
            return ""
        if column.sort is True:
            key = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        else:
            key = read(column.sort, row)
        if key is None:
            return ""
        return str(key.timestamp()) if hasattr(key, "timestamp") else str(key)
