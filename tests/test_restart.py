"""A stop and a restart as an operator meets them: a stop signal writes every session (the idle
ones first, so an orchestrator's SIGKILL after its grace period finds them on disk), ends turns in
flight within the shutdown timeout even when the engine hangs, and exits 0; a restart on the same
folder restores each session bit for bit and as exact as it was (`exact` and its reason carried in
the file). Real `shadow serve` processes and a real engine on loopback that answers or hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from serving import GRID, free_port, long_text, running, serving, settled, wait_until_read
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore, check_folder
from shadow.offline.verify import compare_states
from shadow.text.chat_template import ChatRenderer, Template, default_hf_tokenizer

pytestmark = pytest.mark.slow  # real servers and processes

TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def renderer() -> ChatRenderer:
    return ChatRenderer(Template(TEMPLATE, "test.jinja"), default_hf_tokenizer())


def engine(mode: dict) -> FastAPI:
    """An OpenAI-compatible engine that answers "ok" and counts the prompt as the template renders
    it (so a turn is verified), or without usage when `mode["usage"]` is False (unverified); with
    `mode["hang"]` set it never answers; `mode["hanging"]` counts the requests it holds."""
    app, r = FastAPI(), renderer()
    mode.setdefault("hanging", 0)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = json.loads(await request.body())
        if mode.get("hang"):
            mode["hanging"] += 1
            await asyncio.sleep(3600)
        out = {"id": "c", "object": "chat.completion",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
        if mode.get("usage", True):
            n = len(r.prompt_ids(body["messages"]))
            out["usage"] = {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2}
        return JSONResponse(out)

    return app


def ask_exactness(client: httpx.Client, name: str) -> dict:
    deadline = time.time() + 60
    while not (status := client.get("/v1/shadow/status").json())["ready"] and time.time() < deadline:
        time.sleep(0.1)  # the shadow is handed out once its costs are measured
    rows = status["sessions"]
    return next(row for row in rows if row["name"] == name)["id_checks"]


def test_a_restart_restores_each_session_bit_for_bit_and_as_exact_as_it_was(tiny, tmp_path):
    mode: dict = {}
    disk = tmp_path / "sessions"
    with serving(engine(mode)) as upstream:
        url = str(upstream.base_url).rstrip("/") + "/v1"
        before = {}
        with running(upstream=url, disk=disk, dialect="openai", renderer=renderer()) as (proxy, service):
            for name, usage in (("verified", True), ("unverified", False)):
                mode["usage"] = usage
                r = proxy.post("/v1/chat/completions", headers={"x-session-id": name},
                               json={"messages": [{"role": "user", "content": long_text(3, 300)}]})
                assert r.status_code == 200
                settled(service)
            wait_until_read(service, ["verified", "unverified"])  # each has a chunk read before the stop
            before = {name: ask_exactness(proxy, name) for name in ("verified", "unverified")}
        assert before["verified"]["exact"] is True and before["unverified"]["exact"] is False
        assert "usage" in before["unverified"]["why_not"]
        with running(upstream=url, disk=disk, dialect="openai", renderer=renderer()) as (proxy, service):
            after = {name: ask_exactness(proxy, name) for name in ("verified", "unverified")}
            assert after == before  # exact, its reason and its counts, before any turn of the new process
            for name in after:
                with service.device.hold(), service.state_lock:
                    s = service.store.get(name)  # restored from its file
                    fresh = service.reader.prefill(s.ids[: s.committed])
                    compared, mismatched, _ = compare_states(s.state, fresh)
                assert s.committed > 0 and compared > 0 and mismatched == []


def test_a_file_whose_record_of_checks_is_bad_restores_as_not_exact(tiny, tmp_path):
    """The record is under the file's digest, so only this build could have written a bad one;
    still, one that is not a record leaves the session not exact, never exact by default."""
    from shadow.core.sessionfile import read_fields
    from shadow.engines.idcheck import SessionChecks

    checks = SessionChecks(verified=1, frontier=10)
    assert SessionChecks.from_record(checks.record(), 10).exact(10)
    for bad in ({**checks.record(), "frontier": 11}, {**checks.record(), "verified": -1}, {"frontier": 1},
                {**checks.record(), "reasons": ["x" * 5000]}, {**checks.record(), "parts": {"prompt": {}}}):
        with pytest.raises(ValueError):
            SessionChecks.from_record(bad, 10)
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None, disk=tmp_path)
    store.annotate = lambda name: {"frontier": 1}
    session = store.get("s")
    reader.feed_prompt(session, list(range(100, 100 + 2 * GRID)))
    reader.advance(session)
    assert store.close() == []
    assert read_fields(store.path_of("s")).checks == {"frontier": 1}
    assert store.records() == {"s": ({"frontier": 1}, 2 * GRID)}


def serve_proxy(port: int, upstream: str, disk: Path, template: Path, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from shadow.cli.main import main; main()", "serve", "--port", str(port),
         "--grid", str(GRID), "--disk", str(disk), "--upstream", upstream, "--engine", "openai",
         "--chat-template", str(template), "--max-concurrent", "64", *more],
        env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(base + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve did not become ready")


def hang_requests(base: str, n: int) -> list[threading.Thread]:
    """`n` clients whose requests the engine holds (each thread ends when serve drops it)."""
    def one(i: int) -> None:
        try:
            httpx.post(base + "/v1/chat/completions", headers={"x-session-id": f"hung{i}"}, timeout=300,
                       json={"messages": [{"role": "user", "content": long_text(100 + i, 50)}]})
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGTERM then SIGKILL"])
def test_a_stop_with_a_hung_engine_writes_every_idle_session_and_exits_0(tiny, tmp_path, stop):
    mode: dict = {}
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    disk = tmp_path / "sessions"
    killed = stop == "SIGTERM then SIGKILL"  # as an operator saw it: 31 idle sessions, 4 requests hung
    names = [f"s{i}" for i in range(31 if killed else 6)]
    hung = 4 if killed else 3
    with serving(engine(mode)) as upstream:
        url = str(upstream.base_url).rstrip("/") + "/v1"
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        timeout = 20.0 if killed else 4.0  # killed: the default, and the SIGKILL comes within 15 s of the SIGTERM
        proc = serve_proxy(port, url, disk, template, "--shutdown-timeout-s", str(timeout))
        try:
            wait_ready(base, proc)
            for i, name in enumerate(names):
                r = httpx.post(base + "/v1/chat/completions", headers={"x-session-id": name}, timeout=120,
                               json={"messages": [{"role": "user", "content": long_text(i, 150)}]})
                assert r.status_code == 200
            deadline = time.time() + 60  # the idle window reads them (a hung engine may hold it off)
            while time.time() < deadline and not all(
                    row["pending"] < GRID for row in httpx.get(base + "/v1/shadow/status").json()["sessions"]):
                time.sleep(0.1)
            mode["hang"] = True
            hang_requests(base, hung)
            deadline = time.time() + 30
            while mode["hanging"] < hung and time.time() < deadline:
                time.sleep(0.05)
            assert mode["hanging"] == hung
            start = time.time()
            proc.send_signal(signal.SIGINT if stop == "SIGINT" else signal.SIGTERM)
            if killed:  # an orchestrator out of patience, before the hung turns' timeout
                deadline = time.time() + 15
                while time.time() < deadline and len([r for r in check_folder(disk) if r.valid]) < len(names):
                    time.sleep(0.05)
                proc.kill()
                proc.wait(timeout=30)
            else:
                code = proc.wait(timeout=timeout + 30)
                out = proc.stdout.read()
                assert code == 0, out
                assert time.time() - start < timeout + 15, out  # the hung turns were cut at the timeout
        finally:
            if proc.poll() is None:
                proc.kill()
    rows = {r.session: r for r in check_folder(disk) if r.valid}
    assert set(names) <= set(rows)  # every idle session, even after the SIGKILL
    loaded, reader = open_reader("tiny", grid=GRID)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None, disk=disk)
    for name in names:
        s = store.get(name)
        fresh = reader.prefill(s.ids[: s.committed])
        compared, mismatched, _ = compare_states(s.state, fresh)
        assert s.committed > 0 and compared > 0 and mismatched == []
        assert store.records()[name][0]["frontier"] == len(s.ids)  # written with its checks: exact after a restart


def test_a_stop_that_cannot_write_a_session_exits_1_and_says_which(tiny, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    disk = tmp_path / "sessions"
    with serving(engine({})) as upstream:
        url = str(upstream.base_url).rstrip("/") + "/v1"
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = serve_proxy(port, url, disk, template)
        try:
            wait_ready(base, proc)
            r = httpx.post(base + "/v1/chat/completions", headers={"x-session-id": "kept"}, timeout=120,
                           json={"messages": [{"role": "user", "content": long_text(1, 150)}]})
            assert r.status_code == 200
            disk.rename(tmp_path / "moved")  # a file where the folder was: every write fails (root too)
            disk.write_text("not a folder")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
            out = proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 1, out
    assert "session kept could not be written" in out
