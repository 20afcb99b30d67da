"""`GET /metrics` scraped by a real Prometheus (Debian's `prometheus`) on loopback, from a real
`shadow serve` proxy on loopback in front of a scripted engine; the series Prometheus holds are
checked against what `GET /v1/shadow/status` reports. And the keys /metrics wants, and the
journal's counts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from scripted import quiet_engine, renderer
from serving import free_port, long_text, service_for, serving, settings_for, settled
from shadow.core.reader import open_reader
from shadow.core.store import SessionStore
from shadow.server.device import KINDS as DEVICE_JOBS
from shadow.server.http.app import ShadowApp
from shadow.server.journaled import JournalCounts
from shadow.server.settings import Access
from shadow.text.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "shadow-dashboard.json"
ALERTS = ROOT / "docs" / "grafana" / "shadow-alerts.yml"
ADMIN, API = "admin-key-1", "api-key-1"
LABELS = {"model": "tiny", "engine": "openai"}


@contextmanager
def proxy_with_tiny_cap(upstream: str, tmp_path: Path, access: Access = Access()):
    """A real proxy on loopback whose store holds about one tiny session (the rest spill to
    disk), journaling, with status lines as content from the first moment."""
    loaded, reader = open_reader("tiny", grid=128)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=0.001, disk=tmp_path / "disk")
    settings = settings_for(upstream, tmp_path / "disk", tmp_path / "journal.jsonl", prefix_match=False,
                            dialect="openai", status_channel="content", status_timing={"quiet_s": 0.0},
                            access=access)
    service = service_for(settings, reader, store, loaded.weights_label)
    app = ShadowApp(settings, service, load_tokenizer(None), "upstream", renderer=renderer()).app
    with serving(app) as client:
        yield client, service


@contextmanager
def prometheus(tmp_path: Path, target: str, token: str):
    """Prometheus on loopback scraping `target`'s /metrics every second with `token`, evaluating
    the alerting rules of docs/grafana every second; a client of its API."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus; .ci/run does)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{ALERTS}']\n"
        "scrape_configs:\n"
        "  - job_name: shadow\n"
        "    metrics_path: /metrics\n"
        f"    authorization: {{type: Bearer, credentials: {token}}}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.time() + 60
            while True:
                try:
                    if client.get("/-/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.time() < deadline, (tmp_path / "prometheus.log").read_text()
                time.sleep(0.2)
            yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(prom: httpx.Client, expr: str) -> list[dict]:
    body = prom.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def series(prom: httpx.Client) -> dict[tuple, float]:
    """Every shadow series Prometheus holds now: (name, extra labels...) -> value."""
    out = {}
    for r in query(prom, '{__name__=~"shadow_.+"}'):
        labels = dict(r["metric"])
        name = labels.pop("__name__")
        assert {k: labels.pop(k) for k in ("model", "engine")} == LABELS, r["metric"]
        labels.pop("job"), labels.pop("instance")
        out[(name, *sorted(labels.items()))] = float(r["value"][1])
    return out


def wanted(status: dict, store_counters: dict, journal: Path) -> dict[tuple, float]:
    """The values /v1/shadow/status (and the store's counters it does not show) say each series must have."""
    c, totals, rows = status["counters"], status["store"], status["sessions"]
    checks = [r["id_checks"] for r in rows]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    lines = [x["kind"] for r in records for x in r.get("status_lines", [])]
    turns = [r for r in records if r.get("kind") == "turn"]
    out = {
        ("shadow_ready",): 1.0, ("shadow_requests_total",): c["requests"], ("shadow_asks_total",): c["asks"],
        ("shadow_turns_in_flight",): status["turns_in_flight"], ("shadow_turns_overdue",): len(status["overdue_turns"]),
        ("shadow_sessions_resident",): totals["resident_sessions"], ("shadow_sessions_on_disk",): totals["files"],
        ("shadow_resident_bytes",): totals["resident_bytes"], ("shadow_disk_bytes",): totals["disk_bytes"],
        ("shadow_write_failures_total",): totals["write_failures"],
        ("shadow_spills_total",): store_counters["spills"], ("shadow_restores_total",): store_counters["restores"],
        ("shadow_drops_total",): store_counters["drops"],
        ("shadow_backlog_ids",): sum(r["pending"] for r in rows),
        ("shadow_sessions_behind",): sum(r["resident"] and r["pending"] >= status["grid"] for r in rows),
        ("shadow_session_backlog_ids_gcount",): len(rows),
        ("shadow_sessions_not_exact",): sum(not x["exact"] for x in checks),
        ("shadow_unverified_ids",): sum(x["ids"] - x["verified_ids"] for x in checks),
        ("shadow_ask_latency_seconds_count",): c["asks"], ("shadow_ask_wait_seconds_count",): c["asks"],
        ("shadow_idle_reader_up",): 1.0,
        ("shadow_idle_reader_state", ("state", status["idle_reader"]["state"].replace(" ", "_"))): 1.0,
        ("shadow_idle_reader_errors_total",): status["idle_reader"]["errors"],
        ("shadow_read_seconds_total", ("window", "share")): c["share_read_s"],
        ("shadow_share_charged_seconds_total",): c["share_s"],
    }
    for window in ("idle", "share", "ask"):
        out[("shadow_chunks_read_total", ("window", window))] = c[f"chunks_{window}"]
    for result in ("verified", "unverified", "mismatched"):
        out[("shadow_turns_total", ("result", result))] = sum(x[f"turns_{result}"] for x in checks)
    for part in ("prompt", "output"):
        for result in ("verified", "unverified", "mismatched", "not_read"):
            out[("shadow_turn_parts_total", ("part", part), ("result", result))] = sum(
                t[f"{part}_check"] == result for t in turns)
            assert c["turn_parts"][part][result] == sum(t[f"{part}_check"] == result for t in turns)
    for kind in set(lines):
        out[("shadow_status_lines_total", ("kind", kind))] = lines.count(kind)
    return {k: float(v) for k, v in out.items()}


def differences(have: dict, want: dict) -> dict:
    return {k: (have.get(k), v) for k, v in want.items() if have.get(k) is None or abs(have[k] - v) > 1e-5}


def test_a_real_prometheus_finds_the_shadow_series_status_reports(tiny, tmp_path):
    """A scripted session through a proxy: two sessions (one spills under the tiny cap), each turn
    unverified (the engine shows no ids and no usage: each prompt read and unverified, each output
    not read), status lines, an ask that restores the
    spilled one; Prometheus's series then hold the values status reports, and every query of
    the Grafana dashboard runs."""
    with serving(quiet_engine()) as engine:
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with proxy_with_tiny_cap(upstream, tmp_path, Access(API, ADMIN)) as (proxy, service):
            target = str(proxy.base_url).removeprefix("http://").rstrip("/")
            with prometheus(tmp_path, target, ADMIN) as prom:
                keyed = {"authorization": f"Bearer {API}"}
                for name, seed in (("a", 1), ("b", 2)):
                    body = {"messages": [{"role": "user", "content": long_text(seed, 300)}], "stream": True}
                    with proxy.stream("POST", "/v1/chat/completions", json=body,
                                      headers={"x-session-id": name, **keyed}) as r:
                        assert r.status_code == 200 and "[DONE]" in r.read().decode()
                    settled(service)
                spilled = _on_disk(service)  # the idle reader read one and spilled the other
                asked = proxy.post("/v1/shadow/ask", headers={"authorization": f"Bearer {ADMIN}"},
                                   json={"session": spilled, "question": "A or B?", "choices": ["A", "B"]})
                assert asked.status_code == 200 and asked.json()["exact"] is False
                have, want = _scraped_as_status(proxy, service, prom, tmp_path / "journal.jsonl")
                assert not differences(have, want), differences(have, want)
                assert want[("shadow_spills_total",)] >= 1 and want[("shadow_restores_total",)] >= 1
                assert want[("shadow_turns_total", ("result", "unverified"))] == 2
                assert want[("shadow_turn_parts_total", ("part", "output"), ("result", "not_read"))] == 2
                assert want[("shadow_turn_parts_total", ("part", "prompt"), ("result", "unverified"))] == 2
                assert want[("shadow_status_lines_total", ("kind", "reading"))] >= 2
                # the device thread's jobs by kind, each known kind from the start: the ask among them
                assert {("shadow_device_jobs_total", ("kind", k)) for k in DEVICE_JOBS} <= set(have)
                assert have[("shadow_device_jobs_total", ("kind", "ask"))] >= 1
                assert have[("shadow_device_job_seconds_total", ("kind", "ask"))] > 0
                _dashboard_runs(prom, {k[0] for k in have})
                _alerts_evaluate(prom)


def _on_disk(service, timeout: float = 60.0) -> str:
    """A session the store spilled, its file written (a session takes its memory once it is read;
    one still on its way to disk would come back from memory, not from its file)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = service.status()["sessions"]
        written = [r["name"] for r in rows if r["tier"] == "disk" and r["moving"] is None]
        if written:
            return written[0]
        time.sleep(0.1)
    raise AssertionError("no session was spilled")


def _scraped_as_status(proxy, service, prom, journal: Path, timeout: float = 90.0) -> tuple[dict, dict]:
    """Once the shadow has nothing left to read: the series of a scrape after a status read, and
    what that status says they must be (again, until they agree or the time is up)."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    deadline = time.time() + timeout
    while True:
        status = proxy.get("/v1/shadow/status", headers=admin).json()
        with service.state_lock:
            store_counters = dict(vars(service.store.counters))
        asked_at = time.time()
        while time.time() < deadline:  # a scrape that began after the status read
            stamp = query(prom, 'timestamp(shadow_ready{job="shadow"})')
            if stamp and float(stamp[0]["value"][1]) > asked_at + 0.05:
                break
            time.sleep(0.2)
        have, want = series(prom), wanted(status, store_counters, journal)
        idle = not status["turns_in_flight"] and not status["reading"]["backlog"]
        if (idle and not differences(have, want)) or time.time() > deadline:
            return have, want


def _dashboard_runs(prom: httpx.Client, exposed: set[str]) -> None:
    """Every query of the Grafana dashboard parses and runs in Prometheus, and names only series
    Prometheus holds from this service's scrapes."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b(?:shadow|process)_[a-z0-9_]+", expr))
        concrete = expr.replace("$model", "tiny").replace("$engine", "openai").replace("$__rate_interval", "1m")
        query(prom, concrete)
    held = {r["metric"]["__name__"] for r in query(prom, '{__name__=~"(shadow|process)_.+", job="shadow"}')}
    assert names <= held, names - held
    assert {"shadow_ready", "process_cpu_seconds_total"} <= held and not [n for n in exposed if ":" in n]


def _alerts_evaluate(prom: httpx.Client, timeout: float = 30.0) -> None:
    """Every alerting rule of docs/grafana loaded and evaluated without an error; on this healthy
    service, once the rules have seen its last state, none is pending or firing but the
    unverified turns' (each turn here is unverified)."""
    deadline = time.time() + timeout
    while True:
        rules = [r for g in prom.get("/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]
        healthy = bool(rules) and all(r["health"] == "ok" for r in rules)
        firing = {r["name"] for r in rules if r["state"] != "inactive"}
        if healthy and firing <= {"ShadowTurnsUnverified"} or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(rules) >= 8 and healthy, [(r["name"], r.get("lastError")) for r in rules]
    assert firing <= {"ShadowTurnsUnverified"}, firing


def test_metrics_want_the_admin_key_and_each_app_has_its_own_registry(tiny, tmp_path):
    """/metrics wants the admin key when one is set (the API key is not enough); without an admin
    key, the API key; each app has its own registry (two apps in one process both answer)."""
    with serving(quiet_engine()) as engine:
        upstream = str(engine.base_url).rstrip("/") + "/v1"
        with proxy_with_tiny_cap(upstream, tmp_path / "one", Access(API, ADMIN)) as (one, _), \
                proxy_with_tiny_cap(upstream, tmp_path / "two", Access(API)) as (two, _):
            assert one.get("/metrics").status_code == 401
            assert one.get("/metrics", headers={"authorization": f"Bearer {API}"}).status_code == 401
            r = one.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
            assert 'shadow_ready{engine="openai",model="tiny"} 1.0' in r.text
            assert two.get("/metrics").status_code == 401
            assert two.get("/metrics", headers={"authorization": f"Bearer {API}"}).status_code == 200


def test_the_journal_counts_parts_lines_and_phrases_appended_since_start(tmp_path):
    """Records from before the start are not counted; a record half written waits for its end."""
    path = tmp_path / "journal.jsonl"
    old = {"kind": "turn", "prompt_verified": True, "output_verified": True}
    path.write_text(json.dumps(old) + "\n")
    counts = JournalCounts(path)
    turn = {"kind": "turn", "prompt_verified": True, "output_verified": None,
            "status_lines": [{"kind": "reading", "text": "reading 10 tokens"},
                             {"kind": "thinking", "text": "thinking 15 s",
                              "phrase": {"said": False, "raw": "x", "reason": "repeat"}}]}
    lines = {"kind": "status_lines", "status_lines": [{"kind": "writing", "phrase": {"said": True, "raw": "y"}}]}
    half = json.dumps({"kind": "turn", "prompt_verified": False, "output_verified": False})
    with open(path, "a") as f:
        f.write(json.dumps(turn) + "\n" + json.dumps(lines) + "\n" + half[:10])
    counts.update()
    assert dict(counts.checks) == {("prompt", "verified"): 1, ("output", "unverified"): 1}
    assert dict(counts.lines) == {"reading": 1, "thinking": 1, "writing": 1}
    assert dict(counts.phrases) == {("refused", "repeat"): 1, ("said", ""): 1}
    with open(path, "a") as f:
        f.write(half[10:] + "\n")
    counts.update()
    assert counts.checks["prompt", "mismatched"] == 1 and counts.checks["output", "mismatched"] == 1
    # records of this version say each part's state, not_read included
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "turn", "prompt_check": "verified", "output_check": "not_read",
                            "prompt_verified": True, "output_verified": None}) + "\n")
    counts.update()
    assert counts.checks["prompt", "verified"] == 2 and counts.checks["output", "not_read"] == 1
    assert counts.checks["output", "unverified"] == 1  # the earlier record's null stays unverified
