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
pytestmark = pytest.mark.skipif(OPENCODE is None, reason="opencode not installed (npm install opencode-ai)")


def test_an_opencode_session_is_read_by_the_shadow_and_asked(tmp_path, tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "serve", "--port", str(port), "--grid", "128"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(base + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        project, home = tmp_path / "project", tmp_path / "home"
        project.mkdir()
        home.mkdir()
        (project / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"shadow": {"npm": "@ai-sdk/openai-compatible", "name": "shadow serve",
                                    "options": {"baseURL": base + "/v1"},
                                    "models": {"tiny": {"name": "tiny", "limit": {"context": 200000, "output": 64}}}}},
            "model": "shadow/tiny", "small_model": "shadow/tiny",
        }))
        # opencode takes its project folder (and so opencode.json) from PWD, not from the cwd
        env = os.environ | {"PWD": str(project), "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                            "XDG_DATA_HOME": str(home / ".local/share"), "XDG_CACHE_HOME": str(home / ".cache")}
        for args in (["Write hello world in Python."], ["-c", "Now add a docstring."]):
            run = subprocess.run([OPENCODE, "run", *args], cwd=project, env=env, capture_output=True, text=True,
                                 timeout=240)
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        time.sleep(1.0)
        status = httpx.get(base + "/v1/shadow/status", timeout=30).json()
        assert status["counters"]["requests"] >= 2
        sessions = [r for r in status["sessions"] if r["name"].startswith("ses")]  # opencode's x-session-id
        assert len(sessions) == 1 and sessions[0]["committed"] > 0, status["sessions"]
        answer = httpx.post(base + "/v1/shadow/ask", timeout=60, json={
            "session": sessions[0]["name"], "question": "Is this a coding task? A yes, B no", "choices": ["A", "B"],
        }).json()
        assert abs(sum(answer["probs"]) - 1) < 1e-5 and answer["weights"] == "random"
    finally:
        server.terminate()
        server.wait(timeout=60)
