"""`GET /metrics` of a real `shadow serve` proxy on loopback (in front of a scripted engine),
read with `prometheus_client`'s own parser: every series is named in Prometheus's conventions
(no colon), the labelled ones are there at 0 before anything happened, the process and platform
series are there, each latency is a histogram that counts what real requests did, and every
metric name the Grafana dashboard and the alerting rules use is one a scrape holds.
(tests/test_metrics.py runs a real Prometheus against the same service.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripted import quiet_engine
from serving import long_text, serving, settled, wait_until_read
from test_metrics import ALERTS, DASHBOARD, _on_disk, proxy_with_tiny_cap

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
              "chunk_read_seconds", "spill_seconds", "restore_seconds", "time_to_fresh_seconds", "ask_latency_seconds",
              "ask_wait_seconds", "bookkeeping_seconds")


def scrape(client) -> dict:
    """name -> family, from one scrape."""
    r = client.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def samples(family) -> dict[tuple, float]:
    """(sample name, labels beyond model and engine) -> value."""
    out = {}
    for s in family.samples:
        labels = {k: v for k, v in s.labels.items() if k not in ("model", "engine")}
        out[(s.name, *sorted(labels.items()))] = s.value
    return out


def test_labelled_series_are_there_at_zero_before_anything_happens(tiny, tmp_path):
    """Before any request: each labelled counter at 0 for each of its known labels (so a rate or
    `increase()` sees the first event), each histogram at 0 with its buckets, the process and
    platform series beside them, and no name with a colon."""
    with serving(quiet_engine()) as engine:
        with proxy_with_tiny_cap(str(engine.base_url).rstrip("/") + "/v1", tmp_path) as (proxy, _):
            families = scrape(proxy)
    assert not [name for name in families if ":" in name]
    for name in families:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds", "python_info"):
        assert name in families, name
    errors = samples(families["shadow_upstream_errors"])
    for kind in ("unreachable", "timeout", "status_4xx", "status_5xx", "broke_off", "refused_added_fields"):
        assert errors[("shadow_upstream_errors_total", ("kind", kind))] == 0.0
    lines = samples(families["shadow_status_lines"])
    for kind in ("waiting", "reading", "thinking", "decided", "writing", "checking", "waited"):
        assert lines[("shadow_status_lines_total", ("kind", kind))] == 0.0
    for result in ("verified", "unverified", "mismatched"):
        assert samples(families["shadow_turns"])[("shadow_turns_total", ("result", result))] == 0.0
    for part in ("prompt", "output"):
        for result in ("verified", "unverified", "mismatched", "not_read"):
            key = ("shadow_turn_parts_total", ("part", part), ("result", result))
            assert samples(families["shadow_turn_parts"])[key] == 0.0
    phrases = samples(families["shadow_voice_phrases"])
    assert phrases[("shadow_voice_phrases_total", ("reason", ""), ("result", "said"))] == 0.0
    assert phrases[("shadow_voice_phrases_total", ("reason", "repeat"), ("result", "refused"))] == 0.0
    reads = samples(families["shadow_chunk_read_seconds"])
    for window in ("idle", "share", "ask"):
        assert reads[("shadow_chunk_read_seconds_count", ("window", window))] == 0.0
        assert reads[("shadow_chunk_read_seconds_bucket", ("le", "+Inf"), ("window", window))] == 0.0
    for name in HISTOGRAMS:
        family = families[f"shadow_{name}"]
        assert family.type == "histogram", name
        assert {s.name for s in family.samples} == {f"shadow_{name}_{x}" for x in ("bucket", "sum", "count")}, name
    assert not [f for f in families.values() if f.name.startswith("shadow_") and f.type == "gauge"
                and any("quantile" in s.labels for s in f.samples)]  # quantiles are histograms


def test_each_latency_is_a_histogram_that_counts_real_requests(tiny, tmp_path):
    """Two streamed sessions through the proxy (one spills under the tiny cap), an ask that
    restores it, and one bad request: every latency histogram has counted (`_count` equal to its
    +Inf bucket, buckets rising, a positive sum), as many first tokens and end-to-end latencies
    as completions answered 200, and the bad request none."""
    with serving(quiet_engine()) as engine:
        with proxy_with_tiny_cap(str(engine.base_url).rstrip("/") + "/v1", tmp_path) as (proxy, service):
            for name, seed in (("a", 1), ("b", 2)):
                body = {"messages": [{"role": "user", "content": long_text(seed, 300)}], "stream": True}
                with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": name}) as r:
                    assert r.status_code == 200 and "[DONE]" in r.read().decode()
                settled(service)
            spilled = _on_disk(service)
            asked = proxy.post("/v1/shadow/ask",
                               json={"session": spilled, "question": "A or B?", "choices": ["A", "B"]})
            assert asked.status_code == 200
            assert proxy.post("/v1/chat/completions", content=b"{not json").status_code == 400
            families = scrape(proxy)
            status = proxy.get("/v1/shadow/status").json()
    counts = {}
    for name in HISTOGRAMS:
        family = families[f"shadow_{name}"]
        by_series: dict[tuple, dict] = {}
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            by_series.setdefault(key, {"buckets": []})
            if s.name.endswith("_bucket"):
                by_series[key]["buckets"].append((float(s.labels["le"]), s.value))
            else:
                by_series[key][s.name.rsplit("_", 1)[1]] = s.value
        for key, h in by_series.items():
            values = [v for _, v in sorted(h["buckets"])]
            assert values == sorted(values) and values[-1] == h["count"], (name, key, h)
            assert (h["count"] > 0) == (h["sum"] > 0), (name, key, h)
        counts[name] = sum(h["count"] for h in by_series.values())
    assert not [name for name, n in counts.items() if n == 0], counts
    assert counts["time_to_first_token_seconds"] == 2 and counts["e2e_request_latency_seconds"] == 2
    assert counts["inter_token_latency_seconds"] >= 2 * 3  # each stream's events after its first write
    assert counts["ask_latency_seconds"] == counts["ask_wait_seconds"] == status["counters"]["asks"] == 1
    assert counts["restore_seconds"] >= 1 and counts["spill_seconds"] >= 1
    reads = {s.labels["window"]: s.value for s in families["shadow_chunk_read_seconds"].samples
             if s.name.endswith("_count")}
    chunks = {s.labels["window"]: s.value for s in families["shadow_chunks_read"].samples}
    assert all((reads[w] > 0) == (chunks[w] > 0) and reads[w] <= chunks[w] for w in reads), (reads, chunks)


def test_the_dashboard_and_the_alerts_name_only_series_a_scrape_holds(tiny, tmp_path):
    """Every metric name in docs/grafana's dashboard expressions and alerting rules is a series
    of a real scrape, after a turn has been read (a Prometheus runs them in tests/test_metrics.py)."""
    with serving(quiet_engine()) as engine:
        with proxy_with_tiny_cap(str(engine.base_url).rstrip("/") + "/v1", tmp_path) as (proxy, service):
            body = {"messages": [{"role": "user", "content": long_text(3, 300)}], "stream": True}
            with proxy.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": "a"}) as r:
                r.read()
            settled(service)
            wait_until_read(service, ["a"])  # a chunk read: the seconds since the last read are known
            held = {s.name for f in scrape(proxy).values() for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if "query" in v and "(" in str(v["query"])]
    exprs += re.findall(r"expr: (.+(?:\n {10}.+)*)", Path(ALERTS).read_text())
    names = {n for e in exprs for n in re.findall(r"\b(?:shadow|process|python)_[a-z0-9_]+", e)}
    assert len(names) > 30 and not [e for e in exprs if "shadow:" in e]
    assert names <= held, sorted(names - held)
