"""The probes (`GET /health`, `GET /ready`) of a real `shadow serve` on loopback: while the shadow
loads, when it is ready, when it failed to load, when it is parked on disk, when the engine is
down or answers 503 (proxy mode), when the device thread is held, and with keys."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager

import pytest

from scripted import quiet_engine, renderer
from serving import free_port, running, serving, settings_for
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore
from shadow.model.checkpoint import read_config, resolve_checkpoint
from shadow.server.host import Shadow
from shadow.server.http.app import ShadowApp
from shadow.server.service import ShadowService
from shadow.server.settings import Access, ProbeSettings, StoreSettings
from shadow.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out


@contextmanager
def proxy_loading(upstream: str, load, **more):
    """A proxy whose shadow loads with `load` on the device thread after start (as `shadow serve
    --upstream` does); `more`: settings fields, and `pool_free` for the service."""
    pool_free = more.pop("pool_free", None)
    settings = dataclasses.replace(settings_for(upstream, prefix_match=False, dialect="openai"), **more)
    service = ShadowService(settings, load, read_config(resolve_checkpoint("tiny")), pool_free=pool_free)
    with serving(ShadowApp(settings, service, load_tokenizer(None), "upstream", renderer=renderer()).app) as client:
        yield client, service


def tiny_shadow(tiny, disk=None) -> Shadow:
    _, reader = open_reader("tiny", grid=128)
    return Shadow(reader, SessionStore(reader, tiny.weights_hash, cap_gib=None, disk=disk), tiny.weights_label)


def until(predicate, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_while_the_shadow_loads_it_lives_and_is_not_ready_then_it_is(tiny):
    """A load holds the device thread: liveness answers 200 (busy, for less than stuck_s) and
    readiness 503 until the model is there, then both 200, the engine reachable."""
    release = threading.Event()

    def slow_load():
        release.wait(60)
        return tiny_shadow(tiny)

    with serving(quiet_engine()) as engine:
        with proxy_loading(str(engine.base_url).rstrip("/") + "/v1", slow_load) as (proxy, service):
            live = proxy.get("/health")
            assert live.status_code == 200 and live.json()["status"] == "ok"
            assert live.json()["device"] == "busy" and live.json()["running"] == "load"
            ready = proxy.get("/ready")
            assert ready.status_code == 503 and ready.json() == {"ready": False,
                                                                  "reason": "the shadow is loading its model"}
            release.set()
            until(service.ready.is_set)
            assert proxy.get("/health").json()["status"] == "ok"
            until(lambda: proxy.get("/health").json()["device"] == "answered")
            ready = proxy.get("/ready")
            assert ready.status_code == 200
            assert ready.json() == {"ready": True, "shadow": "loaded", "engine": "reachable"}


def test_a_shadow_that_failed_to_load_is_not_ready_and_says_why(tiny):
    def broken():
        raise OSError("no such checkpoint")

    with serving(quiet_engine()) as engine:
        with proxy_loading(str(engine.base_url).rstrip("/") + "/v1", broken) as (proxy, service):
            until(lambda: service.host.load_error is not None)
            ready = proxy.get("/ready")
            assert ready.status_code == 503 and "no such checkpoint" in ready.json()["reason"]
            assert proxy.get("/health").status_code == 200  # the process and its device thread live


def test_a_parked_shadow_is_ready(tiny, tmp_path):
    """Let go after an idle burst (sessions on disk), the shadow loads again at the next turn:
    the service is ready meanwhile."""
    free = {"bytes": 1 << 30}
    with serving(quiet_engine()) as engine:
        with proxy_loading(str(engine.base_url).rstrip("/") + "/v1", lambda: tiny_shadow(tiny, tmp_path / "disk"),
                           store=StoreSettings(None, tmp_path / "disk", unload_slack_gib=1 / 1024),
                           pool_free=lambda: free["bytes"]) as (proxy, service):
            until(lambda: service.counters.unloads > 0)
            free["bytes"] = 0
            assert not service.ready.is_set()
            ready = proxy.get("/ready")
            assert ready.status_code == 200 and ready.json()["shadow"] == "parked"


@pytest.mark.parametrize("down", ["unreachable", "503"])
def test_an_engine_down_makes_the_proxy_not_ready_but_alive(tiny, down):
    """An engine that does not answer, or answers 503 (llama.cpp while it loads its model)."""
    mode = {"models_status": 503}
    with serving(quiet_engine(mode)) as engine:
        upstream = f"http://127.0.0.1:{free_port()}/v1" if down == "unreachable" else \
            str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=upstream, dialect="openai", renderer=renderer()) as (proxy, service):
            ready = proxy.get("/ready")
            assert ready.status_code == 503 and ready.json()["ready"] is False
            assert ("unreachable: ConnectError" if down == "unreachable" else "answered 503") in ready.json()["reason"]
            assert proxy.get("/health").status_code == 200
            if down == "503":
                mode["models_status"] = 200
                assert proxy.get("/ready").status_code == 200


def test_a_device_thread_that_runs_nothing_past_stuck_s_fails_liveness(tiny):
    """With stuck_s 0, a device held by one job answers 503 (what it runs, how long the no-op
    waited); released, 200 again."""
    with running(probes=ProbeSettings(wait_s=0.05, stuck_s=0.0)) as (client, service):
        assert client.get("/health").json()["status"] == "ok"
        with service.device.hold():
            stuck = client.get("/health")
            assert stuck.status_code == 503 and stuck.json()["status"] == "stuck"
            assert stuck.json()["running"] == "hold"
        until(lambda: client.get("/health").status_code == 200)
        assert client.get("/ready").json() == {"ready": True, "shadow": "loaded"}  # embedded: no engine to ask


def test_the_probes_want_the_api_key_unless_configured_without(tiny):
    key = {"authorization": "Bearer k1"}
    with running(access=Access("k1", "admin1")) as (client, _):
        for path in ("/health", "/ready", "/health_generate"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers=key).status_code == 200
    with running(access=Access("k1", "admin1", probes_without_key=True)) as (client, _):
        for path in ("/health", "/ready", "/health_generate"):
            assert client.get(path).status_code == 200
        assert client.get("/v1/models").status_code == 401  # nothing else opens
        assert client.get("/metrics").status_code == 401 and client.get("/metrics", headers=key).status_code == 401
        assert client.get("/metrics", headers={"authorization": "Bearer admin1"}).status_code == 200
