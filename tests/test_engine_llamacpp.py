"""The shadow beside a real llama.cpp `llama-server` (built from llama-cpp-python 0.3.36's vendored
sources, `experiments/build_llama_server.sh`) serving a random-weight GGUF with the real Qwen3.5
vocabulary and chat template. Skipped where the binary is not built.

Ground truth for the engine's ids: its own `/apply-template` and `/tokenize`, and `usage`
(llama.cpp counts every prompt id, cached or not); its output ids: the `id` beside each logprob of
a whole response (helper tests in tests/test_llama_server.py establish both)."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import shared_file
from llama_server import llama_server, require_binary
from serving import assert_exact, running, settled, wait_until_read
from shadow.engines.enginecheck import play_sessions, session_script

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    require_binary()
    from shadow.engines.gguf import write_gguf

    template = shared_file("templates", "qwen3.5.jinja")
    gguf = write_gguf(tmp_path_factory.mktemp("gguf") / "qwen35-random.gguf", template.read_text())
    with llama_server(gguf) as url:
        yield url


def engine_prompt(url: str, body: dict) -> list[int]:
    """The prompt ids llama-server reads for a chat body: its own template, then its tokenizer."""
    query = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    text = httpx.post(url + "/apply-template", json=query, timeout=60).json()["prompt"]
    return httpx.post(url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"]


def test_thirty_one_turns_through_the_proxy_read_llama_servers_ids(engine, tmp_path):
    """5 sessions, 31 turns (plain, reasoning, tools and tool results, content parts, template
    kwargs; streamed and not) through `shadow serve` in front of `llama-server`: the dialect is
    found by probing; every prompt is the engine's; outputs are read where their ids are the
    engine's (the ids beside its logprobs) and its count, never otherwise (never from text); a
    turn is verified exactly when its output was read and verified; each final state is bit-equal
    to a fresh prefill."""
    journal = tmp_path / "journal.jsonl"
    turns, equal = 0, 0
    last_body: dict[str, dict] = {}
    with running(upstream=engine + "/v1", journal=journal) as (proxy, service):
        for name, body, reply, status_code in play_sessions(proxy, session_script()):
            assert status_code == 200, (name, status_code)
            assert (reply.usage is None) == bool(body.get("stream"))  # usage only where the client asked (not streamed)
            settled(service)
            turns += 1
            want = engine_prompt(engine, body)
            assert reply.usage is None or reply.usage["prompt_tokens"] == len(want)
            with service.state_lock:
                got = service.store.get(name).ids[: len(want)]
            equal += got == want
            last_body[name] = body
        status = proxy.get("/v1/shadow/status").json()
        wait_until_read(service, list(last_body))
        for name in last_body:
            assert_exact(service, name)
    assert status["engine"]["dialect"] == "llamacpp", status["engine"]
    records = [r for r in map(json.loads, journal.read_text().splitlines()) if r.get("kind") == "turn"]
    assert turns >= 30 and len(records) == turns and equal == turns
    assert all(r["prompt_check"] == "verified" and r["ids_source"]["prompt"] == "engine-tokenize" for r in records)
    assert all(r["output_check"] in ("verified", "not_read") for r in records), records
    assert all((r["verified"] is True) == (r["output_check"] == "verified") for r in records)
    assert all(r["ids_source"]["output"] in ("logprobs", None) for r in records)  # never re-tokenised text
    whole = [r for r in records if r["output_check"] == "verified"]
    assert whole, records  # whole responses: their output ids are the engine's, end token and all
    parts = status["counters"]["turn_parts"]
    assert parts["output"]["verified"] + parts["output"]["not_read"] == turns
    sessions = {s["name"]: s for s in status["sessions"]}
    assert all(sessions[n]["id_checks"]["exact"] for n in last_body)


def test_check_engine_against_llama_server(engine):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    r = CliRunner().invoke(app, ["check-engine", engine + "/v1", "--max-tokens", "4", "--long-words", "600", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["dialect"] == "llamacpp" and doc["summary"]["mismatched"] == 0
    summary, rows = doc["summary"], doc["requests"]
    assert summary["prompts"]["verified"] == summary["answered"]
    assert summary["outputs"]["verified"] + summary["outputs"]["not_read"] == summary["answered"]
    assert summary["verified"] == summary["outputs"]["verified"]  # a request is verified only with its output
    assert all(row["prompt_source"] == "engine-tokenize" and row["prompt_ids"] == row["usage_prompt"] for row in rows)
    assert any(row["output_ids"] == row["usage_completion"] for row in rows if not row["streamed"])
