"""The one Markdown table helper of the bench report and the model card."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def markdown_table(header: Sequence, rows: Sequence[Sequence], cell: Callable[[object], str] = str) -> str:
    """A GitHub-flavoured Markdown table: ``header`` as is, every row's values through ``cell``."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
