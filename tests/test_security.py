"""Nobody in, nothing too large: keys, limits and the error shape on a real server on loopback; an
HTTP fuzz of every endpoint from the served OpenAPI schema (schemathesis); a bounded load test of
64 concurrent sessions over a cap that forces spills, with an API key."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from fastapi import FastAPI, Request

from serving import GRID, assert_exact, long_text, serving, service_for, settings_for, settled
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore
from shadow.server.generator import Generator
from shadow.server.http.app import ShadowApp
from shadow.server.settings import Access, EngineSettings, Limits
from shadow.text.tokenizer import load_tokenizer

KEY, ADMIN = "k-3f9a", "admin-77c1"


@contextmanager
def guarded(access=Access(KEY, ADMIN), limits=Limits(), cap_gib=None, disk=None, journal=None, upstream=None,
            upstream_key=None):
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=cap_gib, disk=disk)
    settings = settings_for(journal=journal, prefix_match=False, access=access, limits=limits)
    if upstream:
        settings = dataclasses.replace(settings, engine=EngineSettings(upstream, "vllm", upstream_key=upstream_key))
    service = service_for(settings, reader, store, loaded.weights_label)
    generator = None if upstream else Generator(loaded.model)
    app = ShadowApp(settings, service, load_tokenizer(None), "upstream" if upstream else "tiny", generator=generator).app
    with serving(app) as client:
        yield client, service


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_keys_guard_every_endpoint(tiny):
    with guarded() as (client, service):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for headers in ({}, bearer("wrong"), {"authorization": KEY}):
            r = client.post("/v1/chat/completions", json=chat, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert client.get("/v1/models", headers=headers).status_code == 401
            assert client.get("/openapi.json", headers=headers).status_code == 401
        assert client.post("/v1/chat/completions", json=chat, headers=bearer(KEY) | {"x-session-id": "s"}).status_code == 200
        settled(service)
        # the shadow's own endpoints want the admin key: the API key is not enough
        for path, body in (("/v1/shadow/switch", {"on": False}), ("/v1/shadow/ask", {"session": "s", "question": "q",
                                                                                       "choices": ["A"]})):
            assert client.post(path, json=body, headers=bearer(KEY)).status_code == 401
        assert client.get("/v1/shadow/status", headers=bearer(KEY)).status_code == 401
        assert client.get("/v1/shadow/status", headers=bearer(ADMIN)).status_code == 200
        assert service.shared.switch.shadow  # the refused switch changed nothing
        r = client.post("/v1/shadow/ask", headers=bearer(ADMIN), json={"session": "s", "question": "q", "choices": ["A"]})
        assert r.status_code == 200


def test_the_proxy_sends_the_engines_own_key(tiny):
    seen = []
    engine = FastAPI()

    @engine.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append(request.headers.get("authorization"))
        return {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}

    with serving(engine) as e, guarded(upstream=str(e.base_url).rstrip("/") + "/v1", upstream_key="engine-key") \
            as (client, service):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                        headers=bearer(KEY))
        assert r.status_code == 200 and seen == ["Bearer engine-key"]  # the client's key never reaches the engine
        settled(service)


def test_limits_refuse_with_the_error_shape_and_change_nothing(tiny, tmp_path):
    limits = Limits(max_body_bytes=4096, max_prompt_tokens=300, max_tokens=4, max_ask_tail=GRID, max_concurrent=2)
    with guarded(Access(), limits) as (client, service):
        before = client.get("/v1/shadow/status").json()
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]})
        r = client.post("/v1/chat/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

        def chunks():  # no content-length: the body is counted as it streams in
            for _ in range(10):
                yield b" " * 1000

        r = client.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text(1, 400)}]})
        assert r.status_code == 400 and "at most 300" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
        assert client.get("/v1/shadow/status").json()["sessions"] == before["sessions"]
        # requests in flight: the third of three at once is refused
        service.device.run(lambda: None)
        hold = threading.Event()
        service.device.submit(hold.wait, "test")  # the device is busy: turns queue behind it
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(client.post, "/v1/chat/completions", headers={"x-session-id": f"c{k}"},
                                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                       for k in range(3)]
            time.sleep(1.0)
            hold.set()
            codes = sorted(f.result().status_code for f in futures)
        assert codes == [200, 200, 429]


def test_an_ask_far_behind_answers_503_not_a_huge_fork(tiny):
    limits = Limits(max_ask_tail=GRID)
    with guarded(Access(), limits) as (client, service):
        service.shared.switch.shadow = True
        service.reading.stop_event.set()  # no idle reader: the session stays behind
        client.post("/v1/chat/completions", headers={"x-session-id": "far"},
                    json={"messages": [{"role": "user", "content": long_text(2, 800)}], "max_tokens": 1})
        settled(service)
        r = client.post("/v1/shadow/ask", json={"session": "far", "question": "q", "choices": ["A"],
                                                "timeout_s": 0.001})
        assert r.status_code == 503 and "ids behind" in r.json()["error"]["message"]


def test_the_journal_is_private(tiny, tmp_path):
    journal = tmp_path / "j.jsonl"
    with guarded(Access(), journal=journal) as (client, service):
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                    headers={"x-session-id": "p"})
        settled(service)
    assert journal.exists() and (journal.stat().st_mode & 0o777) == 0o600


def test_listening_beyond_loopback_needs_a_key_and_bad_options_do_nothing(tmp_path):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    runner = CliRunner()
    disk = tmp_path / "never"
    for args in (["--host", "0.0.0.0"], ["--port", "70000"], ["--port", "-1"], ["--share", "2"],
                 ["--disk", str(tmp_path / "f"), "--journal", str(tmp_path)], ["--engine", "tgi"],
                 ["--upstream", "ftp://x"], ["--cap-gib", "-1"]):
        (tmp_path / "f").write_text("a file")
        r = runner.invoke(app, ["serve", "--disk", str(disk), *args])
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output
    assert not disk.exists()  # nothing was created
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\x00\xff\xfe")
    r = runner.invoke(app, ["serve", "--config", str(binary)])
    assert r.exit_code == 2 and "Traceback" not in r.output


@pytest.mark.slow
def test_fuzz_every_endpoint_from_the_openapi_schema(tiny):
    """schemathesis generates requests for every operation of the served schema: no 5xx, and every
    error in the documented shape."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    limits = Limits(max_tokens=4, max_prompt_tokens=2048)
    with guarded(Access(), limits) as (client, service):
        base = str(client.base_url)
        schema = schemathesis.openapi.from_url(base + "/openapi.json")
        failures = []
        for operation in schema.get_all_operations():
            op = operation.ok()
            strategy = op.as_strategy()

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(strategy)
            def check(case):
                response = case.call(base_url=base, timeout=60)
                if response.status_code >= 500:
                    failures.append((op.label, response.status_code, response.text[:200]))
                elif response.status_code >= 400:
                    body = response.json()
                    if set(body) != {"error"} or set(body["error"]) != {"message", "type"}:
                        failures.append((op.label, response.status_code, response.text[:200]))

            check()
        settled(service, timeout=120)
    assert failures == []


@pytest.mark.slow
def test_sixty_four_concurrent_sessions_over_a_spilling_cap_all_exact(tiny, tmp_path):
    """64 clients, each its own session of two turns, at once, with an API key, over a resident cap
    that holds a few sessions: the embedded queue holds 16 (`--max-queued`), so a client past it
    gets a 429 and tries again after its `retry-after`; 0 errors, every turn served, and every
    session exact against a fresh prefill."""
    sessions = [f"load-{k}" for k in range(64)]
    refused = []
    with guarded(Access(KEY), cap_gib=0.001, disk=tmp_path / "disk") as (client, service):
        def one(name: str) -> list[int]:
            codes = []
            history = [{"role": "user", "content": long_text(hash(name) % 1000, 150)}]
            for turn in range(2):
                while True:
                    r = client.post("/v1/chat/completions", headers=bearer(KEY) | {"x-session-id": name},
                                    json={"messages": history, "max_tokens": 4})
                    if r.status_code != 429:
                        break
                    refused.append(r.json()["error"]["type"])
                    time.sleep(float(r.headers["retry-after"]))
                codes.append(r.status_code)
                if r.status_code == 200:
                    history += [r.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
            return codes

        start = time.perf_counter()
        with ThreadPoolExecutor(64) as pool:
            codes = [c for cs in pool.map(one, sessions) for c in cs]
        seconds = time.perf_counter() - start
        settled(service, timeout=120)
        status = client.get("/v1/shadow/status", headers=bearer(KEY)).json()
        spills = status["store"]
        for name in sessions:
            assert_exact(service, name)
    assert codes == [200] * 128 and set(refused) <= {"rate_limit_error"}
    assert status["counters"]["requests"] == 128  # a refused request begins no turn
    assert sum(1 for s in status["sessions"] if not s["resident"]) > 0, spills  # the cap forced spills
    print(f"load: 64 sessions x 2 turns in {seconds:.1f} s, {len(refused)} 429s tried again; store {spills}")


@pytest.mark.slow
def test_ab_reaches_a_server_with_keys_by_option_or_environment(tiny, tmp_path):
    """Without a key ab says which it wants and exits 2; with the admin key (by --api-key, or
    SHADOW_API_KEY) it runs both arms and sets the switch back."""
    from typer.testing import CliRunner

    from shadow.cli.main import app

    with guarded() as (client, service):
        url = str(client.base_url).rstrip("/") + "/v1"
        args = ["ab", "--url", url, "--prompt-tokens", "200", "--output-tokens", "3", "--runs", "1", "--pause", "0",
                "--gate-pct", "1000", "--json", "--allow-insignificant"]  # one pair: not significant, and said so
        refused = CliRunner().invoke(app, args, env={"SHADOW_API_KEY": ""})
        assert refused.exit_code == 2 and "wants a key: --api-key" in refused.output
        for extra, env in ((["--api-key", ADMIN], {}), ([], {"SHADOW_API_KEY": ADMIN})):
            result = CliRunner().invoke(app, args + extra, env=env)
            assert result.exit_code == 0, result.output
            doc = json.loads(result.output.strip().splitlines()[-1])
            assert doc["passed"] is True and {r["arm"] for r in doc["per_run"]} == {"off", "on"}
            assert service.shared.switch.shadow  # switched back on


def test_the_admin_key_opens_every_endpoint_and_the_api_key_not_the_shadows(tiny):
    with guarded() as (client, _):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers=bearer(ADMIN) | {"x-session-id": "a"}).status_code == 200
        assert client.get("/v1/models", headers=bearer(ADMIN)).status_code == 200
        assert client.get("/metrics", headers=bearer(KEY)).status_code == 401
        assert client.get("/metrics", headers=bearer(ADMIN)).status_code == 200


@pytest.mark.slow
def test_a_client_that_hangs_up_mid_body_is_one_log_line_without_a_traceback(caplog):
    """A request whose client sends half its body and hangs up: the service logs one line that
    says so, no traceback, and the next client is served."""
    import logging
    import socket

    from serving import running

    caplog.set_level(logging.INFO)
    with running() as (client, _):
        host, port = client.base_url.host, client.base_url.port
        for _ in range(3):
            with socket.create_connection((host, port)) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 1000\r\n\r\n{\"messages\": [")
            time.sleep(0.2)
        deadline = time.time() + 10
        while time.time() < deadline and sum("hung up" in r.getMessage() for r in caplog.records) < 3:
            time.sleep(0.1)
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200
    hung = [rec for rec in caplog.records if "hung up" in rec.getMessage()]
    assert len(hung) == 3 and all(rec.exc_info is None for rec in hung)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


@pytest.mark.parametrize("flag", ["--api-key", "--admin-key", "--upstream-api-key"])
def test_an_empty_key_is_refused_before_anything_starts(flag):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--model", "tiny", flag, " "])
    assert result.exit_code == 2 and f"{flag} is empty" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_the_shadow_endpoints_take_utf8_bodies_only(encoding):
    """A valid body of /v1/shadow/switch, /ask and /summarize sent in UTF-16 or UTF-32 is a 400
    that changes nothing (the switch stays on); the same body in UTF-8 works."""
    from serving import running

    with running() as (client, service):
        for path, body in (("/v1/shadow/switch", '{"on": false}'),
                           ("/v1/shadow/ask", '{"session": "s", "question": "q", "choices": ["A", "B"]}'),
                           ("/v1/shadow/summarize", '{"session": "s", "instruction": "sum up"}')):
            r = client.post(path, content=body.encode(encoding))
            assert r.status_code == 400 and "the body is refused" in r.json()["error"]["message"], (path, r.text)
        assert service.shared.switch.shadow is True
        assert client.post("/v1/shadow/switch", content=b'{"on": false}').json()["on"] is False
