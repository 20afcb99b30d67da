"""Engine dialects on response bodies of the documented shapes (vLLM, SGLang and llama.cpp cannot
run on these machines; their shapes are those of their 2026 OpenAI servers, docs/SERVE.md), and
the turn checks. Pure: no model, no HTTP."""

from __future__ import annotations

import json

import pytest

from shadow.engines.dialects import DIALECTS, LlamaCpp, SGLang, Transformers, VLLM, Dialect, Prompt, as_carried
from shadow.engines.idcheck import SessionChecks, TurnIds, check_turn
from shadow.engines.reply import Reply

END = 248046


def read_all(events, chat=True) -> Reply:
    reply = Reply()
    for e in events:
        reply.read(e, chat)
    return reply


# vLLM --------------------------------------------------------------------------------------

VLLM_STREAM = [
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                                 "logprobs": None, "finish_reason": None}],
     "prompt_token_ids": [248045, 846, 198]},
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"reasoning": "hm"},
                                                                 "finish_reason": None, "token_ids": [23045]}]},
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                                                 "token_ids": [248069]}]},  # a swallowed control token
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"},
                                                                 "finish_reason": None, "token_ids": [13347]}]},
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": ""},
                                                                 "finish_reason": "stop", "stop_reason": None,
                                                                 "token_ids": [END]}]},
    {"id": "c", "object": "chat.completion.chunk", "choices": [],
     "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
]


def test_vllm_asks_for_ids_and_usage_and_strips_them_again():
    d = VLLM()
    asked = d.ask({"messages": [], "stream": True}, chat=True)
    assert asked.body["return_token_ids"] is True and asked.body["stream_options"] == {"include_usage": True}
    assert asked.added == {"token_ids", "usage"}
    cleaned = [d.clean(e, asked.added, {}) for e in VLLM_STREAM]
    assert cleaned[-1] is None  # the usage chunk the client did not ask for
    assert all("prompt_token_ids" not in json.dumps(c) and "token_ids" not in json.dumps(c) for c in cleaned[:-1])
    assert cleaned[1]["choices"][0]["delta"] == {"reasoning": "hm"}  # the rest as the engine sent it
    # a client that asked for both keeps them: nothing is added, every event passes as it came
    own = d.ask({"messages": [], "stream": True, "return_token_ids": True,
                 "stream_options": {"include_usage": True}}, chat=True)
    assert own.added == frozenset() and all(d.clean(e, own.added, {}) is e for e in VLLM_STREAM)


def test_vllm_stream_gives_the_whole_generated_sequence_in_order():
    reply = read_all(VLLM_STREAM)
    t = VLLM().turn_ids(reply, None, {"messages": []}, chat=True)
    assert t.prompt == [248045, 846, 198] and t.prompt_source == "engine"
    assert t.output == [23045, 248069, 13347, END] and t.output_source == "engine"  # reasoning, control, content, end
    check = check_turn(t)
    assert check.verified is True and "prompt ids" in check.checks and "output count" in check.checks


def test_vllm_non_streamed_chat_and_completions():
    chat = {"object": "chat.completion", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning": None},
                         "finish_reason": "stop", "token_ids": [13347, END]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    t = VLLM().turn_ids(read_all([chat]), None, {}, chat=True)
    assert (t.prompt, t.output) == ([1, 2, 3], [13347, END]) and check_turn(t).verified is True
    completion = {"object": "text_completion", "choices": [
        {"index": 0, "text": " Hi", "finish_reason": "length", "token_ids": [13347], "prompt_token_ids": [9, 8]}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    t = VLLM().turn_ids(read_all([completion], chat=False), None, {}, chat=False)
    assert (t.prompt, t.output) == ([9, 8], [13347]) and check_turn(t).verified is True


def test_a_count_that_differs_from_usage_is_a_mismatch():
    chat = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "message": {"content": "x"}, "token_ids": [5],
                                                        "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}}
    check = check_turn(VLLM().turn_ids(read_all([chat]), None, {}, chat=True))
    assert check.verified is False and check.prompt_verified is False and check.output_verified is True
    assert any("the engine counted 4" in r for r in check.reasons)


# SGLang ------------------------------------------------------------------------------------

def test_sglang_asks_per_request_kind_and_reads_each_shape():
    d = SGLang()
    stream = d.ask({"messages": [], "stream": True}, chat=True)
    assert stream.body.get("return_input_ids_in_sglext") and stream.body.get("return_output_ids_in_sglext")
    assert "return_token_ids" not in stream.body  # refused (400) on streamed chat
    whole = d.ask({"messages": []}, chat=True)
    assert whole.body["return_token_ids"] and whole.body["return_prompt_token_ids"]
    # a non-streamed chat body of 2026 (response_token_ids) and its sglext
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop",
                         "matched_stop": END, "prompt_token_ids": [1, 2, 3], "response_token_ids": [13347, END]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "sglext": {"input_ids": [1, 2, 3], "output_ids": [[13347, END]]}}
    t = d.turn_ids(read_all([body]), None, {}, chat=True)
    assert (t.prompt, t.output, t.output_source) == ([1, 2, 3], [13347, END], "engine")
    cleaned = d.clean(body, whole.added, {})
    assert "response_token_ids" not in cleaned["choices"][0] and "prompt_token_ids" not in cleaned["choices"][0]
    # sglext ids on a body the proxy asked only return_token_ids of: the server's own default
    # (its return_input_ids setting): the client would have had them, so they stay
    assert cleaned["sglext"] == body["sglext"]
    # a streamed chat: text chunks, then one chunk with the ids in sglext, then usage
    chunks = [{"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "sglext": {"input_ids": [1, 2, 3], "output_ids": [[13347, END]]}},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
    t = d.turn_ids(read_all(chunks), Prompt([1, 2, 3], "template"), {}, chat=True)
    assert (t.prompt, t.prompt_source, t.output) == ([1, 2, 3], "engine", [13347, END])
    assert check_turn(t).verified is True
    assert [d.clean(c, stream.added, {}) for c in chunks][2:] == [None, None]


def test_sglang_takes_off_only_the_ids_the_proxy_asked_for():
    """A client that asked for one ids flag keeps what it asked for when the proxy adds the other;
    sglext fields the client had anyway (cached tokens, routed experts) stay, and the sglext chunk
    goes only when nothing of it was the client's."""
    d = SGLang()
    client = {"messages": [], "return_prompt_token_ids": True}
    asked = d.ask(client, chat=True)
    assert asked.body["return_token_ids"] and "flag:return_prompt_token_ids" not in asked.added
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop",
                         "prompt_token_ids": [1, 2, 3], "response_token_ids": [13347, END], "meta_info": {"id": "x"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    choice = d.clean(body, asked.added, client)["choices"][0]
    assert choice["prompt_token_ids"] == [1, 2, 3] and "response_token_ids" not in choice
    assert choice["meta_info"] == {"id": "x"}  # never asked by the proxy (return_meta_info): the client's
    stream_client = {"messages": [], "stream": True}
    stream = d.ask(stream_client, chat=True)
    ids_and_more = {"id": "c", "object": "chat.completion.chunk", "choices": [],
                    "sglext": {"input_ids": [1, 2, 3], "output_ids": [[13347, END]],
                               "cached_tokens_details": {"device": 2}}}
    assert d.clean(ids_and_more, stream.added, stream_client) == {
        "id": "c", "object": "chat.completion.chunk", "choices": [], "sglext": {"cached_tokens_details": {"device": 2}}}
    only_ids = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": None,
                "sglext": {"input_ids": [1, 2, 3], "output_ids": [[13347, END]]}}
    assert d.clean(only_ids, stream.added, stream_client) is None
    own = {"messages": [], "stream": True, "return_output_ids_in_sglext": True}
    mine = d.ask(own, chat=True)
    assert d.clean(only_ids, mine.added, own)["sglext"] == {"output_ids": [[13347, END]]}


def test_llama_cpp_usage_chunk_goes_with_its_timings_when_the_proxy_asked_for_it():
    d = LlamaCpp()
    asked = d.ask({"messages": [], "stream": True}, chat=True)
    last = {"choices": [], "created": 1, "id": "c", "model": "m", "system_fingerprint": "b1", "object": "chat.completion.chunk",
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}, "timings": {"prompt_n": 3}}
    assert d.clean(last, asked.added, {"stream": True}) is None  # no choice-less chunk the client never asked for


def test_sglang_streamed_chat_without_sglext_falls_back_to_the_template_for_the_turn():
    chunks = [{"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}]
    t = SGLang().turn_ids(read_all(chunks), Prompt([1, 2, 3], "template"), {}, chat=True)
    assert t.prompt_source == "template" and check_turn(t).prompt_verified is True


# llama.cpp ---------------------------------------------------------------------------------

def test_llamacpp_output_ids_are_the_ids_beside_the_logprobs():
    d = LlamaCpp(eos_id=END)
    asked = d.ask({"messages": [], "stream": False}, chat=True)
    assert asked.body["logprobs"] is True and "logprobs" in asked.added
    assert asked.body["top_logprobs"] == 1  # one alternative a token, not the engine's default 20
    assert asked.body["post_sampling_probs"] is True  # the same ids, no pass over the vocabulary a token
    assert "post_sampling_probs" not in d.ask({"messages": [], "logprobs": True}, chat=True).body  # the client's own
    assert d.ask({"messages": [], "post_sampling_probs": False}, chat=True).body["post_sampling_probs"] is False
    assert d.ask({"messages": [], "top_logprobs": 3}, chat=True).body["top_logprobs"] == 3  # the client's stays
    assert "top_logprobs" not in d.ask({"prompt": "x"}, chat=False).body  # completions: logprobs is the count
    body = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"},
                         "logprobs": {"content": [{"id": 13347, "token": "Hi", "bytes": [72, 105], "logprob": -0.01,
                                                   "top_logprobs": []}]}}],
            "usage": {"completion_tokens": 2, "prompt_tokens": 3, "total_tokens": 5},
            "timings": {"cache_n": 0, "prompt_n": 3, "predicted_n": 2}}
    t = d.turn_ids(read_all([body]), Prompt([1, 2, 3], "engine-tokenize"), {}, chat=True)
    assert t.output == [13347, END] and "end token appended" in t.notes  # llama.cpp shows no logprob for the end
    assert check_turn(t).verified is True
    assert d.clean(body, asked.added, {})["choices"][0]["logprobs"] is None


# the generic and transformers dialects --------------------------------------------------

@pytest.mark.slow
def test_openai_dialect_maps_logprob_bytes_to_ids_with_the_big_models_tokenizer(tokenizer):
    from shadow.text.chat_template import ChatRenderer, Template, default_hf_tokenizer

    d = Dialect(ChatRenderer(Template("{{ messages[0].content }}", "t"), default_hf_tokenizer()), eos_id=END)
    ids = tokenizer.encode(" Hello world, grüße 日本")
    tokens = [(tokenizer.decode([i]), list(d.renderer.tokenizer.decode([i]).encode())) for i in ids]
    body = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": tokenizer.decode(ids)},
                         "logprobs": {"content": [{"token": t, "bytes": b, "logprob": -1.0} for t, b in tokens]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(ids) + 1}}
    t = d.turn_ids(read_all([body]), Prompt([5], "template"), {}, chat=True)
    assert t.output_source == "logprobs" and t.output == ids + [END]
    assert check_turn(t).verified is True


def test_transformers_dialect_hands_the_template_what_transformers_serve_does():
    body = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "kept?", "reasoning_content": "dropped",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "r"}], "chat_template_kwargs": {"enable_thinking": False}}
    messages, tools, kwargs = Transformers(template_kwargs={"enable_thinking": True, "y": 1}).template_messages(body)
    assert messages[0] == {"role": "user", "content": "a b"}  # parts joined with a space
    assert messages[1] == {"role": "assistant", "content": "",
                           "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert messages[2] == {"role": "tool", "tool_call_id": "1", "content": "r"}
    assert kwargs == {"enable_thinking": False, "y": 1}  # the request's kwargs win over the engine's defaults
    carried, _, _ = as_carried(body)
    assert carried[1]["reasoning_content"] == "dropped" and carried[0]["content"] == body["messages"][0]["content"]


# the ends of a streamed chat from transformers serve 5.24 (usage always, on the last choice chunk)
# and from 5.25 (usage only with stream_options.include_usage, in a chunk of its own)
TRANSFORMERS_524_END = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
TRANSFORMERS_525_END = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                        {"object": "chat.completion.chunk", "choices": [],
                         "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}]


def test_transformers_dialect_asks_for_a_streams_usage_and_gives_the_client_what_its_engine_would_have():
    d = Transformers()
    asked = d.ask({"messages": [], "stream": True}, chat=True)
    assert asked.body["stream_options"] == {"include_usage": True} and asked.added == {"usage"}
    assert "logprobs" not in asked.body  # no field outside what the engine accepts
    for events in ([TRANSFORMERS_524_END], TRANSFORMERS_525_END):
        assert read_all(events).usage_count("prompt_tokens") == 9  # the proxy counts the prompt either way
    assert d.clean(TRANSFORMERS_524_END, asked.added, {}) == TRANSFORMERS_524_END  # 5.24 sent it unasked: kept
    assert d.clean(TRANSFORMERS_525_END[0], asked.added, {}) == TRANSFORMERS_525_END[0]
    assert d.clean(TRANSFORMERS_525_END[1], asked.added, {}) is None  # asked by the proxy only: dropped
    assert d.ask({"messages": []}, chat=True).added == frozenset()  # not streamed: usage comes anyway


def test_every_dialect_strips_nothing_when_it_added_nothing():
    event = {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None}], "usage": {"prompt_tokens": 1}}
    for cls in DIALECTS.values():
        assert cls().clean(event, frozenset(), {}) is event


@pytest.mark.parametrize("bad", ["not json", 7, {"choices": "x"}, {"choices": ["x"]}, {"choices": [{"token_ids": ["a"]}]},
                                 {"usage": "x", "prompt_token_ids": [1, "2"]}])
def test_malformed_events_are_counted_never_raised(bad):
    reply = read_all([bad])
    assert reply.prompt_ids is None and reply.output_ids == []
    assert reply.malformed >= (0 if isinstance(bad, dict) and "usage" in bad else 1)


# the session's record ---------------------------------------------------------------------

def test_a_session_is_exact_while_every_id_it_holds_is_verified():
    c = SessionChecks()
    good = check_turn(TurnIds([1, 2, 3], "engine", [4], "engine", prompt_tokens=3, completion_tokens=1))
    c.replaced(0)
    c.add(1, good, 3, 1)
    assert c.exact(4)
    c.replaced(4)  # the next prompt extends it
    assert not c.exact(9)  # the new ids are not checked yet: not exact while the turn runs
    bad = check_turn(TurnIds([1, 2, 3, 4, 5, 6, 7, 8], "template", [9], "retokenised", prompt_tokens=7,
                             completion_tokens=1))
    assert c.add(2, bad, 8, 1) is True  # the first mismatch: log it
    assert not c.exact(9) and "not verified" in c.why_not(9) and c.mismatched == 1
    c.replaced(4)
    assert c.add(3, good, 10, 0) is False  # logged once
    assert c.exact(10)  # a verified prompt covers the session again
