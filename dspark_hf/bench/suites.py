"""The prompt suites of ``dspark bench``: ``code`` = HumanEval; ``chat`` = held-out ShareGPT (``sharegpt_prompts("test")``,
never train/validation/calibration) minus the math ones; ``math`` = the held-out ShareGPT conversations that
:func:`~dspark_hf.sources.categories.is_math_problem` accepts; ``custom`` = a JSONL file of ``{"prompt": ...}`` lines;
``long`` (not run by default) = held-out ShareGPT prompts of 1.5k-3.5k tokens (:func:`long_prompts`); ``low-accept``
(not run by default) = the held-out chat prompts where the drafter accepts least (:data:`LOW_ACCEPTANCE_IDS`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path

SUITES = ("code", "chat", "math")  # run by default
OTHER_SUITES = ("long", "low-accept", "custom")  # run when named (--suites)
# The held-out chat prompts on which the shipped drafter's greedy τ (fixed mode, γ = 7, 48 new tokens) was lowest, of
# the first 40 of the chat suite (`python scripts/low_acceptance.py --pool 40 --keep 12`, 2026-12-01; every τ in
# docs/floor/low_acceptance.json): where speculation pays least, so where the default must not lose (issue #28).
LOW_ACCEPTANCE_IDS = ("xDKT94w_0", "1s5eust_0", "A4fLEgi_0", "5wCpyaT_0", "vP4Pi9y_0", "R8aI4qg_0", "UaWCuxs_0",
                      "J7gsvGT_0", "OjaM9hX_30", "ynLoh9N_0", "dQ91i6O_0", "pNUCrJa_0")  # τ 1.07 .. 1.38
LONG_TOKENS = (1500, 3500)  # chat-formatted prompt length of the long suite, whatever --max-prompt-tokens says
LONG_CHARS = (6000, 14000)  # a cheap pre-filter on the text, before tokenizing


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


def long_prompts() -> list[tuple[str, list[dict]]]:
    """The ``long`` suite: ``(id, chat messages)`` of held-out ShareGPT conversations (test split, never trained on).

    Alternately a document (an opening user turn of 6k-14k characters: the users' own pasted texts with a question
    or request; id ``doc:<record>``) and a multi-turn conversation (at least 3 user turns, cut at its last one,
    6k-14k characters in all; id ``turns:<record>``), each answered at its last user turn; one per conversation.
    :func:`encode_suites` keeps those of 1.5k-3.5k tokens.
    """
    from ..sources.conversations import ROLES, chat_messages
    from ..sources.sharegpt import conversation_key, load_sharegpt, split_of

    documents, conversations, seen = [], [], set()
    for record in load_sharegpt():
        if split_of(record["id"]) != "test" or conversation_key(record["id"]) in seen:
            continue  # one prompt per conversation (a record is one piece of it)
        turns = record.get("conversations") or []
        if any(ROLES.get(t.get("from")) is None or not (t.get("value") or "").strip() for t in turns):
            continue  # every turn a user or assistant one, none empty
        last_user = max((i for i, t in enumerate(turns) if ROLES[t["from"]] == "user"), default=None)
        messages = chat_messages(record)  # its alternating prefix from a user turn
        if last_user is None or len(messages) <= last_user:
            continue  # not alternating from a user turn up to its last one
        messages = messages[: last_user + 1]
        if LONG_CHARS[0] <= len(messages[0]["content"]) <= LONG_CHARS[1]:
            documents.append((f"doc:{record['id']}", messages[:1]))
        elif (sum(m["role"] == "user" for m in messages) >= 3
              and LONG_CHARS[0] <= sum(len(m["content"]) for m in messages) <= LONG_CHARS[1]):
            conversations.append((f"turns:{record['id']}", messages))
        else:
            continue
        seen.add(conversation_key(record["id"]))
    pairs = zip_longest(documents, conversations)
    return [item for pair in pairs for item in pair if item is not None]


def suite_texts(names: Sequence[str], prompts_file: str | None = None) -> dict[str, list[tuple[str, str | list]]]:
    """``{suite: [(id, prompt), ...]}`` in each source's fixed order (no token filter, no limit yet); a prompt is a
    text (one user turn) or chat messages (the ``long`` suite).

    Raises:
        ValueError: an unknown suite, or ``custom`` without ``prompts_file``.
    """
    from ..sources.categories import is_math_problem
    from ..sources.humaneval import humaneval_prompts
    from ..sources.sharegpt import sharegpt_prompts

    unknown = set(names) - {*SUITES, *OTHER_SUITES}
    if unknown:
        raise ValueError(f"unknown suites {sorted(unknown)}; choose from {[*SUITES, *OTHER_SUITES]}")
    held_out = sharegpt_prompts("test") if {"chat", "math", "low-accept"} & set(names) else []
    by_id = dict(held_out)
    sources = {
        "code": lambda: humaneval_prompts(),
        "chat": lambda: [(i, p) for i, p in held_out if not is_math_problem(p)],
        "low-accept": lambda: [(i, by_id[i]) for i in LOW_ACCEPTANCE_IDS],
        "math": lambda: [(i, p) for i, p in held_out if is_math_problem(p)],
        "long": long_prompts,
        "custom": lambda: read_prompts_file(prompts_file),
    }
    if "custom" in names and prompts_file is None:
        raise ValueError("the custom suite needs --prompts FILE.jsonl")
    return {name: sources[name]() for name in names}


def encode_suites(tokenizer, texts: dict[str, list[tuple[str, str]]], limit: int, max_prompt_tokens: int):
    """The first ``limit`` prompts of each suite whose chat-formatted ids fit ``max_prompt_tokens`` (the ``long``
    suite: whose length lies in ``LONG_TOKENS``).

    Returns:
        ``({suite: [(id, ids), ...]}, {suite: n_skipped_too_long})``.
    """
    from ..runtime.targets import chat_ids

    suites, skipped = {}, {}
    for name, pairs in texts.items():
        kept, skipped[name] = [], 0
        low, high = LONG_TOKENS if name == "long" else (0, max_prompt_tokens)
        for record_id, prompt in pairs:
            if len(kept) == limit:
                break
            ids = chat_ids(tokenizer, prompt)
            if not low <= len(ids) <= high:
                skipped[name] += 1
                continue
            kept.append((record_id, ids))
        suites[name] = kept
    return suites, skipped
