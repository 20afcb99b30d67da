"""A hung engine blocks nothing, and no client that sends or reads nothing holds a slot: real
`shadow serve` apps on loopback, in front of real engines on loopback that hang (`HungEngine`: a
TCP server that never answers), fall silent mid-stream or answer only some requests, and real
clients that stall their bodies, never read their streams, or give up."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from engines import HungEngine
from scripted import renderer
from serving import GRID, long_text, scripted_stream, service_for, serving, settings_for, wait_until_read
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore
from shadow.server.generator import Generator
from shadow.server.http.app import ShadowApp
from shadow.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # real servers, engines and clients


@contextmanager
def served(upstream: str | None = None, *, dialect: str = "openai", status_channel: str = "off", status_timing=None,
           engine: dict | None = None, limits: dict | None = None, probes: dict | None = None):
    """A real `shadow serve` app (embedded, or a proxy in front of `upstream`) on loopback, with
    the settings branches `engine`, `limits` and `probes` changed as given. Yields (client, service,
    the seconds from the server's start to its first `/health` answer)."""
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None)
    base = settings_for(upstream, prefix_match=False, dialect=dialect, status_channel=status_channel,
                        status_timing=status_timing)
    settings = dataclasses.replace(
        base, engine=dataclasses.replace(base.engine, **(engine or {})),
        limits=dataclasses.replace(base.limits, **(limits or {})), probes=dataclasses.replace(base.probes, **(probes or {})))
    service = service_for(settings, reader, store, loaded.weights_label)
    app = ShadowApp(settings, service, load_tokenizer(None), "upstream" if upstream else "tiny",
                    generator=None if upstream else Generator(loaded.model),
                    renderer=renderer() if upstream else None).app
    start = time.monotonic()
    with serving(app) as client:
        live = client.get("/health")
        assert live.status_code == 200 and live.json()["status"] == "ok"
        yield client, service, time.monotonic() - start


def chat(content: str = "hi", **more) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **more}


def until(predicate, timeout: float) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_a_hung_engine_leaves_the_port_answering_and_each_request_ends_at_its_timeout():
    """With an engine that never answers: `/health` answers at once and `/ready` says it is
    probing the dialect (the probe asks every endpoint at once, within its timeout); a request
    ends at the first byte's timeout with a 504 in the one error shape, its turn ended and its
    connection to the engine closed."""
    with HungEngine() as engine, served(engine.url, dialect="auto", engine={
            "probe_timeout_s": 3.0, "first_byte_timeout_s": 1.5}) as (client, service, started_s):
        assert started_s < 1.0  # `/health` within a second of the start: the probe runs beside
        ready = client.get("/ready")
        assert ready.status_code == 503
        assert ready.json() == {"ready": False, "reason": "probing the engine's dialect", "probing": True}
        until(lambda: len(engine.sent("")) >= 7, 2.0)  # the probe's endpoints, asked at once
        begun = time.monotonic()
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json=chat(stream=stream), headers={"x-session-id": f"s{stream}"})
            assert r.status_code == 504, r.text
            assert r.json()["error"]["type"] == "upstream_timeout"
            assert "within 1.5 s" in r.json()["error"]["message"]
        # each waited for a probe (3 s: the engine has not answered one yet) then 1.5 s; a generous bound
        assert time.monotonic() - begun < 2 * (3.0 + 1.5) + 4.0
        until(lambda: not service.turns, 5.0)
        until(lambda: all(r["closed"] is not None for r in engine.sent("/chat/completions")), 5.0)
        assert len(engine.sent("/chat/completions")) == 2
        assert service.status()["counters"]["upstream_errors"].get("timeout") == 2
        ready = client.get("/ready")  # the probe over, the engine still hangs
        assert ready.status_code == 503 and "unreachable" in ready.json()["reason"]


def _hangs_or_answers() -> FastAPI:
    """An engine that never answers a request whose last message begins with 'hang', and answers
    any other at once (a short stream, or a whole body)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        if body["messages"][-1]["content"].startswith("hang"):
            while not await request.is_disconnected():  # nothing, until the proxy closes the request
                await asyncio.sleep(0.1)
            return None
        if not body.get("stream"):
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"},
                                 "finish_reason": "stop"}]}

        async def events():
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "OK"}, "finish_reason": "stop"}]}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_requests_the_engine_hangs_on_hold_off_idle_reading_no_longer_than_their_timeout():
    """Four requests the engine never answers are in flight (the engine counts as busy) while
    another session's prompt comes in: once they end at their timeout, the idle window reads it."""
    with serving(_hangs_or_answers()) as engine:
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with served(upstream, engine={"first_byte_timeout_s": 2.0}) as (client, service, _):
            answers: list[int] = []

            def hung(k: int) -> None:
                answers.append(client.post("/v1/chat/completions", json=chat(f"hang {k}"),
                                           headers={"x-session-id": f"hung{k}"}).status_code)

            threads = [threading.Thread(target=hung, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            until(lambda: len(service.turns) == 4, 10.0)
            r = client.post("/v1/chat/completions", json=chat(long_text(1, 900)), headers={"x-session-id": "fresh"})
            assert r.status_code == 200
            for t in threads:
                t.join(timeout=30)
            assert answers == [504] * 4
            until(lambda: service.store.get("fresh") is not None, 10.0)
            assert service.store.get("fresh").pending >= GRID  # a whole chunk waited for the idle window
            wait_until_read(service, ["fresh"], timeout=30.0)


@pytest.mark.parametrize("how", ["whole", "stream", "stream with lines"])
def test_a_client_that_leaves_closes_its_engine_request_and_ends_its_turn(how):
    """A client that gives up before the engine answers (a whole response, a stream not begun,
    a stream opened by its status lines): the engine sees the request's connection closed within
    a second or two, long before its timeout, and the turn ends."""
    with HungEngine() as engine, served(
            engine.url, status_channel="content" if how == "stream with lines" else "off",
            status_timing={"quiet_s": 0.2}, engine={"first_byte_timeout_s": 120.0}) as (client, service, _):
        body = chat(stream=how != "whole")
        if how == "stream with lines":
            with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "gone"}) as r:
                assert r.status_code == 200  # the stream opened for its lines; the client goes away
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/chat/completions", json=body, headers={"x-session-id": "gone"}, timeout=1.0)
        left = time.time()
        until(lambda: engine.sent("/chat/completions") and engine.sent("/chat/completions")[0]["closed"], 10.0)
        assert engine.sent("/chat/completions")[0]["closed"] - left < 5.0  # its timeout was 120 s
        until(lambda: not service.turns, 10.0)
        assert service.checks["gone"].turns == 1  # its check recorded: nothing of a reply read
        assert service.checks["gone"].parts["output"]["not_read"] == 1


def test_an_engine_that_falls_silent_mid_stream_ends_the_stream_at_the_idle_timeout():
    """The engine's stream begins, then sends nothing: the client's stream ends with an
    upstream_timeout error event after the idle timeout, and the turn ends."""
    steps = [(0.0, {"content": "a"}, None), (3600.0, {"content": "b"}, "stop")]
    with serving(scripted_stream(steps)) as engine:
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with served(upstream, engine={"idle_timeout_s": 1.0}) as (client, service, _):
            begun = time.monotonic()
            r = client.post("/v1/chat/completions", json=chat(stream=True), headers={"x-session-id": "quiet"})
            assert r.status_code == 200
            events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert events[-1]["error"]["type"] == "upstream_timeout"
            assert "nothing for 1 s" in events[-1]["error"]["message"]
            assert time.monotonic() - begun < 1.0 + 5.0
            until(lambda: not service.turns, 10.0)


def _stalled(port: int, n: int) -> list[socket.socket]:
    """`n` connections that each send a request's headers and half its body, then nothing."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"messages": [' + b" " * 400)
        out.append(s)
    return out


def _unread_stream(port: int) -> socket.socket:
    """A streamed generation whose client never reads a byte of its response."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps(chat("tell a long story", stream=True, max_tokens=4096, ignore_eos=True)).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_stalled_bodies_and_unread_streams_hold_no_slot_for_long():
    """Embedded, two generations at once: 70 connections stall their bodies (8 read at once) and
    two streams of 4,096 tokens are never read. Another client's request is answered within its
    time alone plus the body and write timeouts (and a margin for this shared machine); the
    stalled bodies get 408s, the unread streams' generations stop long before their 4,096 tokens."""
    body_s, write_s = 2.0, 2.0
    with served(limits={"body_timeout_s": body_s, "write_timeout_s": write_s, "max_sending": 8,
                        "max_generating": 2}) as (client, service, _):
        port = client.base_url.port
        begun = time.monotonic()
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        alone_s = time.monotonic() - begun
        with ExitStack() as held:
            stalled = _stalled(port, 70)
            unread = [_unread_stream(port) for _ in range(2)]
            for s in stalled + unread:
                held.callback(s.close)
            until(lambda: sum(t.embedded for t in list(service.turns)) == 2, 10.0)
            time.sleep(0.5)
            begun = time.monotonic()
            r = client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "other"})
            took = time.monotonic() - begun
            assert r.status_code == 200, r.text
            # the unread streams hold their slots until their few kilobytes of buffers fill and a write
            # waits write_s; the 2 s beyond is this shared 2-core machine's margin
            assert took < alone_s + body_s + write_s + 2.0, (took, alone_s)
            refused = stalled[0].recv(4096)
            assert refused.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in refused
            until(lambda: not service.turns, 15.0)  # the unread streams' generations stopped
        outputs = service.status()["counters"]["turn_parts"]["output"]
        assert sum(outputs.values()) == 4  # alone, the two unread (cancelled), the other


def test_health_generate_makes_a_token_embedded_and_through_the_engine_and_caches_it():
    """`GET /health_generate`: embedded, one token from the generator; in proxy mode (in front of
    an embedded `shadow serve`), one token through the engine; the next probe within the cache
    says cached; in front of a hung engine, a 503 at its timeout."""
    with served() as (engine, _, _):
        first = engine.get("/health_generate")
        assert first.status_code == 200 and first.json()["status"] == "ok" and first.json()["generated"] == 1
        assert first.json()["cached"] is False and engine.get("/health_generate").json()["cached"] is True
        with served(str(engine.base_url).rstrip("/") + "/v1", dialect="vllm") as (proxy, _, _):
            through = proxy.get("/health_generate")
            assert through.status_code == 200 and through.json()["cached"] is False, through.text
    with HungEngine() as hung, served(hung.url, probes={"generate_timeout_s": 1.0}) as (proxy, _, _):
        begun = time.monotonic()
        failed = proxy.get("/health_generate")
        assert failed.status_code == 503 and failed.json()["status"] == "failed"
        assert failed.json()["reason"] == "no token within 1 s"
        assert time.monotonic() - begun < 1.0 + 3.0


def test_a_proxied_stream_nobody_reads_closes_its_engine_request_at_the_write_timeout():
    """In front of an engine that streams without end, a client that reads nothing: once its
    few kilobytes of buffers are full and a write has waited the write timeout, the proxy closes
    the client's connection and the engine's request (the engine's stream is closed), and the
    turn ends."""
    closed: list[float] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def endless(request: Request):
        async def events():
            try:
                while True:
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x" * 100},
                                                              "finish_reason": None}]}) + "\n\n"
                    await asyncio.sleep(0.002)
            finally:
                closed.append(time.time())

        return StreamingResponse(events(), media_type="text/event-stream")

    with serving(app) as engine:
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with served(upstream, limits={"write_timeout_s": 2.0}) as (client, service, _):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", client.base_url.port))
            body = json.dumps(chat(stream=True)).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"x-session-id: unread\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            try:
                until(lambda: closed, 20.0)  # the engine's stream closed by the proxy
                until(lambda: not service.turns, 10.0)
                assert service.checks["unread"].turns == 1
            finally:
                s.close()


@pytest.mark.parametrize("bad", [["--body-timeout-s", "-1"], ["--max-sending", "0"], ["--write-timeout-s", "nan"],
                                 ["--engine-connect-timeout-s", "0"], ["--engine-first-byte-timeout-s", "-5"],
                                 ["--engine-idle-timeout-s", "inf"], ["--engine-probe-timeout-s", "0"],
                                 ["--health-generate-timeout-s", "0"]])
def test_a_time_limit_out_of_range_is_refused_before_anything_starts(bad):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    refused = CliRunner().invoke(app, ["serve", *bad, "--port", "1"])
    assert refused.exit_code == 2 and bad[0] in refused.output, refused.output
