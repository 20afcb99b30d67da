"""What an engine's response says about a turn, gathered event by event: the ids it shows (prompt
and output, in whichever field that engine uses), logprob tokens, the text of reasoning, content
and tool calls, `usage` and the finish reason. Reading never raises: a malformed event is
counted and skipped, since the client's response must never depend on the shadow.

Only the first choice is followed (`n` > 1 is noted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def _ints(value) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return list(value)
    return None


@dataclass
class ToolCallText:
    name: str = ""
    arguments: str = ""
    id: str | None = None


@dataclass
class Reply:
    prompt_ids: list[int] | None = None  # as the engine showed them
    output_ids: list[int] = field(default_factory=list)
    shown_output: bool = False  # the engine showed output ids (possibly none yet)
    logprob_tokens: list[tuple[str, list[int] | None]] = field(default_factory=list)  # (token text, its bytes)
    logprob_ids: list[int | None] = field(default_factory=list)  # ids beside them, where the engine gives them
    shown_logprobs: bool = False
    ext_output: list[int] | None = None  # SGLang's sglext.output_ids of the first choice
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCallText] = field(default_factory=dict)
    usage: dict | None = None
    finish_reason: str | None = None
    choices_seen: int = 0  # the most choices one event carried
    malformed: int = 0
    events: int = 0

    def read(self, event, chat: bool) -> None:
        """One streamed chunk or a whole response body."""
        self.events += 1
        try:
            self._read(event, chat)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError):
            self.malformed += 1

    def _read(self, event, chat: bool) -> None:
        if not isinstance(event, dict):
            self.malformed += 1
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        self._take_prompt(event.get("prompt_token_ids"))
        ext = event.get("sglext")
        if isinstance(ext, dict):  # SGLang: the prompt, and every choice's output ids (a list per choice)
            self._take_prompt(ext.get("input_ids"))
            out = ext.get("output_ids")
            out = _ints(out[0]) if isinstance(out, list) and out and isinstance(out[0], list) else None
            if out is not None:
                self.ext_output = out
        choices = event.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list):
            self.malformed += 1
            return
        self.choices_seen = max(self.choices_seen, len(choices))
        if any(not isinstance(c, dict) for c in choices):
            self.malformed += 1
        choice = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), None)
        if choice is not None:
            self._read_choice(choice, chat)

    def _take_prompt(self, value) -> None:
        ids = _ints(value)
        if ids is not None and self.prompt_ids is None:
            self.prompt_ids = ids

    def _read_choice(self, choice: dict, chat: bool) -> None:
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
        self._take_prompt(choice.get("prompt_token_ids"))
        for key in ("token_ids", "response_token_ids"):  # vLLM, SGLang completions; SGLang chat (2026)
            if choice.get(key) is None:
                continue
            ids = _ints(choice[key])
            if ids is None:
                self.malformed += 1
            else:
                self.shown_output = True
                self.output_ids += ids
        self._read_logprobs(choice.get("logprobs"))
        if not chat:
            if isinstance(choice.get("text"), str):
                self.content.append(choice["text"])
            return
        part = choice.get("delta") if isinstance(choice.get("delta"), dict) else choice.get("message")
        if not isinstance(part, dict):
            return
        reasoning = part.get("reasoning_content", part.get("reasoning"))
        if isinstance(reasoning, str):
            self.reasoning.append(reasoning)
        if isinstance(part.get("content"), str):
            self.content.append(part["content"])
        for n, call in enumerate(part.get("tool_calls") or []):
            if isinstance(call, dict):
                self._read_tool_call(call, n)

    def _read_tool_call(self, call: dict, n: int) -> None:
        index = call.get("index", n) if isinstance(call.get("index", n), int) else n
        t = self.tool_calls.setdefault(index, ToolCallText())
        if isinstance(call.get("id"), str):
            t.id = call["id"]
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        if isinstance(fn.get("name"), str):
            t.name += fn["name"]
        args = fn.get("arguments")
        if isinstance(args, str):
            t.arguments += args
        elif isinstance(args, dict):
            t.arguments += json.dumps(args, ensure_ascii=False)

    def _read_logprobs(self, logprobs) -> None:
        if not isinstance(logprobs, dict):
            return
        content = logprobs.get("content")
        if isinstance(content, list):  # chat: [{"token", "bytes", "logprob", ...}] (llama.cpp adds "id")
            self.shown_logprobs = True
            for item in content:
                if isinstance(item, dict) and isinstance(item.get("token"), str):
                    self.logprob_tokens.append((item["token"], _ints(item.get("bytes"))))
                    i = item.get("id")
                    self.logprob_ids.append(i if isinstance(i, int) and not isinstance(i, bool) else None)
            return
        tokens = logprobs.get("tokens")
        if isinstance(tokens, list):  # completions: "tokens": [str, ...]
            self.shown_logprobs = True
            self.logprob_tokens += [(t, None) for t in tokens if isinstance(t, str)]

    # what was gathered -------------------------------------------------------------------

    def engine_output(self) -> list[int] | None:
        """The output ids as the engine showed them: per-chunk ids, SGLang's sglext ids, or the
        ids beside every logprob (llama.cpp); None when it showed none."""
        if self.shown_output:
            return list(self.output_ids)
        if self.ext_output is not None:
            return list(self.ext_output)
        if self.logprob_ids and all(i is not None for i in self.logprob_ids):
            return list(self.logprob_ids)
        return None

    def output_count(self) -> int:
        """How many output ids the engine has produced so far, as far as the reply shows: the most
        of its shown ids, its logprob tokens and its usage's `completion_tokens`."""
        shown = max(len(self.output_ids), len(self.ext_output or ()), len(self.logprob_tokens))
        return max(shown, self.usage_count("completion_tokens") or 0)

    @property
    def text(self) -> str:
        return "".join(self.reasoning) + "".join(self.content)

    def message(self) -> dict:
        """The reply as an assistant message (what a client would send back)."""
        out: dict = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            out["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": t.id or f"call_{i}", "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                for i, t in sorted(self.tool_calls.items())
            ]
        return out

    def usage_count(self, key: str) -> int | None:
        value = (self.usage or {}).get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
