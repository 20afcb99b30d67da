"""The quickstart's CPU path, run as written: the fenced bash blocks of its section of
docs/QUICKSTART.md, in order, in one bash with `set -euo pipefail`, with only the variables the
doc names (SHADOW_DEMO, ENGINE_PORT, SHADOW_PORT) set to a scratch folder and free ports. They
write a random-weight big model, serve it with a real `transformers serve`, run check-engine, a
real `shadow serve` in front of it, a client turn, an ask and `shadow ab`, and stop both servers.
The install block is the one left out: this environment is the install.

Also here, the first thing a newcomer may meet: check-engine in front of an engine that refuses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines import refusing_engine, transformers_serve_missing
from serving import free_port, serving
from shadow.cli.main import app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "QUICKSTART.md"
SECTION = "## On a CPU, first"


def cpu_blocks() -> list[str]:
    """The bash blocks of the CPU path's section, in order."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```bash\n(.*?)```", text[start:end], re.S)


def test_the_cpu_path_runs_as_written(tmp_path):
    missing = transformers_serve_missing()
    if missing:
        pytest.skip(missing)
    blocks = cpu_blocks()
    install = [b for b in blocks if "pip install" in b]
    assert len(install) == 1 and len(blocks) >= 7, blocks
    script = "set -euo pipefail\n" + "\n".join(b for b in blocks if b not in install)
    demo = tmp_path / "demo"
    env = os.environ | {"SHADOW_DEMO": str(demo), "ENGINE_PORT": str(free_port()), "SHADOW_PORT": str(free_port()),
                        "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1200)
    finally:
        try:  # the servers the script started, where it stopped before its last block
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in demo.glob("*.log"))
    assert proc.returncode == 0, out[-6000:] + logs
    assert "engine dialect transformers" in out
    assert re.search(r"14 of 14 requests verified|\d+ of 14 requests verified \(prompt and output\), 0 mismatched, "
                     r"\d+ not verified, 0 failed", out), out
    assert "prompts: 14 verified, 0 unverified, 0 mismatched" in out, out
    answer = next(json.loads(line) for line in out.splitlines() if line.startswith("{") and '"probs"' in line)
    assert answer["choices"] == ["A", "B"] and len(answer["probs"]) == 2 and answer["exact"] is True
    # ab in front of transformers serve: the vLLM fields dropped, said so, and its verdict let through
    for field in ("ignore_eos", "min_tokens", "return_token_ids"):
        assert f"the engine does not take {field}" in out, out
    assert "the verdict is not significant" in out or "passed" in out, out
    for name in ("engine.pid", "shadow.pid"):  # the last block stopped both
        assert ended(int((demo / name).read_text())), name


def ended(pid: int, timeout_s: float = 60.0) -> bool:
    """Whether process `pid` exits within `timeout_s` (a zombie no one reaps has exited)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.2)
    return False


def test_check_engine_names_each_failed_request_with_the_engines_message():
    """A real engine on loopback that answers /v1/models and refuses every completion as
    `transformers serve` refuses unknown fields (422, FastAPI's `detail`): each failed request is
    named with its status and the engine's message, cut to 200 characters, in the table, the lines
    below it and --json's `error`; the exit code is 1."""
    detail = "Unexpected fields in the request: {'return_token_ids'} " + "x" * 400
    engine = refusing_engine({"detail": detail}, 422)
    with serving(engine) as client:
        result = CliRunner().invoke(app, ["check-engine", f"{client.base_url}/v1", "--engine", "vllm",
                                          "--long-words", "100", "--json"], terminal_width=400)
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    expected = f"HTTP 422: {detail[:200]}"
    assert [r["error"] for r in doc["requests"]] == [expected] * doc["summary"]["requests"]
    assert doc["summary"]["failed"] == doc["summary"]["requests"] == 14
    words = " ".join(result.output.split())  # the console wraps long lines
    assert "failed because" in words and "│ HTTP 422: Unexpected fields in the request" in words
    assert all(f"failed: {r['case']} #{r['request']}: {expected}" in words for r in doc["requests"])
