"""A Qwen3.5-style chat template, in code.

Messages render as `<|im_start|>{role}\n{content}<|im_end|>\n`; tool results as a user turn
wrapped in `<tool_response>`. An assistant turn after the last user message keeps its reasoning
(`<think>\n...\n</think>\n\n` before the content); an earlier one drops it. That is the Qwen3
rule, and the reason a shadow must roll back: the prompt of the next request differs from the
prompt + output it read as soon as a new user message arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    reasoning: str | None = None


def render_prompt(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The prompt text of a request whose history is `messages`."""
    last_query = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    parts = []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            body = render_output(m) if i > last_query else f"{m.content}<|im_end|>"
            parts.append(f"<|im_start|>assistant\n{body}\n")
        elif m.role == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{m.content}\n</tool_response><|im_end|>\n")
        else:
            parts.append(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_output(message: Message) -> str:
    """What the model generated for an assistant message, up to and including <|im_end|>."""
    return f"<think>\n{message.reasoning or ''}\n</think>\n\n{message.content}<|im_end|>"


def render_question(question: str) -> str:
    """A question appended after a session's last id: a new user turn and the assistant's start."""
    return f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
