"""The embedded engine's requests and responses in the OpenAI shapes: chat messages parsed
(`parse_messages`), and one response's chunks, stream and whole body (`Completion`, with vLLM's
ids when asked)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from shadow.errors import ShadowInputError
from shadow.server.events import Events
from shadow.server.gaps import LongGaps
from shadow.server.http.errors import error_body
from shadow.text.chat import Message
from shadow.text.detok import TextStream
from shadow.text.tokenizer import Tokenizer


class Completion:
    """One response of the embedded engine, in the OpenAI shapes (and vLLM's ids when asked)."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, eos: list[int], rid: str, created: int, *, chat: bool,
                 want_ids: bool, prompt: list[int], with_usage: bool = False):
        """`eos`: ids whose text is never sent; `want_ids`: the ids the vLLM way; `with_usage`: a
        stream's last chunk before [DONE] carries the usage, with no choices."""
        self.tokenizer, self.model_name, self.eos = tokenizer, model_name, eos
        self.rid, self.created, self.chat = rid, created, chat
        self.want_ids, self.prompt, self.with_usage = want_ids, prompt, with_usage
        self.text = TextStream(tokenizer)

    def usage(self, out: list[int]) -> dict:
        n = len(self.prompt)
        return {"prompt_tokens": n, "completion_tokens": len(out), "total_tokens": n + len(out)}

    def chunk(self, token: int | None, text: str, finish: str | None, first: bool) -> dict:
        choice = {"index": 0, "finish_reason": finish}
        if self.want_ids:
            choice["token_ids"] = [] if token is None else [token]
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        out = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [choice]}
        if first and self.want_ids:
            out["prompt_token_ids"] = self.prompt
        return out

    def usage_chunk(self, out: list[int]) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": [], "usage": self.usage(out)}

    def event(self, kind: str, value, out: list[int], first: bool) -> tuple[str, bool]:
        """The SSE text of one event, and whether the stream ends with it."""
        if kind == "token":
            out.append(value)
            text = self.text.push(value) if value not in self.eos else ""
            return f"data: {json.dumps(self.chunk(value, text, None, first))}\n\n", False
        if kind == "done":
            text = f"data: {json.dumps(self.chunk(None, self.text.rest(), value, first))}\n\n"
            if self.with_usage:  # as OpenAI: one more chunk, with no choices and the whole usage
                text += f"data: {json.dumps(self.usage_chunk(out))}\n\n"
            return text + "data: [DONE]\n\n", True
        return f"data: {json.dumps(error_body(value, 'server_error'))}\n\ndata: [DONE]\n\n", True

    async def sse(self, events: Events, gaps: LongGaps, lines=None, ended: Callable[[], None] = lambda: None):
        """The stream's SSE text, its writes' gaps told to `gaps`. With `lines` (the embedded
        engine's `TokenLines`), status lines go out before the delta they are due with; a line
        that takes a phrase is held while the turn's rounds write it (the tokens go on), and goes
        out when it is written, in order; at the last event every line still held goes out."""
        out: list[int] = []
        wrote = None  # the last write that carried tokens
        try:
            while True:
                first = await events.get(1.0)
                if first is None:  # the engine is silent (a long prefill): lines that are due
                    if lines is not None:
                        lines.hold(lines.writer.due(time.monotonic()))
                        yield b"".join(lines.writer.encode(lines.ready()))
                    continue
                batch = [first]
                while (more := events.get_nowait()) is not None:  # whatever else is here goes in the same write
                    batch.append(more)
                text, tokens = [], False  # tokens: the text holds a token
                for kind, value in batch:
                    if kind == "lines":  # a phrase held is written
                        if lines is not None:
                            text.append(b"".join(lines.writer.encode(lines.ready())).decode())
                        continue
                    if lines is not None:
                        said, delta = lines.before(kind, value, time.monotonic())
                        lines.hold(said)
                        if kind != "token" and tokens:  # the tokens before the end go out now: only the
                            wrote = _wrote(gaps, wrote)  # end waits for its lines' phrases
                            yield "".join(text)
                            text, tokens = [], False
                        ready = lines.ready() if kind == "token" else await lines.rest()
                        text.append(b"".join(lines.writer.encode(ready) + lines.writer.resume(delta)).decode())
                    line, last = self.event(kind, value, out, first=not out)
                    text.append(line)
                    tokens = tokens or kind == "token"
                    if last:
                        if tokens:
                            wrote = _wrote(gaps, wrote)
                        yield "".join(text)
                        return
                if tokens:
                    wrote = _wrote(gaps, wrote)
                yield "".join(text)
        finally:
            if lines is not None:
                lines.close()
            ended()

    def whole(self, out: list[int], finish: str) -> dict:
        text = self.tokenizer.decode([t for t in out if t not in self.eos])
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        result = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.model_name, "choices": [choice],
                  "usage": self.usage(out)}
        if self.want_ids:
            choice["token_ids"] = out
            result["prompt_token_ids"] = self.prompt
        return result


def parse_messages(raw) -> list[Message]:
    """OpenAI chat messages (content as text or text parts; assistant reasoning as
    `reasoning_content` or `reasoning`) as the in-code template's messages; a ShadowInputError for
    anything else."""
    if not isinstance(raw, list) or not raw:
        raise ShadowInputError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ShadowInputError(f"messages[{i}] needs a role of system, user, assistant or tool")
        content = m.get("content") or ""
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict)]
            if not all(isinstance(p, str) for p in parts):
                raise ShadowInputError(f"messages[{i}].content parts must carry text")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ShadowInputError(f"messages[{i}].content must be text")
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        out.append(Message(m["role"], content, reasoning if isinstance(reasoning, str) else None))
    return out


def _wrote(gaps: LongGaps, wrote: float | None) -> float:
    """A write of tokens now: the gap since the one before (`wrote`) to `gaps`; now."""
    now = time.perf_counter()
    if wrote is not None:
        gaps.add("write", now - wrote)
    return now
