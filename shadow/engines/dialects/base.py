"""The generic dialect (any OpenAI-compatible engine) that the others build on, and what every
dialect shares: the request as the engine is asked it (`Asked`), a prompt known before the
response (`Prompt`), the messages as a request carries them."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field

import httpx

from shadow.text.chat_template import ChatRenderer, TemplateError
from shadow.engines.idcheck import TurnIds, first_difference
from shadow.engines.reply import Reply

log = logging.getLogger("shadow.proxy")


# what an event with no choices may hold and still be dropped once the proxy's fields are off:
# the envelope, and llama.cpp's `timings`, which rides on the last chunk (the usage chunk when the
# proxy asked for usage, else the finish chunk: the one loss, docs/SERVE.md)
ENVELOPE = frozenset({"id", "object", "created", "model", "system_fingerprint", "choices", "timings"})


@dataclass(frozen=True)
class Asked:
    """The body sent to the engine, and what the proxy added to it (to strip from the response)."""

    body: dict
    added: frozenset[str] = frozenset()


@dataclass
class Prompt:
    ids: list[int] | None
    source: str | None
    notes: list[str] = field(default_factory=list)


class Dialect:
    """The generic OpenAI-compatible engine: the big model's template; the output from logprobs
    (else not read)."""

    name = "openai"
    prompt_source = "template"
    output_source = "logprobs (else not read)"
    asks_usage = True  # stream_options.include_usage is accepted
    asks_logprobs = True

    def __init__(self, renderer: ChatRenderer | None = None, eos_text: str = "<|im_end|>", eos_id: int | None = None,
                 template_kwargs: dict | None = None):
        self.renderer = renderer
        self.template_kwargs = dict(template_kwargs or {})  # the engine's defaults; a request's win
        self.eos_text = eos_text
        self.eos_id = eos_id
        self._bytes_to_id: dict[bytes, int] | None = None

    def describe(self) -> str:
        template = f" ({self.renderer.origin})" if self.renderer else " (none found: prompts are not read)"
        return (f"engine dialect {self.name}: prompt ids from {self.prompt_source}"
                f"{template if self.prompt_source.startswith('template') or self.name == 'sglang' else ''}; "
                f"output ids from {self.output_source}")

    # the request ------------------------------------------------------------------------

    def ask(self, body: dict, chat: bool) -> Asked:
        sent, added = dict(body), set()
        if body.get("stream") and self.asks_usage:
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            if not options.get("include_usage"):
                sent["stream_options"] = {**options, "include_usage": True}
                added.add("usage")
        if self.asks_logprobs and self.renderer is not None and "logprobs" not in body:
            sent["logprobs"] = True if chat else 0
            added.add("logprobs")
        return Asked(sent, frozenset(added))

    def template_messages(self, body: dict) -> tuple[list[dict], list | None, dict]:
        """The messages, tools and template kwargs the engine's template sees."""
        messages, tools, kwargs = as_carried(body)
        return messages, tools, {**self.template_kwargs, **kwargs}

    def prompt(self, client: httpx.Client, root: str, body: dict, chat: bool) -> Prompt:
        """The prompt ids known before the response (ids None where the engine will show them).
        Blocking: the proxy runs it in a thread beside the request."""
        return self.render(body, chat)

    def render(self, body: dict, chat: bool) -> Prompt:
        if self.renderer is None:
            return Prompt(None, None, ["no chat template"])
        try:
            if not chat:
                p = body.get("prompt")
                if isinstance(p, str):
                    return Prompt(self.renderer.encode(p), "template")
                if _ints(p):
                    return Prompt(list(p), "template")
                return Prompt(None, None, ["a prompt that is not one string or one list of ids"])
            messages, tools, kwargs = self.template_messages(body)
            return Prompt(self.renderer.prompt_ids(messages, tools, kwargs), "template")
        except TemplateError as e:
            return Prompt(None, None, [str(e)])
        except Exception as e:  # a malformed request: the engine judges it, the shadow reads nothing
            return Prompt(None, None, [f"cannot render ({type(e).__name__}: {e})"])

    def next_prompt(self, body: dict, reply, chat: bool) -> list[int] | None:
        """The ids the next request's prompt will start with once `reply` (the turn's `Reply`) is
        in its history, as the template renders it (`ChatRenderer.next_prompt_ids`); None for a
        completion without messages, without a template, or where the template gives none."""
        if self.renderer is None or not chat:
            return None
        try:
            messages, tools, kwargs = self.template_messages(body)
            return self.renderer.next_prompt_ids(messages, normalise_message(reply.message()), tools, kwargs)
        except Exception:  # noqa: BLE001 - a request the template cannot take: nothing is predicted
            return None

    # the response -----------------------------------------------------------------------

    def clean(self, event: dict, added: frozenset[str], client_asked: dict) -> dict | None:
        """The event as the client would have had it without what the proxy added; None drops an
        event with no choices that carried nothing else the client would have had (the usage
        chunk, SGLang's ids chunk). `client_asked` is the client's own request body."""
        if not added:
            return event
        out = dict(event)
        removed = self._strip(out, added, client_asked)
        if isinstance(out.get("choices"), list):
            if not out["choices"] and removed and all(k in ENVELOPE or v is None for k, v in out.items()):
                return None
            out["choices"] = [self._clean_choice(c, added, client_asked) for c in out["choices"]]
        return out

    def _strip(self, out: dict, added: frozenset[str], client_asked: dict) -> bool:
        """Take the fields the proxy asked for off the event itself (not its choices); whether any was there."""
        removed = False
        if "usage" in added and "usage" in out:
            out.pop("usage")
            removed = True
        if "token_ids" in added:
            removed |= out.pop("prompt_token_ids", None) is not None
        return removed

    def _clean_choice(self, choice, added: frozenset[str], client_asked: dict):
        if not isinstance(choice, dict):
            return choice
        c = dict(choice)
        if "token_ids" in added:
            for key in ("token_ids", "prompt_token_ids"):
                c.pop(key, None)
        if "logprobs" in added and "logprobs" in c:
            c["logprobs"] = None
        if "tokens" in added:
            c.pop("tokens", None)
        return c

    def turn_ids(self, reply: Reply, before: Prompt | None, body: dict, chat: bool) -> TurnIds:
        """The ids the shadow reads for the turn, from the best source this dialect has."""
        t = TurnIds(prompt_tokens=reply.usage_count("prompt_tokens"),
                    completion_tokens=reply.usage_count("completion_tokens"))
        if before is not None:
            t.notes += before.notes
        if reply.prompt_ids is not None:  # the engine's own ids win over any rendering
            t.prompt, t.prompt_source = reply.prompt_ids, "engine"
            if before is not None and before.ids is not None and before.ids != reply.prompt_ids:
                t.notes.append(f"the {before.source} prompt differed from the engine's at "
                               f"{first_difference(before.ids, reply.prompt_ids)}; the engine's was read")
        elif before is not None and before.ids is not None:
            t.prompt, t.prompt_source = before.ids, before.source
        if reply.choices_seen > 1:
            t.notes.append(f"{reply.choices_seen} choices: the shadow reads the first")
        if reply.malformed:
            t.notes.append(f"{reply.malformed} malformed event(s) skipped")
        shown = reply.engine_output()
        if shown is not None and (reply.shown_output or reply.ext_output is not None):
            t.output, t.output_source = shown, "engine"
        elif shown is not None:  # the ids beside the logprobs (llama.cpp): the end token may be left out
            t.output, t.output_source = shown, "logprobs"
            self._end(reply, t.output, t)
        elif not (reply.shown_logprobs and self._from_logprobs(reply, t)):
            t.output_skipped = ("output not read: the engine showed no output ids (its text is not re-tokenised: an "
                                "equal count is not equal ids); the next prompt brings the reply")
        self._read_only_if_counted(t)
        return t

    @staticmethod
    def _read_only_if_counted(t: TurnIds) -> None:
        """Logprob ids are read only when their count is the engine's: ids known to be
        incomplete (a streamed chat's logprobs leave out what the reasoning parser holds back)
        are never read, and the next prompt brings the reply as the engine renders it."""
        want = t.completion_tokens
        if t.output_source != "logprobs" or want is None:
            return
        n = len(t.output)
        if n == want or ("end token appended" in t.notes and n - 1 == want):
            return
        t.output_skipped = f"output not read: {n} ids from logprobs, the engine counted {want}"
        t.output = []

    def _from_logprobs(self, reply: Reply, t: TurnIds) -> bool:
        """The engine's output tokens, one a logprob entry, mapped by their bytes to the big
        model's ids (a byte-level vocabulary names each token's bytes once)."""
        table = self._id_table()
        if table is None:
            return False
        ids = []
        for text, raw in reply.logprob_tokens:
            key = bytes(raw) if raw is not None else text.encode("utf-8")
            i = table.get(key)
            if i is None and text.startswith("token_id:") and text[9:].isdigit():
                i = int(text[9:])
            if i is None:
                t.notes.append(f"logprob token {text!r} is not in the vocabulary")
                return False
            ids.append(i)
        self._end(reply, ids, t)
        t.output, t.output_source = ids, "logprobs"
        return True

    def _end(self, reply: Reply, ids: list[int], t: TurnIds) -> None:
        """Append the end token the engine stopped on and did not show."""
        if reply.finish_reason in ("stop", "tool_calls") and self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)
            t.notes.append("end token appended")

    def _id_table(self) -> dict[bytes, int] | None:
        """Token bytes to id, from the big model's tokenizer (specials by their text)."""
        if self._bytes_to_id is None and self.renderer is not None:
            from shadow.text.vocab import byte_to_unicode

            back = {c: b for b, c in byte_to_unicode().items()}
            table: dict[bytes, int] = {}
            tok = self.renderer.tokenizer
            special = set(getattr(tok, "all_special_tokens", []) or []) | {
                a.content for a in getattr(tok, "added_tokens_decoder", {}).values()}
            for text, i in tok.get_vocab().items():
                if text in special or any(ch not in back for ch in text):
                    table[text.encode("utf-8")] = i
                else:
                    table.setdefault(bytes(back[ch] for ch in text), i)
            self._bytes_to_id = table
        return self._bytes_to_id


def as_carried(body: dict) -> tuple[list[dict], list | None, dict]:
    """The request's messages as it carries them (tool-call arguments given as a JSON string are
    parsed, as vLLM and transformers do: templates iterate them as a mapping), its tools and its
    chat_template_kwargs."""
    messages = [normalise_message(m) for m in body.get("messages") or []]
    kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
    return messages, body.get("tools"), dict(kwargs)


def normalise_message(m: dict) -> dict:
    if not isinstance(m, dict) or not m.get("tool_calls"):
        return m
    return {**m, "tool_calls": [_parsed_arguments(c) for c in m["tool_calls"]]}


def _parsed_arguments(call):
    if not isinstance(call, dict):
        return call
    call = copy.deepcopy(call)
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass
    return call


def post(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    """POST to one of an engine's pure endpoints (/tokenize, /apply-template) within the client's
    own time limits (the proxy's: `--engine-connect-timeout-s`, `--engine-idle-timeout-s`), once
    more on a connection the engine had closed (llama.cpp closes idle keep-alive connections)."""
    try:
        return client.post(url, json=body)
    except httpx.RemoteProtocolError:
        return client.post(url, json=body)


def _ints(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
