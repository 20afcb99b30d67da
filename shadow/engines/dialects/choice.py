"""Which dialect an engine speaks: named, or probed from its own endpoints; said once."""

from __future__ import annotations

import logging
import threading

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


def probe(client: httpx.Client, upstream: str) -> tuple[str, str]:
    """Which dialect the engine speaks, and the evidence: llama.cpp answers `/props` with its
    generation settings; SGLang `/model_info` (or, before 2026, `/get_model_info`); vLLM
    `/version`; `transformers serve` lists `/load_model` in its OpenAPI paths; a `shadow serve`
    embedded engine speaks the vLLM dialect. Anything else is a generic OpenAI-compatible engine."""
    root = engine_root(upstream)

    def get(path: str):
        try:
            r = client.get(root + path, timeout=5)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    props = get("/props")
    if isinstance(props, dict) and ("default_generation_settings" in props or "build_info" in props):
        return "llamacpp", "/props"
    for path in ("/model_info", "/get_model_info"):  # the second deprecated in 2026 releases, the only one before
        info = get(path)
        if isinstance(info, dict) and "model_path" in info:
            return "sglang", path
    status = get("/v1/shadow/status")
    if isinstance(status, dict) and "counters" in status:
        return "vllm", "a shadow serve embedded engine (/v1/shadow/status): the vLLM dialect"
    version = get("/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return "vllm", "/version"
    spec = get("/openapi.json")
    if isinstance(spec, dict) and "/load_model" in (spec.get("paths") or {}):
        return "transformers", "/openapi.json (/load_model)"
    return "openai", "no engine-specific endpoint answered"


class EngineChoice:
    """The dialect of the engine behind the proxy: given, or probed once the engine answers (at
    start; again at a request while it has not answered). Says its choice once, in the log."""

    def __init__(self, upstream: str, dialect: Dialect | str | None, renderer: ChatRenderer | None,
                 eos_id: int | None, template_kwargs: dict | None = None, eos_text: str = "<|im_end|>"):
        self.upstream = upstream
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
            with httpx.Client() as client:
                name, evidence = probe(client, self.upstream)
            if name == "openai" and not _answers(self.upstream):
                return self._make("openai")  # not up yet: look again later
            self.dialect, self.evidence = self._make(name), evidence
            self._say()
            return self.dialect

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


def _answers(upstream: str) -> bool:
    try:
        httpx.get(upstream.rstrip("/") + "/models", timeout=5)
        return True
    except httpx.HTTPError:
        return False
