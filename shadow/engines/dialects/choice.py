"""Which dialect an engine speaks: named, or probed from its own endpoints; said once."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from shadow.text.chat_template import ChatRenderer
from shadow.engines.dialects.base import Dialect
from shadow.engines.dialects.engines import VLLM, LlamaCpp, SGLang, Transformers

log = logging.getLogger("shadow.proxy")

ENGINES = ("vllm", "sglang", "llamacpp", "transformers", "openai")
DIALECTS = {d.name: d for d in (VLLM, SGLang, LlamaCpp, Transformers, Dialect)}


def engine_root(upstream: str) -> str:
    """The engine's root URL: the upstream base without its trailing /v1."""
    base = upstream.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


PROBE_PATHS = ("/props", "/model_info", "/get_model_info", "/v1/shadow/status", "/version", "/openapi.json")


def probe(client: httpx.Client, upstream: str, timeout_s: float = 5.0) -> tuple[str, str]:
    """Which dialect the engine speaks, and the evidence: llama.cpp answers `/props` with its
    generation settings; SGLang `/model_info` (or, before 2026, `/get_model_info`); vLLM
    `/version`; `transformers serve` lists `/load_model` in its OpenAPI paths; a `shadow serve`
    embedded engine speaks the vLLM dialect. Anything else is a generic OpenAI-compatible engine.
    Every endpoint is asked at once, each within `timeout_s`: a hung engine costs `timeout_s`."""
    root = engine_root(upstream)

    def get(path: str):
        try:
            r = client.get(root + path, timeout=timeout_s)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    with ThreadPoolExecutor(max_workers=len(PROBE_PATHS), thread_name_prefix="shadow-probe") as pool:
        props, model_info, old_info, status, version, spec = pool.map(get, PROBE_PATHS)
    if isinstance(props, dict) and ("default_generation_settings" in props or "build_info" in props):
        return "llamacpp", "/props"
    for path, info in (("/model_info", model_info), ("/get_model_info", old_info)):  # the second deprecated in 2026
        if isinstance(info, dict) and "model_path" in info:
            return "sglang", path
    if isinstance(status, dict) and "counters" in status:
        return "vllm", "a shadow serve embedded engine (/v1/shadow/status): the vLLM dialect"
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return "vllm", "/version"
    if isinstance(spec, dict) and "/load_model" in (spec.get("paths") or {}):
        return "transformers", "/openapi.json (/load_model)"
    return "openai", "no engine-specific endpoint answered"


class EngineChoice:
    """The dialect of the engine behind the proxy: given, or probed once the engine answers (at
    start, beside the service: `begin`; again at a request while it has not answered: `settled`).
    Says its choice once, in the log. A probe takes at most about `probe_timeout_s`."""

    def __init__(self, upstream: str, dialect: Dialect | str | None, renderer: ChatRenderer | None,
                 eos_id: int | None, template_kwargs: dict | None = None, eos_text: str = "<|im_end|>",
                 *, probe_timeout_s: float = 5.0):
        self.upstream, self.probe_timeout_s = upstream, probe_timeout_s
        self._probing: asyncio.Future | None = None  # the probe in flight (on the event loop)
        self.on_chosen: Callable[[], None] = lambda: None  # told once a probe ends
        self.renderer, self.eos_id, self.eos_text = renderer, eos_id, eos_text
        self.template_kwargs = template_kwargs
        self.evidence = "given"
        self._lock = threading.Lock()
        self.dialect: Dialect | None = None
        if isinstance(dialect, Dialect):
            self.dialect = dialect
        elif dialect is not None:
            if dialect not in DIALECTS:
                raise ValueError(f"no engine dialect {dialect!r} (dialects: {', '.join(ENGINES)})")
            self.dialect = self._make(dialect)
        if self.dialect is not None:
            self._say()

    def choose(self) -> Dialect:
        """The dialect (probing the engine the first time it answers; a generic one meanwhile)."""
        with self._lock:
            if self.dialect is not None:
                return self.dialect
            with ThreadPoolExecutor(max_workers=1) as pool, httpx.Client() as client:
                answers = pool.submit(_answers, self.upstream, self.probe_timeout_s)  # beside the probe
                name, evidence = probe(client, self.upstream, self.probe_timeout_s)
                if name == "openai" and not answers.result():
                    return self._make("openai")  # not up yet: look again later
            self.dialect, self.evidence = self._make(name), evidence
            self._say()
            return self.dialect

    @property
    def probing(self) -> bool:
        """Whether a probe is in flight now."""
        return self._probing is not None and not self._probing.done()

    async def probe_ended(self, timeout_s: float) -> bool:
        """Whether no probe is in flight, after waiting up to `timeout_s` for the one that is."""
        if self.probing:
            await asyncio.wait({self._probing}, timeout=timeout_s)
        return not self.probing

    def begin(self) -> None:
        """On the event loop: probe the engine beside whatever runs (nothing waits for it), unless
        its dialect is known or a probe is in flight."""
        if self.dialect is None and not self.probing:
            self._probing = asyncio.ensure_future(asyncio.to_thread(self.choose))
            self._probing.add_done_callback(self._ended)

    async def settled(self) -> Dialect:
        """The dialect for a request: known, or the probe's (begun, or joined if in flight); a
        generic one while the engine has not answered."""
        if self.dialect is not None:
            return self.dialect
        self.begin()
        try:
            return await asyncio.shield(self._probing)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - said in the log (`_ended`); the request goes on
            return self._make("openai")

    def _ended(self, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.warning("the engine's dialect probe failed: %s", done.exception())
        self.on_chosen()

    def _make(self, name: str) -> Dialect:
        return DIALECTS[name](self.renderer, eos_text=self.eos_text, eos_id=self.eos_id,
                              template_kwargs=self.template_kwargs)

    def _say(self) -> None:
        log.info("%s [%s]", self.dialect.describe(), self.evidence)

    def describe(self) -> dict:
        d = self.dialect
        return {"upstream": self.upstream, "dialect": d.name if d else None, "evidence": self.evidence if d else None,
                "prompt_ids": d.prompt_source if d else None, "output_ids": d.output_source if d else None,
                "template": self.renderer.origin if self.renderer else None}


def _answers(upstream: str, timeout_s: float = 5.0) -> bool:
    try:
        httpx.get(upstream.rstrip("/") + "/models", timeout=timeout_s)
        return True
    except httpx.HTTPError:
        return False
