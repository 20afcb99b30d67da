"""The shadow beside a real engine: Hugging Face `transformers serve` on loopback, serving a
random-weight Qwen3.5 big-model folder with the real vocabulary and the real Qwen3.5 chat template.

Ground truth for the engine's prompt ids is the engine's own code path, outside the shadow: its
message conversion (`transformers.cli.serving`) and `apply_chat_template` with the folder's
tokenizer and template; and its `usage`. Output ids: greedy `generate` on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from engines import transformers_serve_missing
from serving import assert_exact, running, settled, wait_until_read
from shadow.enginecheck import READ_TOOL, WEATHER_TOOL
from shadow.server.reply import Reply

pytestmark = pytest.mark.skipif(transformers_serve_missing() is not None,
                                reason=transformers_serve_missing() or "")


@pytest.fixture()
def engine(transformers_engine):
    return transformers_engine


@pytest.fixture(scope="module")
def truth(big_model):
    """The engine's prompt ids for a request body, computed with the engine's own code."""
    from transformers import AutoTokenizer
    from transformers.cli.serving.utils import BaseHandler, Modality

    tok = AutoTokenizer.from_pretrained(str(big_model))

    def prompt_ids(body: dict) -> list[int]:
        messages = BaseHandler.get_processor_inputs_from_messages(body["messages"], Modality.LLM)
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"), tokenize=True,
                                      return_dict=True, **body.get("chat_template_kwargs", {}))
        return list(out["input_ids"])

    return prompt_ids


def renderer_of(folder: Path):
    from shadow.chat_template import ChatRenderer, load_hf_tokenizer, read_template

    return ChatRenderer(read_template(folder), load_hf_tokenizer(folder))


def send(client: httpx.Client, session: str, body: dict) -> Reply:
    """One request through the proxy, as a client sends it; the engine's reply gathered."""
    reply = Reply()
    if body.get("stream"):
        with client.stream("POST", "/v1/chat/completions", headers={"x-session-id": session}, json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "token_ids" not in json.dumps(event)  # nothing the proxy added reaches the client
                    reply.read(event, chat=True)
    else:
        r = client.post("/v1/chat/completions", headers={"x-session-id": session}, json=body)
        assert r.status_code == 200, r.text
        reply.read(r.json(), chat=True)
    assert reply.usage is not None
    return reply


def words(seed: int, n: int) -> str:
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(["def", "return", "self", "path", "error", "test", "assert", "value", "None", "x"])
                    for _ in range(n))


def tool_call(k: int, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": "", "reasoning_content": f"I need the tool ({k}).",
            "tool_calls": [{"id": f"call_{k}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}]}


def script() -> dict[str, list[tuple[list[dict], dict]]]:
    """Five sessions of chat turns: (messages the client adds before the request, request fields).
    A turn whose added messages open with an assistant message replaces the engine's last reply
    with it (the client got a tool call); otherwise the engine's reply is added first."""
    tools = {"tools": [WEATHER_TOOL, READ_TOOL]}
    sessions = {
        "plain": [([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}], {})]
        + [([{"role": "user", "content": f"Again, {k}."}], {}) for k in range(5)],
        "reasoning": [([{"role": "user", "content": "Think about 12 * 13."}], {"stream": True})]
        + [([{"role": "user", "content": f"Now {k} more."}], {"stream": True}) for k in range(5)],
        "tools": [
            ([{"role": "user", "content": "Weather in Paris?"}], tools),
            ([tool_call(1, "get_weather", {"city": "Paris"}),
              {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 11}"}], tools | {"stream": True}),
            ([{"role": "user", "content": "And Oslo, in F?"}], tools),
            ([tool_call(2, "get_weather", {"city": "Oslo", "unit": "F"}),
              {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 35}"}], tools | {"stream": True}),
            ([{"role": "user", "content": "Read setup.py."}], tools),
            ([tool_call(3, "read_file", {"path": "setup.py"}),
              {"role": "tool", "tool_call_id": "call_3", "content": words(3, 120)}], tools | {"stream": True}),
        ],
        "parts": [([{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                 {"type": "text", "text": f"Part {k}."}]}],
                   {"chat_template_kwargs": {"enable_thinking": False}, "stream": bool(k % 2)}) for k in range(6)],
        "agent": [([{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix the failing test."}],
                   tools)]
        + [([tool_call(10 + k, "read_file", {"path": f"src/m{k}.py"}),
             {"role": "tool", "tool_call_id": f"call_{10 + k}", "content": words(10 + k, 300)}],
            tools | {"stream": bool(k % 2)}) for k in range(6)],
    }
    return sessions


def test_thirty_one_turns_through_the_proxy_read_the_engines_prompt_ids(engine, big_model, truth, tmp_path):
    """5 sessions, 31 turns (plain, reasoning, tools and tool results, content parts, template
    kwargs; streamed and not) through `shadow serve` in front of `transformers serve`: the dialect
    is found by probing; every turn's prompt ids equal the engine's and its usage count; a turn is
    verified only where its ids are the engine's (none silently wrong); each final state is
    bit-equal to a fresh prefill of its ids, and those ids are the engine's."""
    journal = tmp_path / "journal.jsonl"
    equal, turns = 0, 0
    histories: dict[str, list[dict]] = {}
    last_body: dict[str, dict] = {}
    with running(upstream=engine, journal=journal, renderer=renderer_of(big_model)) as (proxy, service):
        for name, steps in script().items():
            history: list[dict] = []
            previous = None
            for added, fields in steps:
                if previous is not None and added[0]["role"] != "assistant":
                    history.append(previous.message())
                history += added
                body = {"messages": history, "max_tokens": 8, "temperature": 0} | fields
                previous = send(proxy, name, body)
                settled(service)
                turns += 1
                want = truth(body)
                assert previous.usage["prompt_tokens"] == len(want)  # the ground truth is the engine's
                with service.state_lock:
                    got = service.store.get(name).ids[: len(want)]
                equal += got == want
                last_body[name] = body
            histories[name] = history
        status = proxy.get("/v1/shadow/status").json()
        assert status["engine"]["dialect"] == "transformers", status["engine"]
        wait_until_read(service, list(histories))
        for name in histories:
            assert_exact(service, name)
        final_ids = {}
        with service.state_lock:
            for name in histories:
                final_ids[name] = list(service.store.get(name).ids)
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    turn_records = [r for r in records if r.get("kind") == "turn"]
    assert turns >= 30 and len(turn_records) == turns
    assert equal == turns  # every prompt read is the engine's
    assert all(r["prompt_verified"] for r in turn_records)
    assert all(r["verified"] is True for r in turn_records), [r for r in turn_records if not r["verified"]]
    sessions = {r["name"]: r for r in status["sessions"]}
    for name, ids in final_ids.items():
        want = truth(last_body[name])
        assert ids[: len(want)] == want
        assert sessions[name]["id_checks"]["exact"] is True
        if len(ids) > len(want):  # its output was read: the ids the engine generated, greedy on the same weights
            assert ids[len(want):] == generate(big_model, want, len(ids) - len(want))


def generate(folder: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_check_engine_against_transformers_serve(engine, big_model):
    from typer.testing import CliRunner

    from cli.main import app

    r = CliRunner().invoke(app, ["check-engine", engine, "--chat-template", str(big_model), "--max-tokens", "4",
                                 "--long-words", "600", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["dialect"] == "transformers" and doc["summary"]["answered"] == doc["summary"]["requests"] >= 12
    rows = doc["requests"]
    assert all(row["prompt_ids"] == row["usage_prompt"] for row in rows)  # every prompt counted as the engine did
    assert all(row["prompt_source"] == "template" and row["output_source"] == "retokenised" for row in rows)
    assert doc["summary"]["mismatched"] == 0


def test_without_a_template_the_proxy_passes_everything_and_reads_nothing(engine, tmp_path):
    """No chat template: requests still pass through unchanged; the turns are unverified and the
    session is not exact, and asks say why."""
    with running(upstream=engine) as (proxy, service):
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        direct = httpx.post(engine + "/chat/completions", json=body, timeout=120).json()
        r = proxy.post("/v1/chat/completions", headers={"x-session-id": "bare"}, json=body)
        assert r.status_code == 200 and r.json()["usage"] == direct["usage"]
        assert r.json()["choices"][0]["message"] == direct["choices"][0]["message"]  # greedy: the same answer
        settled(service)
        status = proxy.get("/v1/shadow/status").json()
        assert status["engine"]["template"] is None
        assert all(s["name"] != "bare" or s["committed"] + s["pending"] == 0 for s in status["sessions"])
