"""`shadow serve` on loopback: a real uvicorn server, real HTTP clients (httpx), the real store."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from serving import (GRID, answers, assert_exact, free_port, long_text, running, service_for, serving, settings_for,
                     settled, wait_until_read)
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore, check_folder
from shadow.server.host import Shadow
from shadow.server.http.app import ShadowApp
from shadow.server.service import ShadowService
from shadow.server.settings import StoreSettings
from shadow.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out


@pytest.fixture()
def server(tiny):
    with running() as pair:
        yield pair


@pytest.fixture()
def proxied(tiny):
    """(client of the proxy, the proxy's service, client of the engine)."""
    with running() as (engine, _), running(upstream=str(engine.base_url).rstrip("/") + "/v1") as (proxy, service):
        yield proxy, service, engine


def stream_chat(client: httpx.Client, session: str, messages: list[dict], max_tokens: int = 8) -> tuple[list[dict], str]:
    chunks = []
    with client.stream("POST", "/v1/chat/completions", headers={"x-session-id": session},
                       json={"messages": messages, "max_tokens": max_tokens, "stream": True,
                             "return_token_ids": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0].get("delta", {}).get("content", "") for c in chunks)
    return chunks, text


def test_an_ask_about_a_session_whose_first_turn_is_under_way_waits_for_it(server):
    """A request names a new session; while its prompt cannot be read (the device held), an ask about
    it waits, where it was refused as unknown; past its timeout_s it is unavailable (503), and once
    the turn is read it is answered. A session no request named stays unknown (400) at once."""
    client, service = server
    ask = {"question": "A or B?", "choices": ["A", "B"]}
    with ThreadPoolExecutor(2) as pool:
        with service.device.hold():  # the turn's prompt waits for the device
            turn = pool.submit(stream_chat, client, "first", [{"role": "user", "content": long_text(7)}])
            deadline = time.monotonic() + 30
            while not any(t.requested == "first" for t in service.turns) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not service.known("first")
            late = client.post("/v1/shadow/ask", json={"session": "first", **ask, "timeout_s": 0.3})
            assert late.status_code == 503 and "first turn under way" in late.text
            started = time.monotonic()
            unknown = client.post("/v1/shadow/ask", json={"session": "nobody", **ask, "timeout_s": 5})
            assert unknown.status_code == 400 and "unknown session" in unknown.text
            assert time.monotonic() - started < 2  # refused at once, not after its timeout
            asked = pool.submit(client.post, "/v1/shadow/ask", json={"session": "first", **ask, "timeout_s": 60})
            time.sleep(0.2)
            assert not asked.done()  # waiting for the turn
        turn.result(timeout=120)
        answer = asked.result(timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["insertion"] > 0  # the turn's prompt was read before the answer


def test_an_embedded_stream_ends_with_its_usage_when_asked_as_openai_does(server):
    client, _ = server
    for chat in (True, False):
        path, prompt = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}) if chat else \
            ("/v1/completions", {"prompt": "hello"})
        for asked in (True, False):
            body = {**prompt, "max_tokens": 5, "stream": True, "ignore_eos": True, "return_token_ids": True}
            if asked:
                body["stream_options"] = {"include_usage": True}
            with client.stream("POST", path, headers={"x-session-id": f"u-{chat}-{asked}"}, json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            with_usage = [c for c in chunks if "usage" in c]
            if not asked:
                assert with_usage == []
                continue
            assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []  # the last, alone
            generated = sum(len(c["choices"][0]["token_ids"]) for c in chunks[:-1])
            prompt_n = len(chunks[0]["prompt_token_ids"])
            assert generated == 5
            assert chunks[-1]["usage"] == {"prompt_tokens": prompt_n, "completion_tokens": 5,
                                           "total_tokens": prompt_n + 5}


def test_two_streamed_turns_are_read_exactly_and_asked(server):
    client, service = server
    messages = [{"role": "user", "content": long_text(1)}]
    chunks, text = stream_chat(client, "s1", messages)
    assert chunks[0]["prompt_token_ids"] and all(len(c["choices"][0]["token_ids"]) <= 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": long_text(2)}]
    stream_chat(client, "s1", messages)
    wait_until_read(service, ["s1"])
    status = client.get("/v1/shadow/status").json()
    row = next(r for r in status["sessions"] if r["name"] == "s1")
    assert row["committed"] > 0 and row["pending"] < GRID and status["counters"]["requests"] == 2
    answer = client.post("/v1/shadow/ask", json={"session": "s1", "question": "Which word came most? A, B or C.",
                                                  "choices": ["A", "B", "C"]}).json()
    assert abs(sum(answer["probs"]) - 1) < 1e-5 and answer["label"] in "ABC" and answer["weights"] == "random"
    assert answer["behind"] < GRID and answer["latency_ms"] > 0
    assert 0 <= answer["device_wait_ms"] <= answer["latency_ms"]
    parts = answer["parts_ms"]  # the latency split whole, each part rounded on its own
    assert list(parts) == ["device_wait", "in_flight", "restore", "read", "forward", "back"]
    assert min(parts.values()) >= 0
    assert abs(sum(parts.values()) - answer["latency_ms"]) < 0.01 and parts["device_wait"] == answer["device_wait_ms"]
    assert parts["forward"] > 0
    assert answer["brought_back"] is None  # resident: nothing brought back for it
    assert_exact(service, "s1")
    status = client.get("/v1/shadow/status").json()
    assert status["last_answers"][-1]["label"] == answer["label"]
    jobs = status["device_jobs"]  # the device thread's jobs by kind: the turns fed, the ask, its settle
    assert jobs["turn"]["count"] >= 2 and jobs["ask"]["count"] >= 1 and jobs["ask"]["max_ms"] >= parts["forward"]

    # an ask that comes while the device runs another job says what it waited behind, and how long
    held_s = 0.3
    with ThreadPoolExecutor(1) as pool, service.device.hold():
        asked = pool.submit(client.post, "/v1/shadow/ask", json={"session": "s1", "question": "A or B?",
                                                                 "choices": ["A", "B"]})
        deadline = time.monotonic() + 30
        while not service.device.queued() and time.monotonic() < deadline:  # the ask waits on the device
            time.sleep(0.01)
        time.sleep(held_s)
    waited = asked.result().json()
    assert waited["device_busy_with"] == "hold" and waited["device_wait_ms"] >= held_s * 1000
    assert waited["latency_ms"] >= waited["device_wait_ms"] == waited["parts_ms"]["device_wait"]


def test_non_streamed_chat_and_completions_return_token_ids(server):
    client, _ = server
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                  "return_token_ids": True})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert body["prompt_token_ids"][0] == 248045  # <|im_start|>
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200 and "prompt_token_ids" not in r.json()  # ids only when asked, as vLLM
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


BAD = [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", {"messages": []}, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "needs a role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 248320], "max_tokens": 2}, "outside the vocabulary"),
    ("/v1/shadow/ask", {"session": "nobody", "question": "q", "choices": ["A"]}, "unknown session"),
    ("/v1/shadow/ask", {"session": "s1", "question": "q", "choices": []}, "choices: List should have at least 1"),
    ("/v1/shadow/ask", {"session": "s1", "question": "q", "choices": [chr(65 + i) for i in range(26)] + ["AB"]},
     "at most 26"),
    ("/v1/shadow/ask", {"session": "s1", "question": "q", "choices": ["A long choice"]}, "not a single token"),
    ("/v1/shadow/ask", {"session": "s1", "question_ids": [5] * 9000, "choices": ["A"]}, "1 to 8,192 tokens"),
    ("/v1/shadow/ask", {"session": "s1", "question_ids": [5, 999999], "choices": ["A"]}, "outside the vocabulary"),
    ("/v1/shadow/ask", b'{"session": "s1", "question": "q", "choices": ["A"], "timeout_s": NaN}', "timeout_s"),
    ("/v1/shadow/ask", {"session": "s1", "question": "q", "choices": ["A", "A"]}, "choices repeat"),
    ("/v1/shadow/ask", {"session": "s1", "question": "q", "choices": ["A"], "timeout_s": True}, "timeout_s"),
    ("/v1/shadow/summarize", {"session": "s1", "max_tokens": 513}, "at most 512"),
    ("/v1/shadow/switch", {"on": "yes"}, "on: Input should be a valid boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "parts must carry text"),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nests"),
    ("/v1/completions", {"prompt": [True, False], "max_tokens": 2}, "'prompt' must be"),
]


def test_bad_requests_get_4xx_json_and_change_nothing(server):
    client, service = server
    stream_chat(client, "s1", [{"role": "user", "content": long_text(3, 100)}])
    wait_until_read(service, ["s1"])
    before = client.get("/v1/shadow/status").json()
    for path, body, message in BAD:
        r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
        assert r.status_code == 400, (path, str(body)[:200], r.text[:300])
        assert message in r.json()["error"]["message"], (message, r.text[:300])
    for header in ("a\x01b", "x" * 200, "a~b", ""):  # control characters, too long, a branch's mark, empty
        r = client.post("/v1/chat/completions", headers={"x-session-id": header},
                        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert r.status_code == 400 and "session id" in r.json()["error"]["message"]
        assert not header or header not in r.text  # never echoed back
    for path, method in (("/v1/nothing", "GET"), ("/v1/shadow/ask", "GET")):
        r = client.request(method, path)
        assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type"}
    after = client.get("/v1/shadow/status").json()
    assert after["sessions"] == before["sessions"] and after["counters"] == before["counters"]


@pytest.mark.parametrize("mode", ["embedded", "proxy"])
def test_eight_concurrent_clients_of_five_turns_all_exact(mode, tiny):
    with running() as (engine, engine_service):
        if mode == "embedded":
            _eight_clients(engine, engine_service)
        else:
            with running(upstream=str(engine.base_url).rstrip("/") + "/v1") as (proxy, service):
                _eight_clients(proxy, service)


def _eight_clients(client: httpx.Client, service: ShadowService) -> None:

    def user(k: int) -> None:
        messages = []
        for turn in range(5):
            messages.append({"role": "user", "content": long_text(100 * k + turn, 60)})
            if turn % 2:
                _, text = stream_chat(client, f"c{k}", messages, max_tokens=6)
            else:
                r = client.post("/v1/chat/completions", headers={"x-session-id": f"c{k}"},
                                json={"messages": messages, "max_tokens": 6})
                assert r.status_code == 200, r.text
                text = r.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": text})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(user, range(8)))
    names = [f"c{k}" for k in range(8)]
    wait_until_read(service, names)
    for name in names:
        assert_exact(service, name)
    counters = client.get("/v1/shadow/status").json()["counters"]
    assert counters["requests"] == 40 and counters["chunks_idle"] + counters["chunks_share"] > 0


def test_sigterm_writes_resident_sessions_to_disk(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from shadow.cli.main import main; main()", "serve", "--port", str(port),
         "--grid", str(GRID), "--disk", str(tmp_path)],
        env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                httpx.get(base + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        for name in ("a", "b"):
            r = httpx.post(base + "/v1/chat/completions", headers={"x-session-id": name}, timeout=60,
                           json={"messages": [{"role": "user", "content": long_text(7, 200)}], "max_tokens": 4})
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a planned stop that wrote every session is a success
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = check_folder(tmp_path)
    assert sorted(r.session for r in rows) == ["a", "b"] and all(r.valid for r in rows)


def test_proxy_streams_unchanged_and_its_shadow_reads_exactly(proxied):
    proxy, service, engine = proxied
    messages = [{"role": "user", "content": long_text(11)}]
    chunks, text = stream_chat(proxy, "p1", messages)
    assert chunks[0]["prompt_token_ids"] and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": long_text(12)}]
    stream_chat(proxy, "p1", messages)
    wait_until_read(service, ["p1"])
    assert_exact(service, "p1")
    with service.state_lock:
        s = service.store.get("p1")
        assert s.committed > 0 and s.ids[:2] == [248045, 846]  # <|im_start|>user, from the engine's ids
    answer = proxy.post("/v1/shadow/ask", json={"session": "p1", "question": "A or B?", "choices": ["A", "B"]}).json()
    assert abs(sum(answer["probs"]) - 1) < 1e-5


def test_proxy_passes_bodies_and_errors_through(proxied):
    proxy, service, engine = proxied
    request = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    direct = engine.post("/v1/chat/completions", json=request).json()
    via = proxy.post("/v1/chat/completions", json=request, headers={"x-session-id": "p2"}).json()
    assert via["choices"][0]["message"] == direct["choices"][0]["message"] and via["usage"] == direct["usage"]
    bad = proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]  # the engine's own error
    assert proxy.get("/v1/models").json() == engine.get("/v1/models").json()
    settled(service)
    assert service.status()["turns_in_flight"] == 0


def test_proxy_strips_the_ids_it_asked_for_and_reads_them(proxied):
    """The client did not ask for ids: the proxy asks the engine (vLLM dialect), reads them, and
    the client's response carries none."""
    proxy, service, engine = proxied
    service_prompt_ids = None
    r = proxy.post("/v1/chat/completions", headers={"x-session-id": "p3"},
                   json={"messages": [{"role": "user", "content": long_text(13, 200)}], "max_tokens": 4,
                         "return_token_ids": False})
    assert r.status_code == 200 and "prompt_token_ids" not in r.json()
    settled(service)
    with service.state_lock:
        service_prompt_ids = service.store.get("p3").ids
    assert service_prompt_ids[:2] == [248045, 846] and len(service_prompt_ids) > 200


def test_upstream_down_gives_502_and_the_shadow_stays_consistent(tiny):
    with running(upstream=f"http://127.0.0.1:{free_port()}/v1") as (proxy, service):
        r = proxy.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502 and "upstream unreachable" in r.json()["error"]["message"]
        status = proxy.get("/v1/shadow/status").json()
        assert status["turns_in_flight"] == 0 and status["sessions"] == []


def test_share_slices_are_charged_to_the_turn_and_counted(tiny):
    """Between two rounds the reader reads within the share of the time since the first token;
    what it used is charged to the turn and summed in the status counters."""
    loaded, reader = open_reader("tiny", grid=GRID)
    offset = [0.0]
    service = service_for(settings_for(prefix_match=False), reader, SessionStore(reader, loaded.weights_hash, cap_gib=None),
                          clock=lambda: time.monotonic() + offset[0])
    turn = service.begin_turn("s")
    service.set_prompt(turn, list(range(1000, 1000 + 8 * GRID)))
    assert service.share_slice(turn) == 0  # no first token yet: no share
    service.first_token(turn)
    offset[0] += 10.0  # 10 s of decode: a budget of 0.2 s, read in slices of at most 0.15 s
    read = service.share_slice(turn)
    read += service.share_slice(turn)
    counters = service.status()["counters"]
    assert read > 0 and counters["chunks_share"] == read
    # the turn counts its slices' own seconds; the share is charged at most them (`--share-charge alone`)
    assert 0 < turn.share_used == service.counters.share_read_s and counters["share_read_s"] == round(turn.share_used, 6)
    assert 0 < service.counters.share_s <= service.counters.share_read_s
    assert service.store.get("s").committed == read * GRID


def test_ab_against_an_embedded_server(server, tmp_path):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    client, service = server
    result = CliRunner().invoke(app, [
        "ab", "--url", str(client.base_url).rstrip("/") + "/v1", "--prompt-tokens", "400", "--output-tokens", "6",
        "--runs", "2", "--pause", "0", "--gate-pct", "1000", "--plot", str(tmp_path / "ab.png"), "--json",
        "--allow-insignificant",
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    # 2 pairs: let through, and said to be not significant; the embedded engine takes every field
    assert doc["significant"] is False and doc["verdict"] == "not significant"
    assert doc["not_significant_because"] == ["2 pairs, fewer than 5"] and "not significant" in result.output
    assert doc["fields"] == {"sent": ["ignore_eos", "min_tokens", "return_token_ids"], "dropped": [], "effects": {}}
    assert doc["runs"] == 2 and set(doc["decode_tok_s"]) == {"off", "on"} and set(doc["ttft_s"]) == {"off", "on"}
    assert len(doc["paired_deltas_pct"]) == 2 and doc["gate_pct"] == 1000 and doc["passed"] is True
    assert doc["paired_median_pct"] == statistics.median(doc["paired_deltas_pct"])
    assert all(r["tokens"] == 6 for r in doc["per_run"])
    assert all(r["share_s"] == 0 for r in doc["per_run"] if r["arm"] == "off")  # switched off: no reading
    assert all(r["share_s"] >= 0 for r in doc["per_run"]) and doc["share_pct"] >= 0
    status = client.get("/v1/shadow/status").json()
    assert status["enabled"] is True  # switched back on
    ab_sessions = [r for r in status["sessions"] if r["name"].startswith("ab-")]
    assert len(ab_sessions) == 2  # only the "on" runs fed the shadow


def test_router_eval_on_a_journal_built_by_serve(tiny, tmp_path):
    """Serve journals labelled asks and parks its sessions; router-eval re-asks them offline: the
    control (the same model and question) gives the journal's probabilities again."""
    from typer.testing import CliRunner

    from shadow.cli.main import app

    disk, journal = tmp_path / "disk", tmp_path / "journal.jsonl"
    labels = {"r0": ("A", True), "r1": ("B", False), "r2": ("A", True), "r3": ("A", False)}
    with running(disk=disk, journal=journal) as (client, _):
        for name, (label, fresh) in labels.items():
            messages = [{"role": "user", "content": long_text(hash(name) % 1000, 150)}]
            stream_chat(client, name, messages, max_tokens=4)
            r = client.post("/v1/shadow/ask", json={"session": name, "question": "Code or chat? A code, B chat",
                                                    "choices": ["A", "B"], "reference": label, "fresh": fresh})
            assert r.status_code == 200, r.text
        # r0 goes on with its history edited: its ids before the ask's insertion point change
        first = {"role": "user", "content": long_text(hash("r0") % 1000, 150)}
        stream_chat(client, "r0", [first, {"role": "assistant", "content": "EDITED"}, {"role": "user", "content": "more"}], 4)
        r = client.post("/v1/shadow/ask", json={"session": "r1", "question": "x", "choices": ["A"], "reference": "Z"})
        assert r.status_code == 400  # a reference must be one of the choices
    question = tmp_path / "labels.json"
    question.write_text(json.dumps({"name": "labels", "text": "A or B?", "choices": ["A", "B"]}))
    result = CliRunner().invoke(app, ["router-eval", "--journal", str(journal), "--sessions", str(disk),
                                      "--question", "journal", "--question", str(question), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["turns"] == 4 and doc["fresh_turns"] == 2
    own, other = doc["results"]
    assert own["question"] == "journal" and own["control_max_abs_diff"] is not None
    assert own["control_max_abs_diff"] <= 0.02 and own["changed"] == 1  # r0's ask is no longer valid
    assert own["control_same_arithmetic"] is True
    assert own["turns"] == 3 and own["constant_baseline"] == 2 and own["fresh_constant_baseline"] == 1
    assert sum(sum(c.values()) for c in own["confusion"].values()) == 3
    assert other["question"] == "labels" and other["control_max_abs_diff"] is None
    assert "weights are random" in result.output


def test_a_request_without_session_header_continues_the_longest_matching_session(server):
    client, service = server
    first = [{"role": "user", "content": long_text(21, 120)}]
    r = client.post("/v1/chat/completions", json={"messages": first, "max_tokens": 3})
    name = r.headers["x-shadow-session"]
    assert name.startswith("auto-")
    again = client.post("/v1/chat/completions", json={
        "messages": first + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "and then?"}], "max_tokens": 3})
    assert again.headers["x-shadow-session"] == name  # the same session, found by its prefix
    other = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "unrelated"}], "max_tokens": 3})
    assert other.headers["x-shadow-session"] != name


def test_standing_question_is_answered_at_the_insertion_point_and_journaled(tiny, tmp_path):
    """A standing question on every turn of 100+ prompt tokens, asked at the prompt's last
    <|im_end|> when the reader gets there, journaled beside the x-shadow-label header; router-eval
    then re-asks those points offline and the control matches."""
    from typer.testing import CliRunner

    from shadow.cli.main import app
    from shadow.server.standing import load_standing

    tokenizer = load_tokenizer(None)
    spec = tmp_path / "router.json"
    spec.write_text(json.dumps({"name": "router", "text": "\nClass? A code, B chat", "choices": ["A", "B"],
                                "min_prompt_tokens": 100}))
    disk, journal = tmp_path / "disk", tmp_path / "journal.jsonl"
    with running(disk=disk, journal=journal, standing=load_standing(spec, tokenizer)) as (client, service):
        for k, label in enumerate("ABA"):
            r = client.post("/v1/chat/completions", headers={"x-session-id": f"t{k}", "x-shadow-label": label},
                            json={"messages": [{"role": "user", "content": long_text(30 + k, 200)}], "max_tokens": 3})
            assert r.status_code == 200
        client.post("/v1/chat/completions", headers={"x-session-id": "short"},
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})  # under 100 tokens
        wait_until_read(service, ["t0", "t1", "t2"])
        counters = client.get("/v1/shadow/status").json()["counters"]
    assert counters["standing_answered"] == 3 and counters["standing_pending"] == 0
    rows = answers(journal)
    # answered as the reader got to each point (the idle window reads the newest turn first)
    assert {r["session"]: r["reference"] for r in rows} == {"t0": "A", "t1": "B", "t2": "A"}
    assert all(r["standing"] == "router" for r in rows)
    for r in rows:
        ids = service.store.get(r["session"]).ids
        assert ids[r["insertion"] - 1] == 248046  # the prompt's last <|im_end|>
        assert abs(sum(r["probs"]) - 1) < 1e-5
    result = CliRunner().invoke(app, ["router-eval", "--journal", str(journal), "--sessions", str(disk), "--json"])
    assert result.exit_code == 0, result.output
    own = json.loads(result.output.strip().splitlines()[-1])["results"][0]
    assert own["turns"] == 3 and own["control_max_abs_diff"] == 0.0 and own["constant_baseline"] == 2


def test_summarize_decodes_from_a_fork_and_leaves_the_session(server):
    client, service = server
    stream_chat(client, "sum", [{"role": "user", "content": long_text(40, 200)}])
    wait_until_read(service, ["sum"])
    before = client.get("/v1/shadow/status").json()["sessions"]
    r = client.post("/v1/shadow/summarize", json={"session": "sum", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert 1 <= len(body["ids"]) <= 5 and isinstance(body["text"], str) and body["weights"] == "random"
    again = client.post("/v1/shadow/summarize", json={"session": "sum", "max_tokens": 5}).json()
    assert again["ids"] == body["ids"]  # greedy, from the same state
    after = client.get("/v1/shadow/status").json()["sessions"]
    drop = lambda rows: [{k: v for k, v in r.items() if k != "last_use"} for r in rows]  # noqa: E731
    assert drop(after) == drop(before)  # only its last use moved
    assert_exact(service, "sum")
    bad = client.post("/v1/shadow/summarize", json={"session": "sum", "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_session_identity_is_configurable(tiny):
    with running(session_headers=("x-conversation",), prefix_match=False) as (client, _):
        body = {"messages": [{"role": "user", "content": long_text(50, 100)}], "max_tokens": 2}
        named = client.post("/v1/chat/completions", json=body, headers={"x-conversation": "mine", "x-session-id": "no"})
        assert named.headers["x-shadow-session"] == "mine"
        first = client.post("/v1/chat/completions", json=body).headers["x-shadow-session"]
        second = client.post("/v1/chat/completions", json=body).headers["x-shadow-session"]
        assert first.startswith("auto-") and second.startswith("auto-") and first != second  # no prefix match


def test_a_proxied_stream_never_waits_for_the_shadow(proxied):
    """With the shadow's device held (as by a long ask), a stream through the proxy still ends;
    the shadow takes its ids once the device is free."""
    proxy, service, engine = proxied
    with service.device.hold():
        chunks, _ = stream_chat(proxy, "busy", [{"role": "user", "content": long_text(60, 150)}], max_tokens=5)
        assert chunks and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        with service.state_lock:
            assert service.store.peek("busy") is None or service.store.peek("busy").ids == []
    settled(service)
    s = service.store.peek("busy")
    assert s is not None and s.ids[:2] == [248045, 846] and len(s.ids) > 150  # prompt and output, fed late


def test_a_late_answer_never_lands_after_a_newer_prompt(server):
    """The service drops output (or a prompt) of a turn older than the session's newest fed turn."""
    _, service = server

    def turns() -> None:
        first = service.begin_turn("late")
        service.set_prompt(first, list(range(300)))
        second = service.begin_turn("late")
        service.set_prompt(second, list(range(300)) + [7] * 50)  # the next turn came first
        service.add_output(first, [9, 9, 9])  # the first turn's answer arrives after it
        service.set_prompt(first, list(range(200)))  # and a stale prompt too
        service.add_output(second, [5])
        for t in (first, second):
            service.end_turn(t)

    service.run_request(turns)
    assert service.store.peek("late").ids == list(range(300)) + [7] * 50 + [5]


def test_text_stream_holds_a_character_split_over_ids_until_whole(tokenizer):
    from shadow.text.detok import TextStream

    text = "héllo wörld — 日本語のテキスト 🎉🎉 done"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.rest() == text
    assert not any("\ufffd" in p for p in pieces)  # no half character is ever sent
    assert "" in pieces  # the emoji's first id alone adds nothing yet


@contextmanager
def proxy_loading_in_background(upstream: str, load):
    """A proxy whose shadow loads with `load` on the device thread after start (as `shadow serve
    --upstream` does)."""
    from shadow.model.checkpoint import read_config, resolve_checkpoint

    settings = settings_for(upstream, prefix_match=False)
    service = ShadowService(settings, load, read_config(resolve_checkpoint("tiny")))
    with serving(ShadowApp(settings, service, load_tokenizer(None), "upstream").app) as client:
        yield client, service


def test_a_proxy_serves_while_its_shadow_loads_then_reads_what_came_meanwhile(tiny):
    release = threading.Event()

    def slow_load():
        release.wait(30)  # the model "loads" until the test lets it finish
        _, reader = open_reader("tiny", grid=GRID)
        return Shadow(reader, SessionStore(reader, tiny.weights_hash, cap_gib=None), tiny.weights_label)

    with running() as (engine, _):
        with proxy_loading_in_background(str(engine.base_url).rstrip("/") + "/v1", slow_load) as (proxy, service):
            assert proxy.get("/v1/shadow/status").json()["ready"] is False
            chunks, _ = stream_chat(proxy, "early", [{"role": "user", "content": long_text(70, 300)}], max_tokens=4)
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # answered while loading
            asked = proxy.post("/v1/shadow/ask", json={"session": "early", "question": "A or B?", "choices": ["A", "B"],
                                                       "timeout_s": 0.2})
            assert asked.status_code == 503 and "loading" in asked.json()["error"]["message"]
            release.set()
            settled(service)
            assert service.ready.is_set() and proxy.get("/v1/shadow/status").json()["ready"] is True
            wait_until_read(service, ["early"])
            s = service.store.peek("early")
            assert s is not None and len(s.ids) > 300  # the prompt and the answer that came while loading
            assert_exact(service, "early")


def test_a_proxy_whose_shadow_fails_to_load_still_passes_requests_through(tiny):
    def broken_load():
        raise OSError("no such checkpoint")

    with running() as (engine, _):
        with proxy_loading_in_background(str(engine.base_url).rstrip("/") + "/v1", broken_load) as (proxy, service):
            chunks, _ = stream_chat(proxy, "x", [{"role": "user", "content": long_text(71, 100)}], max_tokens=3)
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            settled(service)
            status = proxy.get("/v1/shadow/status").json()
            assert status["ready"] is False and "no such checkpoint" in status["load_error"]
            asked = proxy.post("/v1/shadow/ask", json={"session": "x", "question": "A?", "choices": ["A", "B"]})
            assert asked.status_code == 503 and "failed to load" in asked.json()["error"]["message"]


def test_an_idle_proxy_unloads_past_the_slack_and_the_next_turn_reads_on_exactly(tiny, tmp_path):
    """With more than the slack free after an idle burst, sessions go to disk and the model is
    let go; the next turn loads it again, restores the session and continues bit for bit."""
    from shadow.model.checkpoint import read_config, resolve_checkpoint

    free = {"bytes": 0}  # the test decides when the pool "has" memory to give back

    def load():
        _, reader = open_reader("tiny", grid=GRID)
        return Shadow(reader, SessionStore(reader, tiny.weights_hash, cap_gib=None, disk=tmp_path / "disk"), "random")

    with running() as (engine, _):
        settings = settings_for(str(engine.base_url).rstrip("/") + "/v1", prefix_match=False)
        settings = dataclasses.replace(settings, store=StoreSettings(None, tmp_path / "disk", unload_slack_gib=1 / 1024))
        service = ShadowService(settings, load, read_config(resolve_checkpoint("tiny")), pool_free=lambda: free["bytes"])
        app = ShadowApp(settings, service, load_tokenizer(None), "upstream").app
        with serving(app) as proxy:
            first = [{"role": "user", "content": long_text(80, 300)}]
            _, answer = stream_chat(proxy, "u", first, max_tokens=4)
            settled(service)
            wait_until_read(service, ["u"])
            free["bytes"] = 1 << 30
            deadline = time.time() + 30
            while service.counters.unloads == 0 and time.time() < deadline:
                time.sleep(0.05)
            free["bytes"] = 0
            status = proxy.get("/v1/shadow/status").json()
            assert status["counters"]["unloads"] == 1 and status["ready"] is False
            assert list((tmp_path / "disk").glob("*.safetensors"))  # the session, parked
            second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": long_text(81, 300)}]
            stream_chat(proxy, "u", second, max_tokens=4)
            settled(service)
            assert service.ready.is_set()  # loaded again by the turn
            wait_until_read(service, ["u"])
            assert service.store.peek("u").committed > GRID
            assert_exact(service, "u")


def test_the_upstream_model_labels_a_standing_question_when_no_header_does(tiny, tmp_path):
    """Opt-in: after a proxied turn with no label header, the engine is asked the standing question
    (one greedy token after the turn's messages); its answer is the journal's reference when it
    is one of the choices, and is kept beside it either way. A header label still wins."""
    from shadow.server.standing import load_standing

    spec = tmp_path / "router.json"
    spec.write_text(json.dumps({"name": "router", "text": "Class? A code, B chat", "choices": ["A", "B"],
                                "min_prompt_tokens": 100}))
    standing = load_standing(spec, load_tokenizer(None))
    journal = tmp_path / "journal.jsonl"
    messages = [{"role": "user", "content": long_text(90, 200)}]
    with running() as (engine, _):
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=upstream, journal=journal, standing=standing, label_from_upstream=True) as (proxy, service):
            assert proxy.post("/v1/chat/completions", headers={"x-session-id": "unlabelled"},
                              json={"messages": messages, "max_tokens": 3}).status_code == 200
            stream_chat(proxy, "streamed", [{"role": "user", "content": long_text(91, 200)}], max_tokens=3)
            assert proxy.post("/v1/chat/completions", headers={"x-session-id": "labelled", "x-shadow-label": "B"},
                              json={"messages": [{"role": "user", "content": long_text(92, 200)}],
                                    "max_tokens": 3}).status_code == 200
            settled(service)
            wait_until_read(service, ["unlabelled", "streamed", "labelled"])
            deadline = time.time() + 30
            while len(answers(journal)) < 3 and time.time() < deadline:
                time.sleep(0.05)
        # what the engine says to the same question, asked directly
        direct = engine.post("/v1/chat/completions", json={
            "messages": messages + [{"role": "user", "content": standing.text}], "max_tokens": 1, "temperature": 0})
        said = direct.json()["choices"][0]["message"]["content"].strip()
    rows = {r["session"]: r for r in answers(journal)}
    assert rows["unlabelled"]["reference_source"] == "upstream" and rows["unlabelled"]["upstream_answer"] == said
    assert rows["unlabelled"]["reference"] == (said if said in ("A", "B") else None)
    assert rows["streamed"]["reference_source"] == "upstream"  # a streamed turn is labelled the same way
    assert rows["labelled"]["reference"] == "B" and rows["labelled"]["reference_source"] == "header"
    assert "upstream_answer" not in rows["labelled"]  # a header label: the engine is not asked
    assert rows["unlabelled"]["arithmetic"] == service.store.identity.arithmetic


# embedded mode: a fair, bounded queue; a request whose client goes away is cancelled ----------

LONG_PROMPT = [1000 + i % 5000 for i in range(150_000)]  # tiny on this CPU: about 100 s of prefill


def timed_post(client: httpx.Client, session: str, body: dict) -> float:
    start = time.perf_counter()
    r = client.post("/v1/chat/completions", headers={"x-session-id": session}, json=body)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_prefill_gives_way_to_another_client_and_is_cancelled_when_its_client_hangs_up(tiny, stream):
    """A 150,000-token prompt (its prefill alone about 100 s here) whose client hangs up after 5 s:
    another client's 2-token request sent meanwhile is served between the long prefill's chunks
    (under 2 s more than it takes alone), and the long request stops at its next step once its
    client is gone (its turn ends within seconds, not after its prefill), the shadow fed nothing
    of it. Then the next request is served as if alone."""
    with running() as (client, service):
        short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        alone = timed_post(client, "alone", short)
        hung_up = {}

        def hang_up() -> None:
            body = {"prompt": LONG_PROMPT, "max_tokens": 2, "stream": stream}
            with httpx.Client(base_url=client.base_url, timeout=httpx.Timeout(5.0)) as c:
                try:
                    if stream:
                        with c.stream("POST", "/v1/completions", json=body, headers={"x-session-id": "long"}) as r:
                            for _ in r.iter_bytes():
                                pass
                    else:
                        c.post("/v1/completions", json=body, headers={"x-session-id": "long"})
                except httpx.TimeoutException:
                    pass
            hung_up["at"] = time.perf_counter()

        long_client = threading.Thread(target=hang_up)
        long_client.start()
        deadline = time.time() + 60
        while time.time() < deadline and not any(t.embedded for t in service.turns):
            time.sleep(0.05)
        time.sleep(1.0)  # well into its prefill
        meanwhile = timed_post(client, "meanwhile", short)
        assert "at" not in hung_up  # served while the long request was still reading its prompt
        assert meanwhile - alone < 2.0, (meanwhile, alone)
        long_client.join(timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline and service.turns:
            time.sleep(0.05)
        ended = time.perf_counter()
        assert not service.turns and ended - hung_up["at"] < 20  # its prefill had some 90 s to go
        checks = service.checks["long"]
        assert checks.turns == 1 and checks.parts["prompt"]["not_read"] == 1  # cancelled before its first token
        assert checks.parts["output"]["not_read"] == 1 and any("cancelled" in r for r in checks.last_reasons)
        assert all(s["name"] != "long" or s["committed"] + s["pending"] == 0
                   for s in client.get("/v1/shadow/status").json()["sessions"])
        after = timed_post(client, "after", short)
        assert after - alone < 2.0, (after, alone)


def test_the_embedded_queue_is_bounded_and_answers_429_beyond(tiny):
    from shadow.server.settings import Limits

    with running(limits=Limits(max_queued=2, max_generating=1)) as (client, service):
        service.device.run(lambda: None)
        hold = threading.Event()
        service.device.submit(hold.wait, "test")  # the device is busy: requests queue behind it
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(client.post, "/v1/chat/completions", headers={"x-session-id": f"q{k}"},
                                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                       for k in range(3)]
            refused = None
            deadline = time.time() + 30
            while refused is None and time.time() < deadline:
                refused = next((f.result() for f in futures if f.done()), None)
                time.sleep(0.05)
            hold.set()
            codes = sorted(f.result().status_code for f in futures)
        assert codes == [200, 200, 429]
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        settled(service)
        assert service.status()["counters"]["requests"] == 2  # the refused one began no turn


def test_two_long_generations_take_turns_and_each_is_read_exactly(tiny):
    """Two requests generating at once share the device in slices; each gets the tokens it gets
    alone, and each session's state is bit-equal to a fresh prefill of its ids, which are its
    prompt and those tokens."""
    with running() as (client, service):
        def ask(k: int, session: str | None = None) -> list[int]:
            r = client.post("/v1/completions", headers={"x-session-id": session or f"g{k}"},
                            json={"prompt": [2000 + k + i % 3000 for i in range(4000)], "max_tokens": 24,
                                  "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(ask, range(2)))
        assert ask(1, "g1-alone") == outs[1]
        settled(service)
        for k, out in enumerate(outs):
            with service.state_lock:
                ids = list(service.store.get(f"g{k}").ids)
            assert ids == [2000 + k + i % 3000 for i in range(4000)] + out
            checks = service.checks[f"g{k}"]
            assert checks.verified == 1 and checks.parts["output"]["verified"] == 1
        wait_until_read(service, ["g0", "g1"])
        for k in range(2):
            assert_exact(service, f"g{k}")


@pytest.mark.parametrize("upstream", [False, True], ids=["embedded", "proxy"])
def test_a_stopped_app_keeps_nothing_of_its_service_alive(upstream):
    """FastAPI keeps every endpoint it was given in a process-wide cache; the app's routes hold its
    service, models and tokenizer weakly, so once the app is stopped and dropped they are freed (a
    process that makes many apps, as this suite does, does not grow by a model each)."""
    import gc
    import weakref
    from contextlib import ExitStack

    with ExitStack() as engines:
        url = str(engines.enter_context(running())[0].base_url) + "/v1" if upstream else None
        with running(url) as (client, service):
            assert client.get("/v1/models").status_code == 200 and client.get("/ready").status_code == 200
            held = [weakref.ref(service), weakref.ref(service.reader.model)]
        del client, service
        gc.collect()
        assert [ref() for ref in held] == [None, None]


def test_each_turn_start_says_what_its_session_held_unread_named_by_header_or_by_prefix(tiny, tmp_path):
    """A turn's start, live: what its session's shadow held unread when the turn named it (the
    replay's turn starts fresh): a new session is `new`, else `fresh` under a grid unread or
    `behind`; a turn found by its prompt's prefix counts when its prompt names it. Journaled, in
    status and /metrics, the same counts in each."""
    journal = tmp_path / "journal.jsonl"
    with running(journal=journal) as (client, service):
        first = [{"role": "user", "content": long_text(5, 60)}]
        r = client.post("/v1/chat/completions", json={"messages": first, "max_tokens": 2}, headers={"x-session-id": "a"})
        assert r.status_code == 200
        again = first + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "and then?"}]
        assert client.post("/v1/chat/completions", json={"messages": again, "max_tokens": 2},
                           headers={"x-session-id": "a"}).status_code == 200
        found = client.post("/v1/chat/completions", json={"messages": again + [
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}], "max_tokens": 2})
        assert found.headers["x-shadow-session"] == "a"  # continued by its prefix: named when its prompt came
        status = client.get("/v1/shadow/status").json()
        metrics = client.get("/metrics").text
    turns = [json.loads(x) for x in journal.read_text().splitlines() if '"kind": "turn"' in x]
    starts = [t["unread_at_start"] for t in turns]
    assert len(starts) == 3 and starts[0] is None and all(isinstance(u, int) and u >= 0 for u in starts[1:])
    expected = {"new": 1, "fresh": 0, "behind": 0}
    for unread in starts[1:]:
        expected["fresh" if unread < GRID else "behind"] += 1
    assert status["counters"]["turn_starts"] == expected
    for state, n in expected.items():
        assert re.search(rf'^shadow_turn_starts_total\{{[^}}]*state="{state}"[^}}]*\}} {n}\.0$', metrics, re.M), state


def test_an_answer_goes_back_before_the_store_settles_and_a_failed_settle_is_counted(server):
    """The store settles back within its cap after an answer, as the device thread's next job: an ask
    is answered while that settle still waits (held here on an event), and a settle that fails is
    logged and counted with the reader's errors; the next ask is answered all the same."""
    client, service = server
    stream_chat(client, "s1", [{"role": "user", "content": long_text(1)}])
    wait_until_read(service, ["s1"])
    release, began, ended = threading.Event(), threading.Event(), threading.Event()
    real = service.reading.settle
    calls = []

    def held(shadow, keep):
        calls.append(keep)
        began.set()
        release.wait(10)
        ended.set()
        if len(calls) == 2:
            raise OSError("disk full")
        return real(shadow, keep)

    service.reading.settle = held
    ask = {"session": "s1", "question": "A or B?", "choices": ["A", "B"]}
    try:
        first = client.post("/v1/shadow/ask", json=ask, timeout=30)
        assert first.status_code == 200 and "settle" not in first.json()["parts_ms"]
        assert not ended.is_set() and began.wait(10)  # the answer went back while its settle waited
        release.set()
        second = client.post("/v1/shadow/ask", json=ask, timeout=30)
        assert second.status_code == 200
        deadline = time.time() + 10
        while (not service.device.idle() or len(calls) < 2) and time.time() < deadline:
            time.sleep(0.02)
    finally:
        release.set()
        service.reading.settle = real
    assert calls == ["s1", "s1"]
    reading = client.get("/v1/shadow/status").json()["idle_reader"]
    assert reading["errors"] == 1 and reading["last_error"] == "a settle after an ask: OSError: disk full"
    assert client.post("/v1/shadow/ask", json=ask, timeout=30).status_code == 200


def test_a_shadow_switched_back_on_reads_at_its_share_from_then_not_the_share_banked_while_off(tiny):
    def load():
        _, reader = open_reader("tiny", grid=GRID)
        return Shadow(reader, SessionStore(reader, tiny.weights_hash, cap_gib=None), tiny.weights_label)

    with running() as (engine, _):
        with proxy_loading_in_background(str(engine.base_url).rstrip("/") + "/v1", load) as (proxy, service):
            settled(service)
            sched = service.sched
            with service.state_lock:  # a turn decoding from now (as the proxy tells its first token)
                sched.turn_started("decoding", "s", service.clock())
                sched.first_token("decoding", service.clock())
            assert proxy.post("/v1/shadow/switch", json={"on": False}).json() == {"on": False, "voice": False}
            time.sleep(0.5)
            with service.state_lock:
                banked = sched.share_left(service.clock())
            assert banked > 0  # the stretch went on earning share while the shadow was off ...
            before = service.clock()
            assert proxy.post("/v1/shadow/switch", json={"on": True}).json() == {"on": True, "voice": True}
            with service.state_lock:  # ... and switched on, the share starts afresh
                assert sched.stretch_start >= before and sched.share_left(service.clock()) < banked
                assert sched.decoded_s(service.clock()) >= 0.5  # the engine's decode seconds run on
                started = sched.stretch_start
            time.sleep(0.1)
            assert proxy.post("/v1/shadow/switch", json={"on": True}).json()["on"] is True
            with service.state_lock:  # on again while on: nothing restarts, the share earned stays
                assert sched.stretch_start == started and sched.share_left(service.clock()) > 0
                sched.turn_ended("decoding", service.clock())
