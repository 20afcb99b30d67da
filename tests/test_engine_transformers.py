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

from engines import transformers_serve_missing
from serving import assert_exact, running, settled, wait_until_read
from shadow.engines.enginecheck import play_sessions, session_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(transformers_serve_missing() is not None,
                                                   reason=transformers_serve_missing() or "")]


def _usage_only_when_asked() -> bool:
    """Whether this transformers sends a stream's `usage` only on `stream_options.include_usage`
    (5.25 on); before, every stream ended with it."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.25.0")


USAGE_ONLY_WHEN_ASKED = _usage_only_when_asked()


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
    from shadow.text.chat_template import ChatRenderer, load_hf_tokenizer, read_template

    return ChatRenderer(read_template(folder), load_hf_tokenizer(folder))


def test_thirty_one_turns_through_the_proxy_read_the_engines_prompt_ids(engine, big_model, truth, tmp_path):
    """5 sessions, 31 turns (plain, reasoning, tools and tool results, content parts, template
    kwargs; streamed and not) through `shadow serve` in front of `transformers serve`: the dialect
    is found by probing; every turn's prompt ids equal the engine's and its usage count; no output
    is read (the engine shows text only, and text is never re-tokenised into ids: the next prompt
    brings each reply as the engine reads it), so no turn is counted verified, and no id is
    silently wrong; each final state is bit-equal to a fresh prefill of its ids, which are
    exactly the engine's last prompt."""
    journal = tmp_path / "journal.jsonl"
    equal, turns = 0, 0
    last_body: dict[str, dict] = {}
    with running(upstream=engine, journal=journal, renderer=renderer_of(big_model),
                 predict=False) as (proxy, service):  # each reply as the engine wrote it: not read (no ids shown)
        for name, body, reply, status_code in play_sessions(proxy, session_script()):
            assert status_code == 200 and reply.malformed == 0
            # the client did not ask for a stream's usage: from 5.25 the engine sends it only when asked,
            # and the proxy, which asked for it, takes it out again; before, the engine always sent it
            assert (reply.usage is None) == (bool(body.get("stream")) and USAGE_ONLY_WHEN_ASKED)
            settled(service)
            turns += 1
            want = truth(body)
            assert reply.usage is None or reply.usage["prompt_tokens"] == len(want)  # the truth is the engine's
            with service.state_lock:
                got = service.store.get(name).ids[: len(want)]
            equal += got == want
            last_body[name] = body
        histories = last_body
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
    assert all(r["prompt_check"] == "verified" and r["prompt_verified"] for r in turn_records)
    assert all(r["output_check"] == "not_read" and r["ids_source"]["output"] is None for r in turn_records)
    assert all(r["verified"] is None for r in turn_records)  # a turn whose output is not read is not verified
    parts = status["counters"]["turn_parts"]
    assert parts["prompt"]["verified"] == turns and parts["output"]["not_read"] == turns
    sessions = {r["name"]: r for r in status["sessions"]}
    for name, ids in final_ids.items():
        assert ids == truth(last_body[name])  # the engine's last prompt, and nothing of a reply read from text
        checks = sessions[name]["id_checks"]
        assert checks["exact"] is True and checks["turns_verified"] == 0
        assert checks["outputs"]["not_read"] == checks["prompts"]["verified"] == len(session_script()[name])


def test_the_next_prompt_predicted_through_the_proxy_is_the_engines(engine, big_model, truth, tmp_path):
    """The same 31 turns with the next prompt predicted (the default): each reply, re-rendered by
    the template, is read before the next prompt comes, and that prompt (the engine's own ids)
    confirms it; every state stays bit-equal to a fresh prefill of its ids."""
    journal = tmp_path / "journal.jsonl"
    turns, sessions = 0, set()
    with running(upstream=engine, journal=journal, renderer=renderer_of(big_model)) as (proxy, service):
        for name, body, reply, status_code in play_sessions(proxy, session_script()):
            assert status_code == 200 and reply.malformed == 0
            settled(service)
            turns += 1
            sessions.add(name)
        wait_until_read(service, list(sessions))
        for name in sessions:
            assert_exact(service, name)
        status = proxy.get("/v1/shadow/status").json()
    counts = status["counters"]["predictions"]
    assert counts["made"] + counts["skipped"] == turns and counts["made"] > 0
    assert counts["confirmed"] + counts["missed"] == counts["made"] - len(sessions)  # each last one is unchecked
    assert counts["confirmed"] >= counts["missed"]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert all(r["prompt_check"] == "verified" for r in records if r.get("kind") == "turn")


def test_check_engine_against_transformers_serve(engine, big_model):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    r = CliRunner().invoke(app, ["check-engine", engine, "--chat-template", str(big_model), "--max-tokens", "4",
                                 "--long-words", "600", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["dialect"] == "transformers" and doc["summary"]["answered"] == doc["summary"]["requests"] >= 12
    rows, summary = doc["requests"], doc["summary"]
    assert all(row["prompt_ids"] == row["usage_prompt"] for row in rows)  # every prompt counted as the engine did
    assert all(row["prompt_source"] == "template" and row["output_source"] is None for row in rows)
    n = summary["answered"]
    assert summary["prompts"] == {"verified": n, "unverified": 0, "mismatched": 0, "not_read": 0}
    assert summary["outputs"] == {"verified": 0, "unverified": 0, "mismatched": 0, "not_read": n}
    assert summary["mismatched"] == 0 and summary["verified"] == 0  # no output read: no request counted verified
    assert f"0 of {n} requests verified (prompt and output)" in r.output and f"{n} not read" in r.output


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
