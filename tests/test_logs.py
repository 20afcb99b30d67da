"""`shadow serve --log-format json`: a real served session (the CLI as a process, a proxy in front
of a scripted engine on loopback), its stderr read line by line. Every line is one JSON object;
the levels mean what docs/SERVE.md says; no line carries the prompt's or the question's text."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest
from typer.testing import CliRunner

from shadow.cli.main import app
from scripted import TEMPLATE, quiet_engine
from serving import free_port, serving
from shadow.server import logs

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

SECRET = [f"zq{i}marmalade" for i in range(40)]  # words no log line has any business carrying


@contextmanager
def served(tmp_path, upstream: str, *options: str):
    """`shadow serve` as a process (a proxy in front of `upstream`, JSON logs, `options`), ready;
    yields (its base URL, a function that stops it with SIGTERM and returns its stderr's records)."""
    template = tmp_path / "big.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from shadow.cli.main import main; main()", "serve", "--port", str(port), "--grid", "128",
         "--upstream", upstream, "--chat-template", str(template), "--disk", str(tmp_path / "disk"),
         "--log-format", "json", "--no-voice", *options],
        env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def stop() -> list[dict]:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        records = []
        for line in err.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"not one JSON object: {line!r}") from None
        return records

    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "shadow serve did not become ready"
            time.sleep(0.2)
        yield base, stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_json_logs_of_a_served_session_parse_and_carry_no_prompt_text(tiny, tmp_path):
    with serving(quiet_engine({"usage": True, "prompt_tokens": 5})) as engine:  # counts that cannot match
        with served(tmp_path, str(engine.base_url).rstrip("/") + "/v1") as (base, stop):
            messages = [{"role": "user", "content": " ".join(SECRET)}]
            for _ in range(2):  # two mismatched turns of one session: one warning
                with httpx.stream("POST", base + "/v1/chat/completions", headers={"x-session-id": "m"}, timeout=60,
                                  json={"messages": messages, "stream": True}) as r:
                    assert r.status_code == 200 and "[DONE]" in r.read().decode()
                messages += [{"role": "assistant", "content": "Hello there again"},
                             {"role": "user", "content": " ".join(reversed(SECRET))}]
            ask = httpx.post(base + "/v1/shadow/ask", timeout=60,
                             json={"session": "m", "question": "Is zq7marmalade A or B?", "choices": ["A", "B"]})
            assert ask.status_code == 200
            records = stop()
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert not [r for r in records if any(word in json.dumps(r) for word in SECRET)]
    said = [(r["level"], r["logger"], r["message"]) for r in records]
    assert any(level == "INFO" and logger == "shadow.proxy" and "openai" in message for level, logger, message in said)
    mismatches = [r for r in records if "does not match the engine" in r["message"]]
    assert len(mismatches) == 1 and mismatches[0]["level"] == "WARNING" and "session m" in mismatches[0]["message"]
    assert any(r["level"] == "INFO" and r["message"].startswith("stopped: 1 session(s) ") for r in records)
    assert not [r for r in records if r["level"] in ("ERROR", "CRITICAL")]
    access = [r for r in records if r["logger"] == "shadow.access"]  # one a request, the probes' included
    chats = [r for r in access if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 2 and all(r["method"] == "POST" and r["status"] == 200 and r["session"] == "m"
                                   and r["bytes"] > 0 and 0 < r["duration_s"] < 60 for r in chats)
    assert [r["status"] for r in access if r["path"] == "/v1/shadow/ask"] == [200]


def test_log_level_warning_leaves_out_the_info_lines_and_keeps_the_refusals(tiny, tmp_path):
    """`--log-level warning`: no INFO line (no access line), the warning of a refused request kept."""
    with serving(quiet_engine()) as engine:
        with served(tmp_path, str(engine.base_url).rstrip("/") + "/v1", "--log-level", "warning") as (base, stop):
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, headers={"x-session-id": "w"},
                              json={"messages": [{"role": "user", "content": "hello"}], "stream": True}) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            assert httpx.post(base + "/v1/chat/completions", content=b"{", timeout=60).status_code == 400
            records = stop()
    assert not [r for r in records if r["level"] in ("DEBUG", "INFO")]
    refused = [r for r in records if r["logger"] == "shadow.http"]
    assert len(refused) == 1 and refused[0]["level"] == "WARNING"
    assert refused[0]["message"].startswith("400 POST /v1/chat/completions: the body is refused")


def test_a_line_carries_the_session_and_turn_it_was_logged_under(tiny):
    """From the call's `extra`, else from what the request bound (carried into `asyncio.to_thread`)."""
    stream = io.StringIO()
    log = logging.getLogger("shadow.test.logs")
    log.addHandler(logs.handler("json", stream))
    log.setLevel(logging.INFO)
    log.propagate = False

    async def request():
        logs.bind(turn=7, session="s1")
        await asyncio.to_thread(log.info, "in a thread of the request")
        log.warning("given", extra={"session": "other", "turn": 8})

    try:
        log.info("outside any request")
        asyncio.run(request())
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("with a traceback")
    finally:
        log.handlers.clear()
    first, second, third, fourth = map(json.loads, stream.getvalue().splitlines())
    assert "session" not in first and "turn" not in first and first["level"] == "INFO"
    assert (second["session"], second["turn"], second["message"]) == ("s1", 7, "in a thread of the request")
    assert (third["session"], third["turn"], third["level"]) == ("other", 8, "WARNING")
    assert "session" not in fourth and "ValueError: boom" in fourth["exception"] and fourth["level"] == "ERROR"


def test_an_unknown_log_format_is_refused_before_anything_starts():
    result = CliRunner().invoke(app, ["serve", "--log-format", "xml"])
    assert result.exit_code == 2 and "--log-format must be one of text, json" in result.output


def test_an_unknown_log_level_is_refused_before_anything_starts():
    result = CliRunner().invoke(app, ["serve", "--log-level", "loud"])
    assert result.exit_code == 2 and "--log-level must be one of debug, info, warning, error" in result.output
