"""The dialects of the engines that show their ids (vLLM, SGLang, llama.cpp) or hand their template
other messages than the request carries (`transformers serve`)."""

from __future__ import annotations

import httpx

from shadow.engines.dialects.base import Asked, Dialect, Prompt, _ints, _parsed_arguments, as_carried, post
from shadow.engines.idcheck import TurnIds
from shadow.engines.reply import Reply


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


# which request flags make SGLang (2026 releases) send each ids field, in a choice or the event,
# and in `sglext`
_CHOICE_FLAGS = {"prompt_token_ids": ("return_prompt_token_ids", "return_token_ids"),
                 "token_ids": ("return_token_ids",), "response_token_ids": ("return_token_ids",)}
_SGLEXT_FLAGS = {"input_ids": ("return_input_ids_in_sglext",), "output_ids": ("return_output_ids_in_sglext",)}


class SGLang(VLLM):
    """SGLang: non-streamed chat and completions return ids when asked (`return_token_ids`,
    `return_prompt_token_ids`); a streamed chat request refuses those (400), so it asks for the
    `sglext` ids instead (`return_input_ids_in_sglext`, `return_output_ids_in_sglext`: one
    chunk after the last choice chunk, in 2026 releases; older ones ignore unknown fields), and
    the turn falls back to the template and logprobs where they do not come."""

    name = "sglang"
    prompt_source = "engine (ids fields, or sglext on streamed chat), else template"
    output_source = "engine, else logprobs (else not read)"
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
        tags = {"token_ids", *(f"flag:{k}" for k in extra)} if extra else set()
        return Asked(asked.body | extra, asked.added | tags)

    def _strip(self, out: dict, added: frozenset[str], client_asked: dict) -> bool:
        removed = Dialect._strip(self, out, added - {"token_ids"}, client_asked)
        if "token_ids" not in added:
            return removed
        if self._proxys("prompt_token_ids", added, client_asked):
            removed |= out.pop("prompt_token_ids", None) is not None
        ext = out.get("sglext")
        if isinstance(ext, dict):  # only the ids the proxy asked for; the rest (cached tokens, experts) stays
            kept = {k: v for k, v in ext.items() if not (k in _SGLEXT_FLAGS and self._proxys(k, added, client_asked))}
            if kept != ext:
                removed = True
                if kept:
                    out["sglext"] = kept
                else:
                    out.pop("sglext")
        return removed

    def _clean_choice(self, choice, added: frozenset[str], client_asked: dict):
        c = Dialect._clean_choice(self, choice, added - {"token_ids"}, client_asked)
        if "token_ids" in added and isinstance(c, dict):
            for key in _CHOICE_FLAGS:
                if self._proxys(key, added, client_asked):
                    c.pop(key, None)
        return c

    @staticmethod
    def _proxys(field: str, added: frozenset[str], client_asked: dict) -> bool:
        """Whether `field` came only of a flag the proxy added: one of the flags that make SGLang
        send it was the proxy's, and the client asked for none of them."""
        flags = _CHOICE_FLAGS.get(field, ()) + _SGLEXT_FLAGS.get(field, ())
        return any(f"flag:{f}" in added for f in flags) and not any(client_asked.get(f) for f in flags)

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
    when its count is the engine's (else not read: the next prompt brings it). Where the proxy asks
    for the logprobs itself it asks for them after sampling (`post_sampling_probs`): the same ids,
    without a pass over the whole vocabulary for every token of every slot."""

    name = "llamacpp"
    prompt_source = "engine-tokenize (/apply-template, /tokenize)"
    output_source = "the ids beside logprobs (else not read)"

    def ask(self, body: dict, chat: bool) -> Asked:
        sent, added = dict(body), set()
        if body.get("stream"):
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            if not options.get("include_usage"):
                sent["stream_options"] = {**options, "include_usage": True}
                added.add("usage")
        if not body.get("logprobs") and not (body.get("stream") and body.get("tools")):
            sent["logprobs"] = True if chat else 1  # (refused with tools on a stream: no output ids then)
            if chat and "top_logprobs" not in body:
                sent["top_logprobs"] = 1  # the ids sit beside the logprobs; the engine's default is 20 alternatives
            if "post_sampling_probs" not in body:
                # the same ids, each token's probability taken from the sampler's own candidates instead of
                # a softmax over the whole vocabulary a token (host time on every slot; the values are stripped)
                sent["post_sampling_probs"] = True
            added.add("logprobs")
        return Asked(sent, frozenset(added))

    def prompt(self, client: httpx.Client, root: str, body: dict, chat: bool) -> Prompt:
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
            # as the engine tokenises a prompt: special tokens added (its chat template's output has
            # the BOS token taken off first, for a vocabulary that adds one), special text parsed; a
            # router of several models (`--models-dir`) sends /tokenize to the one the body names
            query = {"content": text, "add_special": True, "parse_special": True}
            if isinstance(body.get("model"), str):
                query["model"] = body["model"]
            r = post(client, root + "/tokenize", query)
            r.raise_for_status()
            ids = r.json()["tokens"]
            if not _ints(ids) and ids != []:
                raise ValueError("/tokenize returned no list of ids")
            return Prompt(list(ids), "engine-tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            return Prompt(None, None, [f"the engine did not tokenise the prompt ({type(e).__name__}: {e})"])


class Transformers(Dialect):
    """Hugging Face `transformers serve`: it refuses fields outside OpenAI's schema, gives no
    logprobs (so its outputs are not read: text is never re-tokenised into ids), and hands its
    template the messages after its own conversion (tool-call arguments parsed from JSON,
    content dropped where tool calls are, content parts joined with spaces, other fields such as
    `reasoning_content` dropped). A stream's `usage` is asked for with OpenAI's
    `stream_options.include_usage`: up to 5.24 the engine ignores that field and puts `usage` on
    its last choice chunk anyway; from 5.25 it sends `usage` only when asked, in a chunk of its own."""

    name = "transformers"
    output_source = "none shown: not read (the next prompt brings the reply)"
    asks_logprobs = False

    def clean(self, event: dict, added: frozenset[str], client_asked: dict) -> dict | None:
        """As the generic dialect, except that `usage` on a chunk with choices stays: an engine
        before 5.25 sent it there whether asked or not, so the client had it without the proxy."""
        if "usage" in added and event.get("choices"):
            added = added - {"usage"}
        return super().clean(event, added, client_asked)

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
