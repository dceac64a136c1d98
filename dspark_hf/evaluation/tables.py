"""The one Markdown table helper, the one number format and the one way to count things of the bench report and the
model card."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def markdown_table(header: Sequence, rows: Sequence[Sequence], cell: Callable[[object], str] = str) -> str:
    """A GitHub-flavoured Markdown table: ``header`` as is, every row's values through ``cell``."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def format_number(value, digits: int | None = None) -> str:
    """One table cell or inline number of the bench report and the model card.

    Args:
        value: ``None`` (not measured), a float, or anything else (ints, bools, strings are shown as ``str``).
        digits: decimals of a float; ``None`` picks them by magnitude: 3 below 1, 2 below 100, 1 from 100 on.

    Returns:
        ``"–"`` for ``None``, the float rounded to ``digits`` decimals, else ``str(value)``.
    """
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if digits is None:
        digits = 3 if abs(value) < 1 else 2 if abs(value) < 100 else 1
    return f"{value:.{digits}f}"


def counted(n: int, noun: str) -> str:
    """A count with its noun in the number the count takes: ``counted(1, "prompt")`` is ``"1 prompt"``,
    ``counted(3, "prompt")`` and ``counted(0, "prompt")`` are ``"3 prompts"`` / ``"0 prompts"`` (regular plurals:
    the ``s`` goes on the last word, so a noun phrase works: ``counted(2, "plain run")`` is ``"2 plain runs"``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
