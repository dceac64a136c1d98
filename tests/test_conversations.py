"""ShareGPT later turns (issue #22): each later user message with its history is one more prompt, in its
conversation's split, appended after the first-turn queue."""

import pytest

from dspark_hf.runtime.targets import chat_ids, load_default_target
from dspark_hf.sources import sharegpt
from dspark_hf.sources.conversations import chat_messages, first_human_turn, first_reply, later_turns
from dspark_hf.sources.prompt_queue import reply_ids, sharegpt_queue
from dspark_hf.sources.sharegpt import split_of
from dspark_hf.training.config import TrainConfig


def _record(record_id, *texts, speakers=None):
    speakers = speakers or ["human", "gpt"] * len(texts)
    return {"id": record_id, "conversations": [{"from": s, "value": t} for s, t in zip(speakers, texts)]}


def test_later_turns_carry_their_history():
    record = _record("abc_3", "What is 2+2?", "4.", " And 3+3? ", "6.", "Thanks")
    user, assistant = ({"role": r, "content": c} for r, c in (("user", "What is 2+2?"), ("assistant", "4.")))
    assert first_human_turn(record) == "What is 2+2?" and first_reply(record) == "4."
    turns = later_turns(record)
    assert [t[0] for t in turns] == ["abc_3@t1", "abc_3@t2"]
    assert turns[0][1] == [user, assistant, {"role": "user", "content": "And 3+3?"}] and turns[0][2] == "6."
    assert turns[1][1][-1] == {"role": "user", "content": "Thanks"} and len(turns[1][1]) == 5 and turns[1][2] is None
    # a conversation ends at a turn that breaks the user/assistant alternation or is empty; no opening user message: none
    assert len(chat_messages(_record("x_0", "a", "b", "c", "d", speakers=["human", "gpt", "gpt", "human"]))) == 2
    assert len(chat_messages(_record("x_0", "a", " ", "c"))) == 1
    assert later_turns(_record("x_0", "a", "b", "c", speakers=["gpt", "human", "gpt"])) == []
    assert first_human_turn(_record("x_0", "a", speakers=["system"])) is None


@pytest.mark.parametrize("record_id", ["QWJhYvA_0", "QWJhYvA_11", "conv42_0", "plain"])
def test_a_turn_is_in_its_conversations_split(record_id):
    turn_id = later_turns(_record(record_id, "a", "b", "c"))[0][0]
    assert split_of(turn_id) == split_of(record_id) == split_of(record_id.rsplit("_", 1)[0] + "_7")


@pytest.fixture(scope="module")
def tokenizer():
    return load_default_target()[1]


def test_the_all_turns_queue_extends_the_first_turn_queue(tokenizer, monkeypatch):
    """``turns="all"``: the first-turn queue unchanged (token files stay valid), then the later turns as
    chat-templated histories, held-out first, each in its conversation's split; ``max_prompt_tokens`` cuts long ones."""
    records = [_record("conv0_0", "Hi there", "Hello!", "Tell me a joke", "Why did the chicken...", "Another"),
               _record("conv42_0", "What is Python?", "A language.", "Who made it?", "Guido."),  # validation
               _record("conv1_0", "Name a colour", "Blue.")]
    monkeypatch.setattr(sharegpt, "load_sharegpt", lambda: records)
    first = sharegpt_queue(tokenizer)
    every = sharegpt_queue(tokenizer, turns="all")
    assert first[0][0] == "conv42_0" and {i[0] for i in first[1:]} == {"conv0_0", "conv1_0"}  # held-out first
    assert every[: len(first)] == first
    later = {item[0]: item for item in every[len(first) :]}
    assert list(later)[0] == "conv42_0@t1" and set(later) == {"conv42_0@t1", "conv0_0@t1", "conv0_0@t2"}
    assert [later[k][1] for k in ("conv42_0@t1", "conv0_0@t1", "conv0_0@t2")] == ["validation", "train", "train"]
    history = records[0]["conversations"]
    messages = [{"role": ("user", "assistant")[k % 2], "content": t["value"]} for k, t in enumerate(history[:3])]
    ids = later["conv0_0@t1"][2]
    assert ids == chat_ids(tokenizer, messages) and len(ids) < len(later["conv0_0@t2"][2])
    assert "Hello!" in tokenizer.decode(ids) and tokenizer.decode(ids).count("<|im_start|>user") == 2
    short = sharegpt_queue(tokenizer, turns="all", max_prompt_tokens=len(ids))
    assert len(later["conv42_0@t1"][2]) > len(ids)
    assert [i[0] for i in short[len(first) :]] == ["conv0_0@t1"]  # the longer histories are left out
    with pytest.raises(ValueError, match='turns must be "first" or "all"'):
        sharegpt_queue(tokenizer, turns="later")


def test_a_later_turns_reply_continues_its_history(tokenizer):
    """The dataset's reply to a later turn is the assistant turn the template writes after the whole history."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "bye"}]
    prompt_ids = chat_ids(tokenizer, messages)
    reply = reply_ids(tokenizer, messages, "Goodbye!", prompt_ids, max_tokens=64)
    assert tokenizer.decode(reply) == "Goodbye!<|im_end|>"


def test_the_training_config_names_the_turns():
    assert TrainConfig().turns == "first" and TrainConfig(turns="all").max_prompt_tokens == 320
    with pytest.raises(ValueError, match="turns must be one of"):
        TrainConfig(turns="later")
