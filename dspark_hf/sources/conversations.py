"""ShareGPT records as chat turns: the opening user message and its reply, and (issue #22) every later user message
with the conversation before it, as the prompt of one more training row.

A later turn's prompt is the chat-templated history ``user, assistant, ..., user``: more prompts from the same
records, and the long contexts that one opening message never gives. Its id is ``"<record id>@t<k>"`` (``k``: the
index of the user message, from 1), which :func:`~dspark_hf.sources.sharegpt.conversation_key` maps back to the
conversation, so a turn always falls in its conversation's split.
"""

from __future__ import annotations

ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's speakers; any other (system, bing...) ends a conversation
TURN_SEPARATOR = "@t"


def chat_messages(record: dict) -> list[dict]:
    """The record's turns as chat messages (``{"role", "content"}``), from its opening user message up to the first
    turn that breaks the user/assistant alternation or is empty; ``[]`` when it does not open with a user message."""
    messages = []
    for turn in record.get("conversations") or []:
        role, content = ROLES.get(turn.get("from")), (turn.get("value") or "").strip()
        if role is None or not content or role != ("user", "assistant")[len(messages) % 2]:
            break
        messages.append({"role": role, "content": content})
    return messages


def first_human_turn(record: dict) -> str | None:
    """The opening user message of a conversation, or ``None`` when it has none."""
    messages = chat_messages(record)
    return messages[0]["content"] if messages else None


def first_reply(record: dict) -> str | None:
    """The assistant's answer to the opening user message, or ``None`` when it has none."""
    messages = chat_messages(record)
    return messages[1]["content"] if len(messages) > 1 else None


def later_turns(record: dict) -> list[tuple[str, list[dict], str | None]]:
    """``(turn id, messages, reply)`` for each user message after the first: ``messages`` is the history through it
    (ending with that user message), ``reply`` the assistant's answer in the record, or ``None`` at the end."""
    messages = chat_messages(record)
    return [(f"{record['id']}{TURN_SEPARATOR}{k // 2}", messages[: k + 1],
             messages[k + 1]["content"] if k + 1 < len(messages) else None)
            for k in range(2, len(messages), 2)]
