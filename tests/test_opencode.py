"""A real client: opencode, pointed at `shadow serve` on loopback, drives a multi-request session.
Skipped where opencode is not installed (.ci/run installs it from npm: opencode-ai)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def opencode_binary() -> str | None:
    for candidate in (os.environ.get("OPENCODE_BIN"), str(ROOT / ".ci/opencode/node_modules/.bin/opencode"),
                      shutil.which("opencode")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


OPENCODE = opencode_binary()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(OPENCODE is None, reason="opencode not installed (npm install opencode-ai)")]


def start_serve(*args: str) -> tuple[subprocess.Popen, str]:
    """`shadow serve` (the real CLI) on a free loopback port; its base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", "from shadow.cli.main import main; main()", "serve", "--port", str(port), "--grid", "128", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            httpx.get(base + "/v1/shadow/status", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    return server, base


def run_opencode(tmp_path: Path, base: str, model: str, prompts: list[list[str]]) -> None:
    """opencode (a real client) runs `prompts` in one opencode session against `base`."""
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"shadow": {"npm": "@ai-sdk/openai-compatible", "name": "shadow serve",
                                "options": {"baseURL": base + "/v1"},
                                "models": {model: {"name": model, "limit": {"context": 200000, "output": 32}}}}},
        "model": f"shadow/{model}", "small_model": f"shadow/{model}",
    }))
    # opencode takes its project folder (and so opencode.json) from PWD, not from the cwd
    env = os.environ | {"PWD": str(project), "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                        "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache")}
    for args in prompts:
        run = subprocess.run([OPENCODE, "run", *args], cwd=project, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_an_opencode_session_is_read_by_the_shadow_and_asked(tmp_path, tiny):
    server, base = start_serve()
    try:
        run_opencode(tmp_path, base, "tiny", [["Write hello world in Python."], ["-c", "Now add a docstring."]])
        time.sleep(1.0)
        status = httpx.get(base + "/v1/shadow/status", timeout=30).json()
        assert status["counters"]["requests"] >= 2
        sessions = [r for r in status["sessions"] if r["name"].startswith("ses") and "~" not in r["name"]]
        assert len(sessions) == 1 and sessions[0]["committed"] > 0, status["sessions"]  # opencode's x-session-id
        answer = httpx.post(base + "/v1/shadow/ask", timeout=60, json={
            "session": sessions[0]["name"], "question": "Is this a coding task? A yes, B no", "choices": ["A", "B"],
        }).json()
        assert abs(sum(answer["probs"]) - 1) < 1e-5 and answer["weights"] == "random"
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_opencode_in_front_of_transformers_serve_every_prompt_verified(tmp_path, tiny, big_model, transformers_engine):
    """opencode -> shadow serve (proxy) -> transformers serve: the engine's dialect is found, every
    turn's prompt ids are verified against the engine (its outputs are not read: it shows text
    only, and the next prompt brings them), and opencode's title request (another system prompt,
    the same session id) is read as a side branch, never rolling the session back."""
    journal = tmp_path / "journal.jsonl"
    server, base = start_serve("--upstream", transformers_engine, "--chat-template", str(big_model),
                               "--journal", str(journal))
    try:
        run_opencode(tmp_path, base, big_model.name, [["Write hello world in Python."], ["-c", "Now add a docstring."]])
        deadline = time.time() + 60
        while httpx.get(base + "/v1/shadow/status", timeout=30).json()["turns_in_flight"] and time.time() < deadline:
            time.sleep(0.2)
        status = httpx.get(base + "/v1/shadow/status", timeout=30).json()
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert status["engine"]["dialect"] == "transformers"
    turns = [r for r in map(json.loads, journal.read_text().splitlines()) if r.get("kind") == "turn"]
    assert len(turns) >= 3, turns  # two conversation requests and at least one title request
    assert all(t["prompt_check"] == "verified" and t["output_check"] == "not_read" for t in turns), turns
    assert not any(t["verified"] is False for t in turns), turns
    named = [s["name"] for s in status["sessions"] if s["name"].startswith("ses") and "~" not in s["name"]]
    assert len(named) == 1, status["sessions"]
    branches = status["branches"].get(named[0])
    assert branches, status["branches"]  # the title request beside the conversation (whichever came first)
    rows = [s for s in status["sessions"] if s["name"] in [named[0], *branches]]
    assert all(s["rollbacks"] == 0 and s["id_checks"]["exact"] is True for s in rows), rows
    conversation = max(rows, key=lambda s: s["committed"] + s["pending"])
    assert conversation["committed"] + conversation["pending"] > 5000, rows  # opencode's tool definitions were read


def opencode_parts(home: Path) -> list[dict]:
    """The parts opencode stored for its sessions (its sqlite database), oldest first."""
    import sqlite3

    db = sqlite3.connect(home / ".local/share/opencode/opencode.db")
    try:
        rows = db.execute("select data from part order by time_created, id").fetchall()
    finally:
        db.close()
    return [json.loads(r[0]) for r in rows]


def test_opencode_renders_status_lines_as_reasoning_parts_of_their_own(tmp_path, tiny):
    """opencode -> shadow serve (proxy, --status-channel auto: opencode gets `inline`) -> an engine
    that takes 3.5 s to its first token: opencode stores the line as a reasoning part of its own,
    titled by the line, before the model's own reasoning part and the answer's text part."""


    sys.path.insert(0, str(ROOT / "tests"))
    from serving import serving
    from test_status import slow_engine

    with serving(slow_engine([], 3.5)) as engine:
        template = ROOT.parent / "shared" / "data" / "templates" / "qwen3.5.jinja"
        if not template.is_file():
            pytest.skip(f"no Qwen3.5 template at {template}")
        server, base = start_serve("--upstream", str(engine.base_url).rstrip("/") + "/v1", "--engine", "openai",
                                   "--chat-template", str(template))
        try:
            run_opencode(tmp_path, base, "m", [["Say hi."]])
        finally:
            server.terminate()
            server.wait(timeout=60)
    parts = opencode_parts(tmp_path / "home")
    kinds = [(p["type"], p.get("text", "")) for p in parts if p["type"] in ("reasoning", "text")]
    # the line: reading (or, behind opencode's title request on the engine's one slot, waiting)
    line = next((i for i, (t, x) in enumerate(kinds) if t == "reasoning" and ("\u2063› reading" in x
                                                                              or "\u2063› waiting" in x)), None)
    model = next((i for i, (t, x) in enumerate(kinds) if t == "reasoning" and x == "hm"), None)
    answer = next((i for i, (t, x) in enumerate(kinds) if t == "text" and x == "ok"), None)
    assert None not in (line, model, answer) and line < model < answer, kinds  # in time order, each its own part
    assert kinds[line][1].startswith("**")

