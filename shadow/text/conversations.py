"""Conversations read from disk: mini-swe-agent `.traj.json`, SWE-agent `.traj`, and the
project's own JSONL format.

Own format (`*.jsonl`): one message a line, `{"role": "system"|"user"|"assistant"|"tool",
"content": "...", "reasoning": "..."}` (`reasoning` optional, assistant only). Every assistant
message is one request's output; the messages before it are that request's prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shadow.text.chat import ROLES, Message
from shadow.errors import ShadowInputError, read_text


@dataclass(frozen=True)
class Conversation:
    name: str
    messages: tuple[Message, ...]

    def requests(self) -> Iterator[tuple[tuple[Message, ...], Message]]:
        """(prompt messages, output message) for each assistant message after the first message."""
        for i, m in enumerate(self.messages):
            if m.role == "assistant" and i > 0:
                yield self.messages[:i], m


def load_conversation(path: str | Path) -> Conversation:
    """Read any supported file; raises ShadowInputError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ShadowInputError(f"no conversation file {path}")
    text = read_text(path, "conversation")
    if not text.strip():
        raise ShadowInputError(f"{path} is empty")
    if path.suffix == ".jsonl":
        messages = _own_jsonl(path, text)
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ShadowInputError(f"{path} is not valid JSON: {e}") from None
        if isinstance(doc, dict) and isinstance(doc.get("messages"), list):
            messages = [_mini_swe_agent(_entry(m, path, k), path) for k, m in enumerate(doc["messages"])]
        elif isinstance(doc, dict) and isinstance(doc.get("history"), list):
            messages = [_message(_entry(m, path, k).get("role"), m.get("content"), None, path)
                        for k, m in enumerate(doc["history"])]
        else:
            raise ShadowInputError(
                f"{path}: unknown format (expected mini-swe-agent 'messages', SWE-agent 'history', or .jsonl)"
            )
    conversation = Conversation(name=path.name.split(".")[0], messages=tuple(messages))
    if not any(True for _ in conversation.requests()):
        raise ShadowInputError(f"{path} has no assistant message after the first message")
    return conversation


def _own_jsonl(path: Path, text: str) -> list[Message]:
    messages = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ShadowInputError(f"{path}:{n}: not valid JSON: {e}") from None
        if not isinstance(row, dict):
            raise ShadowInputError(f"{path}:{n}: expected an object with role and content")
        messages.append(_message(row.get("role"), row.get("content"), row.get("reasoning"), path, n))
    return messages


def _entry(m, path: Path, k: int) -> dict:
    if not isinstance(m, dict):
        raise ShadowInputError(f"{path}: message {k} is not an object")
    return m


def _mini_swe_agent(m: dict, path: Path) -> Message:
    reasoning = None
    extra = m.get("extra")
    if isinstance(extra, dict) and isinstance(extra.get("response"), dict):
        choices = extra["response"].get("choices")
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = first.get("message") if isinstance(first.get("message"), dict) else {}
        reasoning = message.get("reasoning")
    return _message(m.get("role"), m.get("content"), reasoning, path)


def _message(role, content, reasoning, path: Path, line: int | None = None) -> Message:
    where = f"{path}:{line}" if line else str(path)
    if role not in ROLES:
        raise ShadowInputError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ShadowInputError(f"{where}: message content must be text")
    return Message(role=role, content=content, reasoning=reasoning if isinstance(reasoning, str) else None)


def save_jsonl(conversation: Conversation, path: str | Path) -> None:
    """Write `conversation` in the project's own JSONL format."""
    with open(path, "w", encoding="utf-8") as f:
        for m in conversation.messages:
            row = {"role": m.role, "content": m.content}
            if m.reasoning is not None:
                row["reasoning"] = m.reasoning
            f.write(json.dumps(row) + "\n")
