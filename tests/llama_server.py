"""A real llama.cpp `llama-server` on a free loopback port, for tests.

The binary comes from `experiments/build_llama_server.sh`: $SHADOW_LLAMA_SERVER when set, else
$SHADOW_LLAMA_HOME/bin/llama-server, else ~/.cache/shadow/engines/llama-server-0.3.36/bin/llama-server.
When it is absent the calling test is skipped, saying how to build it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

VERSION = "0.3.36"


def binary() -> Path:
    """Where the llama-server binary is expected (it may not exist)."""
    if os.environ.get("SHADOW_LLAMA_SERVER"):
        return Path(os.environ["SHADOW_LLAMA_SERVER"])
    home = os.environ.get("SHADOW_LLAMA_HOME") or Path.home() / ".cache" / "shadow" / "engines" / f"llama-server-{VERSION}"
    return Path(home) / "bin" / "llama-server"


def require_binary() -> Path:
    path = binary()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.skip(f"llama-server not built at {path}: run `bash experiments/build_llama_server.sh` "
                    "(or set SHADOW_LLAMA_SERVER to a llama-server binary)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(gguf_path: Path | str | None, template_path: Path | str | None = None, *, ctx: int = 16384,
                 slots: int = 1, threads: int = 2, extra: list[str] | tuple[str, ...] = (),
                 timeout: float = 120.0) -> Iterator[str]:
    """Start `llama-server -m gguf_path --jinja` (plus `--chat-template-file` when given, and
    `extra` arguments) on a free loopback port with context `ctx` and `slots` slots; wait until
    `/health` answers 200; yield the base URL (`http://127.0.0.1:PORT`); kill it on exit. The
    server's log is in the failure message when it does not come up. LLAMA_ARG_* variables of the
    environment are not passed on (they would change the server's options)."""
    exe = require_binary()
    port = free_port()
    model = ["-m", str(gguf_path)] if gguf_path is not None else []  # None: a router (`--models-dir` in extra)
    cmd = [str(exe), *model, "--host", "127.0.0.1", "--port", str(port), "--jinja",
           "-c", str(ctx), "-np", str(slots), "-t", str(threads), "--no-webui"]
    if template_path is not None:
        cmd += ["--chat-template-file", str(template_path)]
    cmd += list(extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, timeout, log)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    log.seek(0)
    tail = log.read().decode("utf-8", "replace")[-4000:]
    raise RuntimeError(f"llama-server did not become healthy (exit {proc.poll()}):\n{tail}")
