"""How a conversation's turns become ids: the prompt of each request, what the model wrote, and
(where the big model's template renders them) the next prompt's start as the proxy predicts it.
`CodeRendering` is the project's own Qwen3.5-style template in code; `TemplateRendering` is the
big model's chat template and tokenizer, as the proxy renders them."""

from __future__ import annotations

from collections.abc import Sequence

from shadow.text.chat import Message, render_output, render_prompt
from shadow.text.chat_template import ChatRenderer
from shadow.text.tokenizer import Tokenizer


class CodeRendering:
    """Turns rendered by the project's own Qwen3.5-style template in code (`shadow.text.chat`)
    and tokenized by `tokenizer`; it predicts no next prompt."""

    predicts = False

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def prompt(self, history: Sequence[Message]) -> list[int]:
        return self.tokenizer.encode(render_prompt(history))

    def output(self, history: Sequence[Message], output: Message) -> list[int]:
        return self.tokenizer.encode(render_output(output))

    def next_prompt(self, history: Sequence[Message], output: Message) -> list[int] | None:
        return None


class TemplateRendering:
    """Turns rendered as the proxy renders them: the big model's chat template and tokenizer
    (`ChatRenderer`); the output is what the template writes after the generation prompt, through
    its end token, and the next prompt's start is predicted as the proxy predicts it."""

    predicts = True

    def __init__(self, renderer: ChatRenderer, end: str = "<|im_end|>"):
        self.renderer, self.end = renderer, end

    def prompt(self, history: Sequence[Message]) -> list[int]:
        return self.renderer.prompt_ids(_dicts(history))

    def output(self, history: Sequence[Message], output: Message) -> list[int]:
        text = self.renderer.reply_text(_dicts(history), _dict(output), end=self.end)
        return self.renderer.encode(text if text is not None else output.content + self.end)

    def next_prompt(self, history: Sequence[Message], output: Message) -> list[int] | None:
        return self.renderer.next_prompt_ids(_dicts(history), _dict(output))


def _dict(m: Message) -> dict:
    d = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        d["reasoning_content"] = m.reasoning
    return d


def _dicts(messages: Sequence[Message]) -> list[dict]:
    return [_dict(m) for m in messages]
