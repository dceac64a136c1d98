"""The queue of chat-formatted ShareGPT prompts that the training data regenerates answers to (and that STS
calibration draws its held-out prompts from): fixed order, held-out splits first, categories interleaved.
"""

from __future__ import annotations

import hashlib

from ..runtime.targets import as_messages, chat_ids
from .categories import prompt_category
from .sharegpt import sharegpt_prompts

PROMPT_MIX = {"chat": 0.5, "code": 0.4, "math": 0.1}  # share of each category at the head of the regeneration queue


def reply_ids(tokenizer, prompt: str, reply: str, prompt_ids: list[int], max_tokens: int) -> list[int] | None:
    """Token ids of ``reply`` as the assistant's turn after ``prompt_ids`` (= :func:`chat_ids` of ``prompt``), through
    the template's end-of-turn token (the tokenizer's EOS), cut to ``max_tokens``; ``None`` when the template does
    not continue ``prompt_ids`` or the reply is under two tokens.
    """
    messages = [*as_messages(prompt), {"role": "assistant", "content": reply}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    if ids[: len(prompt_ids)] != prompt_ids:
        return None
    reply = ids[len(prompt_ids) :]
    cut = reply.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in reply else len(reply)
    reply = reply[: min(cut, max_tokens)]
    return reply if len(reply) >= 2 else None


def sharegpt_queue(tokenizer, splits=("train", "validation"), max_prompt_tokens: int = 320,
                   mix: dict[str, float] | None = None, max_reply_tokens: int | None = None, turns: str = "first") -> list[tuple]:
    """``(record_id, split, prompt_ids)`` of the chat-formatted first turns of ``splits``, in a fixed order.

    ``max_reply_tokens``: ``(record_id, split, prompt_ids, reply_ids)`` instead, with the dataset's own first
    reply (:func:`reply_ids`, at most that many tokens), for records that have one. ``turns="all"``: the same
    queue, then the later turns with their history (:func:`sharegpt_prompts`, ordered likewise and categorised by
    their last user message), so that token files of the first-turn queue stay valid.

    Held-out splits come first (they are small), so that training has a validation set from its first shard.
    The rest is grouped by :func:`prompt_category` and interleaved in the proportions of ``mix`` (default
    :data:`PROMPT_MIX`) until a category runs out, so that a regeneration stopped early still holds a real
    share of code and math; within a category the order is a hash of the record id.
    """
    if turns not in ("first", "all"):
        raise ValueError(f'turns must be "first" or "all", got {turns!r}')
    mix = PROMPT_MIX if mix is None else mix
    queue = []
    for part in ("first", "later")[: 1 + (turns == "all")]:
        groups: dict[str, list[tuple]] = {name: [] for name in mix}
        for split in splits:
            for record_id, prompt, *reply in sharegpt_prompts(split, with_replies=max_reply_tokens is not None, turns=part):
                ids = chat_ids(tokenizer, prompt)
                category = prompt_category(as_messages(prompt)[-1]["content"])
                if len(ids) > max_prompt_tokens or category not in groups:
                    continue
                if not reply:
                    groups[category].append((record_id, split, ids))
                elif answer := reply_ids(tokenizer, prompt, reply[0], ids, max_reply_tokens):
                    groups[category].append((record_id, split, ids, answer))
        by_hash = lambda item: int(hashlib.sha1(item[0].encode()).hexdigest(), 16)  # noqa: E731
        keyed = [((i + 1) / mix[name], name, item) for name, items in groups.items()
                 for i, item in enumerate(sorted(items, key=by_hash))]
        mixed = [item for _, _, item in sorted(keyed, key=lambda k: (k[0], k[1]))]
        queue += [item for item in mixed if item[1] != "train"] + [item for item in mixed if item[1] == "train"]
    return queue
