"""The prompt suites of ``dspark bench``: ``code`` = HumanEval; ``chat`` = held-out ShareGPT (``sharegpt_prompts("test")``,
never train/validation/calibration) minus the math ones; ``math`` = the held-out ShareGPT conversations that
:func:`~dspark_hf.training.data.is_math_problem` accepts; ``custom`` = a JSONL file of ``{"prompt": ...}`` lines."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

SUITES = ("code", "chat", "math")


def read_prompts_file(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(id, prompt)`` pairs of a JSONL file with one ``{"prompt": ...}`` object per line (``id`` optional).

    Raises:
        ValueError: a non-empty line that is not a JSON object with a string ``prompt``.
    """
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected a JSON object with a string 'prompt', got {line[:80]!r}")
        pairs.append((str(record.get("id", number)), record["prompt"]))
    return pairs


def suite_texts(names: Sequence[str], prompts_file: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """``{suite: [(id, prompt), ...]}`` in each source's fixed order (no token filter, no limit yet).

    Raises:
        ValueError: an unknown suite, or ``custom`` without ``prompts_file``.
    """
    from ..training.data import humaneval_prompts, is_math_problem, sharegpt_prompts

    unknown = set(names) - {*SUITES, "custom"}
    if unknown:
        raise ValueError(f"unknown suites {sorted(unknown)}; choose from {[*SUITES, 'custom']}")
    held_out = sharegpt_prompts("test") if {"chat", "math"} & set(names) else []
    sources = {
        "code": lambda: humaneval_prompts(),
        "chat": lambda: [(i, p) for i, p in held_out if not is_math_problem(p)],
        "math": lambda: [(i, p) for i, p in held_out if is_math_problem(p)],
        "custom": lambda: read_prompts_file(prompts_file),
    }
    if "custom" in names and prompts_file is None:
        raise ValueError("the custom suite needs --prompts FILE.jsonl")
    return {name: sources[name]() for name in names}


def encode_suites(tokenizer, texts: dict[str, list[tuple[str, str]]], limit: int, max_prompt_tokens: int):
    """The first ``limit`` prompts of each suite whose chat-formatted ids fit ``max_prompt_tokens``.

    Returns:
        ``({suite: [(id, ids), ...]}, {suite: n_skipped_too_long})``.
    """
    from ..decoding.targets import chat_ids

    suites, skipped = {}, {}
    for name, pairs in texts.items():
        kept, skipped[name] = [], 0
        for record_id, prompt in pairs:
            if len(kept) == limit:
                break
            ids = chat_ids(tokenizer, prompt)
            if len(ids) > max_prompt_tokens:
                skipped[name] += 1
                continue
            kept.append((record_id, ids))
        suites[name] = kept
    return suites, skipped
