"""Real engines on loopback for the tests: Hugging Face `transformers serve` over a random-weight
big-model folder (`shadow.engines.bigmodel`) with the real Qwen3.5 vocabulary and chat template;
and `HungEngine`, a TCP server that reads requests and answers none, noting when each request's
connection closes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
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


class HungEngine:
    """An engine that hangs: it accepts connections on a free loopback port, reads what comes and
    never answers. `requests` holds one dict per request line seen (`path`, `at`, `closed`: when
    its connection closed, None while open), in arrival order."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/v1"
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        mine: list[dict] = []
        data = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            data += chunk
            while b"\r\n" in data and data.split(b"\r\n", 1)[0].split(b" ")[0] in (b"GET", b"POST"):
                line, data = data.split(b"\r\n", 1)
                record = {"path": line.split(b" ")[1].decode(), "at": time.time(), "closed": None}
                with self.lock:
                    self.requests.append(record)
                mine.append(record)
                data = b""  # headers and body: nothing more is parsed on this connection
        with self.lock:
            for record in mine:
                record["closed"] = time.time()

    def sent(self, path: str) -> list[dict]:
        with self.lock:
            return [dict(r) for r in self.requests if r["path"].endswith(path)]

    def close(self) -> None:
        self.server.close()
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass

    def __enter__(self) -> "HungEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def refusing_engine(body: dict, status: int):
    """An OpenAI-compatible engine (a FastAPI app) that lists one model and answers every
    completion with `status` and `body`, as an engine refusing the request does."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    engine = FastAPI()

    @engine.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @engine.post("/v1/chat/completions")
    @engine.post("/v1/completions")
    async def refuse():
        return JSONResponse(body, status_code=status)

    return engine
