"""Conversation loaders, the chat template's reasoning rule, and the sample session."""

from __future__ import annotations

import json

import pytest
from conftest import shared_file

from shadow.text.chat import Message, render_output, render_prompt
from shadow.text.conversations import load_conversation, save_jsonl
from shadow.errors import ShadowInputError
from shadow.text.sample import sample_conversation


def test_reasoning_drops_once_a_new_user_message_comes():
    a = Message("assistant", "ANSWER", "HIDDEN")
    with_reasoning = render_prompt([Message("user", "q1"), a], add_generation_prompt=False)
    assert "<think>\nHIDDEN\n</think>\n\nANSWER<|im_end|>" in with_reasoning
    dropped = render_prompt([Message("user", "q1"), a, Message("user", "q2")])
    assert "HIDDEN" not in dropped and "<|im_start|>assistant\nANSWER<|im_end|>" in dropped
    assert dropped.endswith("<|im_start|>assistant\n")
    assert render_output(a) == "<think>\nHIDDEN\n</think>\n\nANSWER<|im_end|>"


def test_tool_results_do_not_drop_reasoning():
    a = Message("assistant", "CALL", "WHY")
    text = render_prompt([Message("user", "q"), a, Message("tool", "result")])
    assert "WHY" in text and "<tool_response>\nresult\n</tool_response>" in text


def test_mini_swe_agent_trajectory_loads_with_reasoning():
    conv = load_conversation(shared_file("trajectories", "mini-swe-agent", "django__django-11095.traj.json"))
    assert conv.name == "django__django-11095"
    roles = {m.role for m in conv.messages}
    assert roles == {"system", "user", "assistant"}
    assert any(m.reasoning for m in conv.messages if m.role == "assistant")
    assert len(list(conv.requests())) == sum(m.role == "assistant" for m in conv.messages)


def test_swe_agent_trajectory_loads():
    conv = load_conversation(shared_file("trajectories", "swe-agent", "pydicom__pydicom-1458.traj"))
    assert len(conv.messages) == 26 and len(list(conv.requests())) > 0


def test_own_jsonl_round_trips(tmp_path):
    conv = sample_conversation(seed=3, turns=4)
    path = tmp_path / "s.jsonl"
    save_jsonl(conv, path)
    again = load_conversation(path)
    assert again.messages == conv.messages


def test_sample_is_seeded():
    assert sample_conversation(1, 5) == sample_conversation(1, 5)
    assert sample_conversation(1, 5) != sample_conversation(2, 5)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("empty.jsonl", "", "is empty"),
        ("bad.jsonl", '{"role": "user", "content": "hi"}\n{not json\n', "bad.jsonl:2: not valid JSON"),
        ("role.jsonl", '{"role": "robot", "content": "hi"}\n', "unknown role 'robot'"),
        ("noanswer.jsonl", '{"role": "user", "content": "hi"}\n', "no assistant message"),
        ("other.json", json.dumps({"foo": 1}), "unknown format"),
        ("broken.json", "{", "not valid JSON"),
    ],
    ids=["empty", "malformed-line", "unknown-role", "no-assistant", "unknown-format", "broken-json"],
)
def test_bad_files_get_one_clear_error(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ShadowInputError, match=message):
        load_conversation(path)


def test_missing_file(tmp_path):
    with pytest.raises(ShadowInputError, match="no conversation file"):
        load_conversation(tmp_path / "nope.jsonl")


def test_tokenizer_decodes_padding_ids_to_nothing(tokenizer):
    assert tokenizer.decode([248114, 32, 248319]) == "A"
