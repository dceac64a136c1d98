"""The category of a prompt (``"math"``, ``"code"`` or ``"chat"``), by two deliberately simple filters: the mix of the
training queue (:mod:`dspark_hf.sources.prompt_queue`) and the bench's ``math`` suite (:mod:`dspark_hf.bench.suites`)
use them, and ``benchmarks.json`` records the math filter's patterns.
"""

from __future__ import annotations

import re

# Math filter (documented, deliberately simple): a math keyword or an arithmetic expression in the first
# 400 characters, at most 1000 characters long, and no sign of code or of a writing/role-play task.
MATH_PATTERN = re.compile(
    r"\b(solve|equations?|integrals?|derivatives?|probability|algebra|calculus|geometry|theorem|arithmetic|"
    r"fractions?|factorial|prime numbers?|square roots?|irrational|circumference|math(s|ematics|ematical)?|"
    r"how many|how much)\b"
    r"|(?<![\w.])\d+(\.\d+)?\s*[+*×÷^=]\s*\(?\d"  # 2*(5/4), 3 + 4, x = 2 (not chess "Re1+ 14")
    r"|\d\s+[-/]\s+\d",  # 7 - 3, 8 / 2 (not ranges like 5-9 or dates like 2023/24)
    re.IGNORECASE,
)
NOT_MATH_PATTERN = re.compile(
    r"```|\b(import|def|function|class|code|program\w*|api|udf|python|java(script)?|sql|go)\b"
    r"|^\s*(write|act as|you are|pretend|please write|here is)\b",
    re.IGNORECASE,
)
MATH_MAX_CHARS = 1000


def is_math_problem(text: str) -> bool:
    """Whether a ShareGPT opening turn reads like a math question (see ``MATH_PATTERN``)."""
    return len(text) <= MATH_MAX_CHARS and bool(MATH_PATTERN.search(text[:400])) and not NOT_MATH_PATTERN.search(text)


# Code filter (as simple as the math one): a fence, or a programming keyword or language name.
CODE_PATTERN = re.compile(
    r"```|\b(def|class|import|function|const|return|python|javascript|typescript|java|c\+\+|c#|sql|html|css|react|"
    r"node(js)?|api|code|script|regex|bash|linux|git|json|program\w*|algorithm)\b",
    re.IGNORECASE,
)


def prompt_category(text: str) -> str:
    """``"math"``, ``"code"`` or ``"chat"`` for a ShareGPT opening turn (math first: see ``MATH_PATTERN``)."""
    if is_math_problem(text):
        return "math"
    return "code" if CODE_PATTERN.search(text) else "chat"
