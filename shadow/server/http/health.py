"""The probes an orchestrator asks (Kubernetes' liveness and readiness, a load balancer's check):

- `GET /health`, liveness: the process answers and its device thread runs jobs. Each probe hands
  the device a no-op job and waits at most `probes.wait_s` for it; one job runs at a time, so a
  long one (a model load, an embedded generation, a long ask) keeps it waiting, and that is no
  failure until the no-op has waited `probes.stuck_s`. 200 `{"status": "ok", "device":
  "answered" | "busy", "waited_s", ...}`, or 503 `{"status": "stuck" | "stopped", ...}`. It
  answers from the start, while the engine's dialect is probed.
- `GET /ready`, readiness: the shadow's model is loaded (or parked on disk after an idle burst:
  the next turn loads it again) and, in proxy mode, the engine's dialect probe is over (waited
  for up to `probes.engine_timeout_s`; `"probing"` while it still runs) and the engine answers
  `GET {upstream}/models` with a status below 500 within `probes.engine_timeout_s`. 200 `{"ready": true, ...}`, or 503 `{"ready": false,
  "reason": ...}`.
- `GET /health_generate` (as SGLang's): one token generated now, through the engine (proxy: a
  one-token greedy chat completion sent straight to it, no turn) or by the embedded generator
  (on the device thread, between other requests' slices), within `probes.generate_timeout_s`.
  An answer serves the probes of the next `probes.generate_cache_s` (`"cached": true`); probes
  that come while one generates wait for it. 200 `{"status": "ok", "generated": 1, "seconds",
  "cached"}`, or 503 `{"status": "failed", "reason", "cached"}`.

None changes the shadow's state. Without a key only with `Access.probes_without_key`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from shadow.server.service import ShadowService


class Probes:
    """Liveness and readiness of `service`; `parts` shows the app's parts when asked (held weakly
    by the app): `proxy` (None in embedded mode, or before the app started), `engine` (the
    proxy's `EngineChoice`, else None) and `embedded` (the embedded completions, else None)."""

    def __init__(self, service: ShadowService, parts):
        self.service, self.parts = service, parts
        self.settings = service.settings.probes
        self._probe: Future | None = None  # the no-op in flight on the device
        self._since = 0.0  # when it was handed in (monotonic)
        self._generated: tuple[float, int, dict] | None = None  # (when, status, body) of the last generation
        self._generating: asyncio.Future | None = None  # the generation in flight

    def routes(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/ready", self.ready, methods=["GET"])
        router.add_api_route("/health_generate", self.health_generate, methods=["GET"])
        return router

    async def health(self) -> JSONResponse:
        """Liveness: 200 while the device thread runs jobs (or runs one for less than `stuck_s`)."""
        device = self.service.device
        if self._probe is None or self._probe.done():
            try:
                self._probe, self._since = device.submit(lambda: None, "health"), time.monotonic()
            except RuntimeError:  # closed: a planned stop is under way
                return JSONResponse({"status": "stopped"}, status_code=503)
        probe = self._probe
        done, _ = await asyncio.wait({asyncio.wrap_future(probe)}, timeout=self.settings.wait_s)
        waited = round(time.monotonic() - self._since, 3)
        if done:
            return JSONResponse({"status": "ok", "device": "answered", "waited_s": waited})
        body = {"device": "busy", "running": device.running, "waited_s": waited}
        if waited < self.settings.stuck_s:
            return JSONResponse({"status": "ok", **body})
        return JSONResponse({"status": "stuck", **body}, status_code=503)

    async def ready(self) -> JSONResponse:
        """Readiness: 200 when the shadow is loaded (or parked) and the engine answers; else 503 with why."""
        service = self.service
        host = service.host
        if host.ready.is_set():
            shadow = "loaded"
        elif host.load_error is not None:
            return _not_ready(f"the shadow failed to load: {host.load_error}")
        elif service.counters.unloads and host.weights:
            shadow = "parked"  # let go after an idle burst: the next turn or ask loads it again
        else:
            return _not_ready("the shadow is loading its model")
        body = {"ready": True, "shadow": shadow}
        if service.settings.proxy:
            engine = self.parts.engine
            if engine is not None and engine.dialect is None \
                    and not await engine.probe_ended(self.settings.engine_timeout_s):
                return _not_ready("probing the engine's dialect", probing=True)
            down = await self._engine_down()
            if down is not None:
                return _not_ready(down)
            body["engine"] = "reachable"
        return JSONResponse(body)

    async def _engine_down(self) -> str | None:
        """Why the engine is not ready (None: it answered `/models` below 500)."""
        proxy = self.parts.proxy
        if proxy is None:
            return "the proxy has not started"
        try:
            r = await proxy.client.get(proxy.upstream + "/models", headers=proxy.engine_headers({}),
                                       timeout=self.settings.engine_timeout_s)
        except httpx.HTTPError as e:
            return f"the engine at {proxy.upstream} is unreachable: {type(e).__name__}"
        if r.status_code >= 500:
            return f"the engine at {proxy.upstream} answered {r.status_code}"
        return None


    async def health_generate(self) -> JSONResponse:
        """One token generated now (or within the last `generate_cache_s`): 200, else 503 with why."""
        now = time.monotonic()
        last = self._generated
        if last is not None and now - last[0] < self.settings.generate_cache_s:
            return JSONResponse(last[2] | {"cached": True}, status_code=last[1])
        if self._generating is None or self._generating.done():
            self._generating = asyncio.ensure_future(self._generate())
        status, body = await asyncio.shield(self._generating)
        return JSONResponse(body | {"cached": False}, status_code=status)

    async def _generate(self) -> tuple[int, dict]:
        start = time.monotonic()
        limit = self.settings.generate_timeout_s
        try:
            async with asyncio.timeout(limit):
                if self.service.settings.proxy:
                    failed = await self._engine_generates()
                else:
                    failed = await self._embedded_generates()
        except TimeoutError:
            failed = f"no token within {limit:g} s"
        seconds = round(time.monotonic() - start, 3)
        if failed is None:
            status, body = 200, {"status": "ok", "generated": 1, "seconds": seconds}
        else:
            status, body = 503, {"status": "failed", "reason": failed, "seconds": seconds}
        self._generated = (time.monotonic(), status, body)
        return status, body

    async def _engine_generates(self) -> str | None:
        """Why the engine did not generate a token (None: it did). The model is the first the
        engine lists, where it lists one."""
        proxy = self.parts.proxy
        if proxy is None:
            return "the proxy has not started"
        headers = proxy.engine_headers({})
        request = {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1, "temperature": 0,
                   "stream": False}
        try:
            listed = await proxy.client.get(proxy.upstream + "/models", headers=headers)
            models = listed.json().get("data") if listed.status_code == 200 else None
            if isinstance(models, list) and models and isinstance(models[0], dict) and "id" in models[0]:
                request["model"] = models[0]["id"]
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        try:
            r = await proxy.client.post(proxy.upstream + "/chat/completions", json=request, headers=headers)
        except httpx.HTTPError as e:
            return f"the engine at {proxy.upstream} is unreachable: {type(e).__name__}"
        if r.status_code != 200:
            return f"the engine at {proxy.upstream} answered {r.status_code}"
        try:
            choices = r.json()["choices"]
            ok = isinstance(choices, list) and len(choices) > 0
        except (ValueError, KeyError, TypeError):
            ok = False
        return None if ok else f"the engine at {proxy.upstream} answered without a choice"

    async def _embedded_generates(self) -> str | None:
        """Why the embedded generator did not generate a token (None: it did): one greedy token
        after a short prompt, on the device thread, between other requests' slices."""
        embedded = self.parts.embedded
        if embedded is None:
            return "no embedded generator"
        generator, service = embedded.engine.generator, self.service
        prompt = embedded.tokenizer.encode("Say OK.")

        def one() -> int:
            return next(iter(generator.generate(prompt, 1)))

        try:
            await asyncio.to_thread(service.run_request, one)
        except Exception as e:  # noqa: BLE001 - the probe says why
            return f"the generator failed: {type(e).__name__}: {e}"
        return None


def _not_ready(reason: str, **more) -> JSONResponse:
    return JSONResponse({"ready": False, "reason": reason, **more}, status_code=503)
