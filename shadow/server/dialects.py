"""Engine dialects: how each serving engine is asked for the ids it read and wrote, where they come
back, and what the proxy strips again before the client sees the response.

| dialect | prompt ids | output ids |
|---|---|---|
| `vllm` | `prompt_token_ids` (asked with `return_token_ids`) | `choices[].token_ids` |
| `sglang` | `prompt_token_ids` / `sglext` on non-streamed chat and on completions; else the template | the same, else logprobs, else re-tokenised text |
| `llamacpp` | the engine's own `/apply-template` and `/tokenize` | `tokens` (asked with `return_tokens`) |
| `transformers` | the big model's template over the messages as `transformers serve` passes them | re-tokenised text |
| `openai` | the big model's template over the messages as the request carries them | logprobs' bytes, else re-tokenised text |

Every dialect asks for `usage` where the engine accepts the request field, and strips what it
added (fields and the usage chunk) when the client did not ask for it. A dialect is chosen at
start by `probe` (or `--engine`); the choice and its id sources are said once.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from dataclasses import dataclass, field

import httpx

from shadow.chat_template import ChatRenderer, TemplateError
from shadow.server.idcheck import TurnIds, first_difference
from shadow.server.reply import Reply

log = logging.getLogger("shadow.proxy")

ENGINES = ("vllm", "sglang", "llamacpp", "transformers", "openai")


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
    """The generic OpenAI-compatible engine: the big model's template, logprobs or re-tokenised text."""

    name = "openai"
    prompt_source = "template"
    output_source = "logprobs, else re-tokenised text"
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

    # the response -----------------------------------------------------------------------

    def clean(self, event: dict, added: frozenset[str], client_asked: dict) -> dict | None:
        """The event as the client would have had it without what the proxy added; None drops an
        event that only carried what the proxy asked for (the usage chunk, SGLang's ids chunk)."""
        if not added:
            return event
        out = dict(event)
        removed = False
        if "usage" in added and "usage" in out:
            out.pop("usage")
            removed = True
        if "token_ids" in added:
            removed |= out.pop("prompt_token_ids", None) is not None
            removed |= out.pop("sglext", None) is not None
        if isinstance(out.get("choices"), list):
            if not out["choices"] and removed:
                return None
            out["choices"] = [self._clean_choice(c, added) for c in out["choices"]]
        return out

    def _clean_choice(self, choice, added: frozenset[str]):
        if not isinstance(choice, dict):
            return choice
        c = dict(choice)
        if "token_ids" in added:
            for key in ("token_ids", "response_token_ids", "prompt_token_ids", "meta_info"):
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
        elif reply.shown_logprobs and self._from_logprobs(reply, t):
            pass
        else:
            self._retokenise(reply, body, chat, t)
        self._read_only_if_counted(t)
        return t

    @staticmethod
    def _read_only_if_counted(t: TurnIds) -> None:
        """An output that is not the engine's own id list (logprobs, re-tokenised text) is read
        only when its length is the engine's count: ids known to be wrong are never read (the
        next prompt brings the reply as the engine renders it)."""
        want = t.completion_tokens
        if t.output_source not in ("logprobs", "retokenised") or want is None:
            return
        n = len(t.output)
        if n == want or ("end token appended" in t.notes and n - 1 == want):
            return
        t.output_skipped = f"output not read: {n} ids from {t.output_source}, the engine counted {want}"
        t.output = []

    def _from_logprobs(self, reply: Reply, t: TurnIds) -> bool:
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

    def _retokenise(self, reply: Reply, body: dict, chat: bool, t: TurnIds) -> None:
        """The output re-tokenised from its text. Candidates, in order: the reply as the template
        writes it (reasoning, content, tool calls, through the end token), then the raw text with
        and without the end token, raw and stripped; the first whose length is the engine's count
        is taken, else the first (and then it is not read: `_read_only_if_counted`)."""
        candidates: list[list[int]] = []
        try:
            if chat and reply.finish_reason in ("stop", "tool_calls"):
                text = self._reply_text(body, reply)
                if text is not None:
                    candidates.append(self._encode(text))
            raw = reply.text + "".join(c.arguments for c in reply.tool_calls.values())
            ended = reply.finish_reason in ("stop", "tool_calls") and self.eos_id is not None
            for text in (raw, raw.strip()):
                ids = self._encode(text)
                candidates += [ids + [self.eos_id], ids] if ended else [ids]
        except Exception as e:  # noqa: BLE001 - no tokenizer, a template that cannot write it, an engine down
            t.notes.append(f"the output could not be re-tokenised ({type(e).__name__}: {e})")
            return
        want = t.completion_tokens
        chosen = next((c for c in candidates if len(c) == want), candidates[0])
        t.output, t.output_source = list(chosen), "retokenised"

    def _reply_text(self, body: dict, reply: Reply) -> str | None:
        """The reply as the big model's template writes it after the generation prompt."""
        if self.renderer is None:
            return None
        messages, tools, kwargs = self.template_messages(body)
        return self.renderer.reply_text(messages, normalise_message(reply.message()), tools, kwargs, end=self.eos_text)

    def _encode(self, text: str) -> list[int]:
        if self.renderer is None:
            raise ValueError("no tokenizer")
        return self.renderer.encode(text)

    def _end(self, reply: Reply, ids: list[int], t: TurnIds) -> None:
        """Append the end token the engine stopped on and did not show."""
        if reply.finish_reason in ("stop", "tool_calls") and self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)
            t.notes.append("end token appended")

    def _id_table(self) -> dict[bytes, int] | None:
        """Token bytes to id, from the big model's tokenizer (specials by their text)."""
        if self._bytes_to_id is None and self.renderer is not None:
            from shadow.vocab import byte_to_unicode

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


class VLLM(Dialect):
    name = "vllm"
    prompt_source = "engine (return_token_ids)"
    output_source = "engine (choices[].token_ids)"
    asks_logprobs = False

    def ask(self, body: dict, chat: bool) -> Asked:
        asked = super().ask(body, chat)
        if body.get("return_token_ids"):
            return asked
        return Asked(asked.body | {"return_token_ids": True}, asked.added | {"token_ids"})

    def prompt(self, client, root, body, chat) -> Prompt:
        return Prompt(None, None)  # the engine shows them; the template only if it does not (turn_ids)

    def turn_ids(self, reply: Reply, before: Prompt | None, body: dict, chat: bool) -> TurnIds:
        if reply.prompt_ids is None and (before is None or before.ids is None):
            before = self.render(body, chat)
            before.notes.insert(0, "the engine showed no prompt ids")
        return super().turn_ids(reply, before, body, chat)


class SGLang(VLLM):
    """SGLang: non-streamed chat and completions return ids when asked (`return_token_ids`,
    `return_prompt_token_ids`); a streamed chat request refuses those (400), so it asks for the
    `sglext` ids instead (`return_input_ids_in_sglext`, `return_output_ids_in_sglext`: one
    chunk after the last choice chunk, in 2026 releases; older ones ignore unknown fields), and
    the turn falls back to the template and logprobs where they do not come."""

    name = "sglang"
    prompt_source = "engine (ids fields, or sglext on streamed chat), else template"
    output_source = "engine, else logprobs, else re-tokenised text"
    asks_logprobs = True

    def ask(self, body: dict, chat: bool) -> Asked:
        asked = Dialect.ask(self, body, chat)
        if chat and body.get("stream"):
            wanted = ("return_input_ids_in_sglext", "return_output_ids_in_sglext")
        elif chat:
            wanted = ("return_token_ids", "return_prompt_token_ids")
        else:
            wanted = ("return_token_ids",)
        extra = {k: True for k in wanted if not body.get(k)}
        return Asked(asked.body | extra, asked.added | ({"token_ids"} if extra else set()))

    def prompt(self, client, root, body, chat) -> Prompt:
        if chat and body.get("stream"):  # the template, in case this release sends no sglext ids
            return self.render(body, chat)
        return Prompt(None, None)


class LlamaCpp(Dialect):
    """llama.cpp's `llama-server`: the engine's own template and tokenizer (`/apply-template`,
    `/tokenize`) give the prompt ids (`usage.prompt_tokens` counts them, cached or not); the
    output ids are the `id` beside each logprob (its OpenAI endpoints ignore `return_tokens`):
    complete, end token included, on a whole response; a streamed chat leaves out what its
    reasoning parser holds back (`</think>` and the end token), so such an output is read only
    when its count is the engine's."""

    name = "llamacpp"
    prompt_source = "engine-tokenize (/apply-template, /tokenize)"
    output_source = "the ids beside logprobs (else its own template and /tokenize over the reply's text)"
    _engine: tuple[httpx.Client, str] | None = None

    def ask(self, body: dict, chat: bool) -> Asked:
        sent, added = dict(body), set()
        if body.get("stream"):
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            if not options.get("include_usage"):
                sent["stream_options"] = {**options, "include_usage": True}
                added.add("usage")
        if not body.get("logprobs") and not (body.get("stream") and body.get("tools")):
            sent["logprobs"] = True if chat else 1  # (refused with tools on a stream: no output ids then)
            added.add("logprobs")
        return Asked(sent, frozenset(added))

    def _reply_text(self, body: dict, reply: Reply) -> str | None:
        """The reply as the engine's own template writes it: /apply-template with and without it."""
        if self._engine is None:
            return None
        client, root = self._engine
        query = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        before = post(client, root + "/apply-template", query).json()["prompt"]
        after = post(client, root + "/apply-template", query | {
            "messages": [*body["messages"], reply.message()], "add_generation_prompt": False}).json()["prompt"]
        if not after.startswith(before) or self.eos_text not in after[len(before):]:
            return None
        rest = after[len(before):]
        return rest[: rest.rfind(self.eos_text) + len(self.eos_text)]

    def _encode(self, text: str) -> list[int]:
        """The engine's own tokenizer (llama.cpp does not NFC-normalise, and reaches other merges)."""
        if self._engine is None:
            raise ValueError("the engine's tokenizer is not known yet")
        client, root = self._engine
        r = post(client, root + "/tokenize", {"content": text, "parse_special": True})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def prompt(self, client: httpx.Client, root: str, body: dict, chat: bool) -> Prompt:
        self._engine = (client, root)
        try:
            if chat:
                query = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
                r = post(client, root + "/apply-template", query)
                r.raise_for_status()
                text = r.json()["prompt"]
            else:
                text = body.get("prompt")
                if _ints(text):
                    return Prompt(list(text), "engine-tokenize")
                if not isinstance(text, str):
                    return Prompt(None, None, ["a prompt that is not one string or one list of ids"])
            r = post(client, root + "/tokenize", {"content": text, "add_special": not chat, "parse_special": True})
            r.raise_for_status()
            ids = r.json()["tokens"]
            if not _ints(ids) and ids != []:
                raise ValueError("/tokenize returned no list of ids")
            return Prompt(list(ids), "engine-tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            return Prompt(None, None, [f"the engine did not tokenise the prompt ({type(e).__name__}: {e})"])


class Transformers(Dialect):
    """Hugging Face `transformers serve`: it refuses unknown fields, gives no logprobs, always
    ends a stream with `usage`, and hands its template the messages after its own conversion
    (tool-call arguments parsed from JSON, content dropped where tool calls are, content parts
    joined with spaces, other fields such as `reasoning_content` dropped)."""

    name = "transformers"
    output_source = "re-tokenised text"
    asks_usage = False
    asks_logprobs = False

    def template_messages(self, body: dict) -> tuple[list[dict], list | None, dict]:
        messages, tools, kwargs = as_carried(body)
        kwargs = {**self.template_kwargs, **kwargs}
        out = []
        for m in body.get("messages") or []:
            parsed: dict = {"role": m["role"]}
            if m.get("tool_calls"):
                parsed["tool_calls"] = [_parsed_arguments(c) for c in m["tool_calls"]]
            if "tool_call_id" in m:
                parsed["tool_call_id"] = m["tool_call_id"]
            raw = [] if m.get("tool_calls") else (m.get("content") or [])
            if isinstance(raw, str):
                raw = [{"type": "text", "text": raw}]
            parsed["content"] = " ".join(p["text"] for p in raw if p.get("type") in ("text", "input_text", "output_text"))
            out.append(parsed)
        return out, tools, kwargs


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


def post(client: httpx.Client, url: str, body: dict, timeout: float = 30) -> httpx.Response:
    """POST to one of an engine's pure endpoints (/tokenize, /apply-template), once more on a
    connection the engine had closed (llama.cpp closes idle keep-alive connections)."""
    try:
        return client.post(url, json=body, timeout=timeout)
    except httpx.RemoteProtocolError:
        return client.post(url, json=body, timeout=timeout)


def _ints(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


DIALECTS = {d.name: d for d in (VLLM, SGLang, LlamaCpp, Transformers, Dialect)}


def engine_root(upstream: str) -> str:
    """The engine's root URL: the upstream base without its trailing /v1."""
    base = upstream.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def probe(client: httpx.Client, upstream: str) -> tuple[str, str]:
    """Which dialect the engine speaks, and the evidence: llama.cpp answers `/props` with its
    generation settings; SGLang `/get_model_info`; vLLM `/version`; `transformers serve` lists
    `/load_model` in its OpenAPI paths; a `shadow serve` embedded engine speaks the vLLM dialect.
    Anything else is a generic OpenAI-compatible engine."""
    root = engine_root(upstream)

    def get(path: str):
        try:
            r = client.get(root + path, timeout=5)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    props = get("/props")
    if isinstance(props, dict) and ("default_generation_settings" in props or "build_info" in props):
        return "llamacpp", "/props"
    info = get("/get_model_info")
    if isinstance(info, dict) and "model_path" in info:
        return "sglang", "/get_model_info"
    status = get("/v1/shadow/status")
    if isinstance(status, dict) and "counters" in status:
        return "vllm", "a shadow serve embedded engine (/v1/shadow/status): the vLLM dialect"
    version = get("/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return "vllm", "/version"
    spec = get("/openapi.json")
    if isinstance(spec, dict) and "/load_model" in (spec.get("paths") or {}):
        return "transformers", "/openapi.json (/load_model)"
    return "openai", "no engine-specific endpoint answered"


class EngineChoice:
    """The dialect of the engine behind the proxy: given, or probed once the engine answers (at
    start; again at a request while it has not answered). Says its choice once, in the log."""

    def __init__(self, upstream: str, dialect: Dialect | str | None, renderer: ChatRenderer | None,
                 eos_id: int | None, template_kwargs: dict | None = None, eos_text: str = "<|im_end|>"):
        self.upstream = upstream
        self.renderer, self.eos_id, self.eos_text = renderer, eos_id, eos_text
        self.template_kwargs = template_kwargs
        self.evidence = "given"
        self._lock = threading.Lock()
        self.dialect: Dialect | None = None
        if isinstance(dialect, Dialect):
            self.dialect = dialect
        elif dialect is not None:
            if dialect not in DIALECTS:
                raise ValueError(f"no engine dialect {dialect!r} (dialects: {', '.join(ENGINES)})")
            self.dialect = self._make(dialect)
        if self.dialect is not None:
            self._say()

    def choose(self) -> Dialect:
        """The dialect (probing the engine the first time it answers; a generic one meanwhile)."""
        with self._lock:
            if self.dialect is not None:
                return self.dialect
            with httpx.Client() as client:
                name, evidence = probe(client, self.upstream)
            if name == "openai" and not _answers(self.upstream):
                return self._make("openai")  # not up yet: look again later
            self.dialect, self.evidence = self._make(name), evidence
            self._say()
            return self.dialect

    def _make(self, name: str) -> Dialect:
        return DIALECTS[name](self.renderer, eos_text=self.eos_text, eos_id=self.eos_id,
                              template_kwargs=self.template_kwargs)

    def _say(self) -> None:
        log.warning("%s [%s]", self.dialect.describe(), self.evidence)

    def describe(self) -> dict:
        d = self.dialect
        return {"upstream": self.upstream, "dialect": d.name if d else None, "evidence": self.evidence if d else None,
                "prompt_ids": d.prompt_source if d else None, "output_ids": d.output_source if d else None,
                "template": self.renderer.origin if self.renderer else None}


def _answers(upstream: str) -> bool:
    try:
        httpx.get(upstream.rstrip("/") + "/models", timeout=5)
        return True
    except httpx.HTTPError:
        return False
