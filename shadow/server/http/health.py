"""The probes an orchestrator asks (Kubernetes' liveness and readiness, a load balancer's check):

- `GET /health`, liveness: the process answers and its device thread runs jobs. Each probe hands
  the device a no-op job and waits at most `probes.wait_s` for it; one job runs at a time, so a
  long one (a model load, an embedded generation, a long ask) keeps it waiting, and that is no
  failure until the no-op has waited `probes.stuck_s`. 200 `{"status": "ok", "device":
  "answered" | "busy", "waited_s", ...}`, or 503 `{"status": "stuck" | "stopped", ...}`.
- `GET /ready`, readiness: the shadow's model is loaded (or parked on disk after an idle burst:
  the next turn loads it again) and, in proxy mode, the engine answers `GET {upstream}/models`
  with a status below 500 within `probes.engine_timeout_s`. 200 `{"ready": true, ...}`, or 503
  `{"ready": false, "reason": ...}`.

Neither changes any state. Without a key only with `Access.probes_without_key`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from shadow.server.http.proxy import Proxy
from shadow.server.service import ShadowService


class Probes:
    """Liveness and readiness of `service`; `proxy()` is the proxy (None in embedded mode, or
    before the app started)."""

    def __init__(self, service: ShadowService, proxy: Callable[[], Proxy | None]):
        self.service, self.proxy = service, proxy
        self.settings = service.settings.probes
        self._probe: Future | None = None  # the no-op in flight on the device
        self._since = 0.0  # when it was handed in (monotonic)

    def routes(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/ready", self.ready, methods=["GET"])
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
            down = await self._engine_down()
            if down is not None:
                return _not_ready(down)
            body["engine"] = "reachable"
        return JSONResponse(body)

    async def _engine_down(self) -> str | None:
        """Why the engine is not ready (None: it answered `/models` below 500)."""
        proxy = self.proxy()
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


def _not_ready(reason: str) -> JSONResponse:
    return JSONResponse({"ready": False, "reason": reason}, status_code=503)
