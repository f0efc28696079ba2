"""Plain-text tables and paragraphs that fit a terminal: `dpkit plan` and `dpkit catalogue` print within
WIDTH columns, splitting a table that would not fit into several, each repeating its first columns.

    lines = table(["strategy", "step ms"], [["ddp", "20.35"]])
    lines = fitted_table(header, rows, keep=2)   # as many tables as WIDTH needs, stacked
    lines = wrap("  - " + reason, subsequent="    ")
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

WIDTH = 100  # columns of the terminal the output is written for


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1, gap: int = 2) -> list[str]:
    """Header and rows in columns as wide as their widest cell: the first `left` columns aligned left (names),
    the others right (figures), `gap` spaces between."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return (
            (" " * gap)
            .join(
                str(cell).ljust(width) if i < left else str(cell).rjust(width)
                for i, (cell, width) in enumerate(zip(cells, widths))
            )
            .rstrip()
        )

    return [line(header), *(line(row) for row in rows)]


def fitted_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    keep: int = 1,
    left: int = 1,
    gap: int = 2,
    width: int = WIDTH,
) -> list[str]:
    """`table`, split by columns into as many tables as it takes for each line to fit `width`, each repeating the
    first `keep` columns (a table whose kept columns alone are too wide is printed whole)."""
    lines = table(header, rows, left=left, gap=gap)
    if max(len(line) for line in lines) <= width or len(header) <= keep + 1:
        return lines
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    kept = sum(widths[:keep]) + gap * keep
    groups: list[list[int]] = [[]]
    used = kept
    for index in range(keep, len(header)):
        if groups[-1] and used + widths[index] > width:
            groups.append([])
            used = kept
        groups[-1].append(index)
        used += widths[index] + gap
    out: list[str] = []
    for number, group in enumerate(groups):
        columns = list(range(keep)) + group
        if number:
            out.append("")
        out += table([header[i] for i in columns], [[row[i] for i in columns] for row in rows], left=left, gap=gap)
    return out


def wrap(text: str, *, width: int = WIDTH, subsequent: str = "  ") -> list[str]:
    """One paragraph in lines of at most `width`, continued lines indented by `subsequent`; words are not split at
    their hyphens (strategy and link names keep theirs), only a word longer than a line is."""
    return textwrap.wrap(
        text, width=width, subsequent_indent=subsequent, break_on_hyphens=False, break_long_words=True
    ) or [""]


def table_wrapping_last(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1, gap: int = 2, width: int = WIDTH
) -> list[str]:
    """`table` whose last column (a list in words) wraps within `width`, continued on lines of its own."""
    head = table([*header[:-1], ""], [[*row[:-1], ""] for row in rows], left=left, gap=gap)
    indent = max(len(line) for line in head) + gap
    room = max(20, width - indent)
    lines = [head[0].ljust(indent) + header[-1]]
    for line, row in zip(head[1:], rows):
        parts = textwrap.wrap(str(row[-1]), width=room, break_on_hyphens=False) or [""]
        lines.append((line.ljust(indent) + parts[0]).rstrip())
        lines += [" " * indent + part for part in parts[1:]]
    return lines
