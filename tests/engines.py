"""Real engines on loopback for the tests: Hugging Face `transformers serve` over a random-weight
big-model folder (`shadow.engines.bigmodel`) with the real Qwen3.5 vocabulary and chat template."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conftest import SHARED_DATA
from serving import free_port

TEMPLATE = SHARED_DATA / "templates" / "qwen3.5.jinja"


def qwen_template() -> Path:
    if not TEMPLATE.is_file():
        pytest.skip(f"the Qwen3.5 chat template is not at {TEMPLATE} (../shared/data, or SHADOW_SHARED_DATA)")
    return TEMPLATE


def transformers_serve_missing() -> str | None:
    try:
        import transformers.cli.serving.server  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not installed with [serving]
        return f"transformers serve is not installed (pip install 'transformers[serving]'): {type(e).__name__}: {e}"
    return None


@contextmanager
def transformers_serve(folder: Path, log: Path):
    """`transformers serve FOLDER` on a free loopback port, CPU, one thread; yields its /v1 URL.
    The folder is named relative to its parent, so the served model's id is the folder's name
    (a client asks for `model: qwen3.5-tiny-big`, not a path)."""
    missing = transformers_serve_missing()
    if missing:
        pytest.skip(missing)
    port = free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", folder.name,
             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder.parent)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"transformers serve exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError(f"transformers serve did not start: {log.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
