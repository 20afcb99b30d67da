"""The service's Prometheus metrics: one `CollectorRegistry` per app, holding one collector that
reads the service when scraped (`service.status()` and the objects it reads, under the service's
lock), so no request pays for them, beside `prometheus_client`'s process, platform and garbage
collector collectors (`process_*`, `python_*`). Every series of the service is named `shadow_...`
(Prometheus's naming: base units, `_total` counters, no colons, which are for recording rules)
and labelled by `model` (the shadow's) and `engine` (the engine's dialect; `embedded` for the
embedded generator).

Latencies are histograms (`_bucket`, `_sum`, `_count`, in seconds), each kept by the part that
times it (`timings.Histogram`): a request's time to first token and end to end, the streams'
inter-token latency, a chunk read, a spill, a restore, a turn's time to fresh, an ask's latency
and wait, the shadow's bookkeeping a round. Counters come from the service's counters, the
store's and each session's checks; where the service keeps a figure only in its journal, from the
journal's new records (`journaled`), with a `--journal` only. A labelled series is there from the
start, at 0, for each of its known labels. A figure the service does not keep is left out, never
made up.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CollectorRegistry, CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from shadow.server.device import KINDS as DEVICE_JOBS
from shadow.server.journaled import JournalCounts
from shadow.server.service import ShadowService
from shadow.server.timings import Histogram

LABELS = ("model", "engine")
WINDOWS = ("idle", "share", "ask")
RESULTS = ("verified", "unverified", "mismatched")  # a turn's: both parts verified, either mismatched, the rest
PART_RESULTS = (*RESULTS, "not_read")  # a prompt's or an output's (idcheck.PART_STATES)
IDLE_STATES = ("reading", "caught up", "between bursts", "engine busy", "device busy", "no shadow", "off", "error",
               "stopped", "dead", "not started")
BACKLOG_IDS = (0, 512, 2048, 8192, 32768, 131072)  # a session's unread ids: the histogram's bounds
UPSTREAM_ERRORS = ("unreachable", "timeout", "status_4xx", "status_5xx", "broke_off", "refused_added_fields")
LINE_KINDS = ("waiting", "reading", "thinking", "decided", "writing", "checking", "waited")  # http.lines.Line
REFUSALS = ("empty", "too long", "markup", "first person", "unread name", "unread number", "unread words", "example",
            "repeat", "language")  # voice.checks' reasons a phrase is not said


class ShadowCollector:
    """Reads `service` at each scrape; `journal` counts what only the journal keeps; `latency`
    holds each completion's seconds end to end (the HTTP side times them)."""

    def __init__(self, service: ShadowService, journal: JournalCounts, latency: Histogram):
        self.service, self.journal, self.latency = service, journal, latency

    def describe(self) -> list:
        return []  # registering reads nothing: the series are known at scrape time

    def collect(self) -> Iterator[Metric]:
        service = self.service
        status = service.status()
        held = self._held([r["name"] for r in status["sessions"] if r["resident"]])
        self.journal.update()
        engine = status["engine"] or {}
        labels = [service.settings.model.model, "embedded" if not service.settings.proxy else
                  engine.get("dialect") or "unknown"]
        out = Families(labels)
        self._state(out, status)
        self._store(out, status, held)
        self._prefix_cache(out, status)
        self._reading(out, status, service.settings.schedule.share)
        self._device(out, status)
        self._checks(out, status, held)
        self._asks(out, status, held)
        self._journaled(out, status)
        self._engine(out, status)
        self._latencies(out, held)
        yield from out.families

    def _held(self, resident: list[str]) -> dict:
        """What status does not show, read under the lock: the store's counters, every session's
        checks, the `resident` sessions' rollbacks and re-reads, the histograms."""
        service = self.service
        with service.state_lock:
            shadow = service.host.shadow
            store = None if shadow is None else shadow.store
            resident = [] if store is None else [s for s in map(store.peek, resident) if s is not None]
            checks = list(service.checks.values())
            return {
                "store": None if store is None else dict(vars(store.counters), rejected=len(store.counters.rejected)),
                "turns": {r: sum(getattr(c, r) for c in checks) for r in RESULTS},
                "mismatched_sessions": sum(c.first_mismatch_turn is not None for c in checks),
                "rollbacks": sum(s.rollbacks for s in resident), "ids_reread": sum(s.ids_reread for s in resident),
                "latency": service.asking.latency.snapshot(), "wait": service.asking.wait.snapshot(),
                "chunk": {w: h.snapshot() for w, h in service.reading.chunk_seconds.items()},
                "fresh": service.reading.fresh.seconds.snapshot(), "never_fresh": service.reading.fresh.never,
                "first_token": service.timings.first_token.snapshot(), "spill": service.timings.spill.snapshot(),
                "restore": service.timings.restore.snapshot(), "rounds": service.counters.rounds.seconds.snapshot(),
                "writes": service.counters.gaps.writes.snapshot(), "e2e": self.latency.snapshot(),
            }

    @staticmethod
    def _state(out: "Families", status: dict) -> None:
        out.gauge("ready", "1 while the shadow's model is loaded", int(bool(status["ready"])))
        out.gauge("load_failed", "1 when the shadow's last load failed", int(status["load_error"] is not None))
        out.gauge("enabled", "1 while the shadow is switched on", int(bool(status["enabled"])))
        out.gauge("turns_in_flight", "Requests begun and not ended", status["turns_in_flight"])
        out.gauge("requests_waiting", "Requests waiting for the device", status["waiting"])
        out.gauge("turns_overdue", "Turns in flight longer than the engine's timeout (the watchdog)",
                  len(status["overdue_turns"]))
        c = status["counters"]
        out.counter("requests", "Completion requests begun", c["requests"])
        out.counter("unloads", "Times the model was let go after an idle burst (sessions parked on disk)", c["unloads"])
        idle = status["idle_reader"]
        out.gauge("idle_reader_up", "1 while the idle reader's thread lives", int(bool(idle["alive"])))
        state = out.family("idle_reader_state", "1 for the idle reader's state now", ["state"])
        for name in (*IDLE_STATES, *([idle["state"]] if idle["state"] not in IDLE_STATES else [])):
            state.add(name.replace(" ", "_"), value=int(name == idle["state"]))
        out.counter("idle_reader_rounds", "Idle reader poll rounds", idle["rounds"])
        out.counter("idle_reader_errors", "Idle rounds that failed (the reader went on)", idle["errors"])
        if idle["last_read_s_ago"] is not None:
            out.gauge("last_read_age_seconds", "Seconds since the shadow last read a chunk", idle["last_read_s_ago"])

    @staticmethod
    def _store(out: "Families", status: dict, held: dict) -> None:
        totals = status["store"]
        rows = status["sessions"]
        if totals is not None:
            out.gauge("sessions_resident", "Sessions held in memory", totals["resident_sessions"])
            out.gauge("sessions_on_disk", "The store's session files on disk", totals["files"])
            out.gauge("resident_bytes", "Bytes of the sessions held in memory", totals["resident_bytes"])
            out.gauge("disk_bytes", "Bytes of the store's session files", totals["disk_bytes"])
            for key, name in (("cap_bytes", "resident_cap_bytes"), ("disk_cap_bytes", "disk_cap_bytes")):
                if totals[key] is not None:
                    out.gauge(name, f"The store's bound on {name.split('_')[0]} bytes", totals[key])
            out.gauge("sessions_unwritten", "Resident sessions whose last write failed", totals["unwritten_sessions"])
            out.gauge("sessions_in_host", "Sessions in the host-memory tier", totals["host_sessions"])
            out.gauge("host_bytes", "Bytes of the sessions in the host-memory tier", totals["host_bytes"])
            if totals["host_cap_bytes"] is not None:
                out.gauge("host_cap_bytes", "The store's bound on host-tier bytes", totals["host_cap_bytes"])
            for key, name, help_ in (
                    ("moving_sessions", "sessions_moving", "Sessions leaving the device, their copy out still in flight"),
                    ("moving_bytes", "moving_bytes", "Device bytes held until the copies out in flight are done"),
                    ("staged_sessions", "sessions_staged", "Host copies bound for disk, waiting for their write behind"),
                    ("staged_bytes", "staged_bytes", "Bytes of the host copies waiting for their write behind"),
                    ("stage_cap_bytes", "stage_cap_bytes", "The store's bound on bytes staged for disk"),
                    ("write_behind_queue", "write_behind_queue", "Session files queued for the write-behind thread")):
                if totals[key] is not None:
                    out.gauge(name, help_, totals[key])
            out.counter("written_behind", "Host copies written to disk by the write-behind thread", totals["written_behind"])
            pinned = totals.get("pinned")
            if pinned is not None:  # on a GPU: the pool copies out take pinned host memory from
                out.gauge("pinned_bytes", "Host memory the pinned pool has pinned", pinned["pinned_bytes"])
                out.gauge("pinned_free_bytes", "Pinned host memory free for the next copies out", pinned["free_bytes"])
                out.counter("pinned_fallbacks", "Copies out that found no pinned span free and pinned where they began",
                            pinned["fallbacks"])
                out.counter("pinned_pin_seconds", "Seconds the pinned pool's thread spent pinning", pinned["pin_seconds"])
                out.counter("pinned_quiet_seconds", "Seconds the pinned pool's thread held a slab back for copies in flight",
                            pinned["quiet_seconds"])
        pending = [r["pending"] for r in rows]
        out.gauge("backlog_ids", "Ids known and not read yet, over every session", sum(pending))
        grid = status["grid"]
        if grid:  # the idle window's work: spilled sessions wait on disk for their next turn
            out.gauge("sessions_behind", "Resident sessions with at least one whole chunk unread",
                      sum(r["resident"] and r["pending"] >= grid for r in rows))
        h = out.family("session_backlog_ids", "Sessions by their unread ids, now", kind=GaugeHistogramMetricFamily)
        h.add(buckets=[(_le(b), sum(p <= b for p in pending)) for b in (*BACKLOG_IDS, math.inf)], gsum_value=sum(pending))
        s = held["store"]
        if s is None:
            return
        for key, help_ in (("spills", "Sessions written to disk to stay under the cap"),
                           ("restores", "Sessions read back from disk"),
                           ("drops", "Sessions let go under the cap with no disk to write them to"),
                           ("write_failures", "Session writes that failed (the session stayed resident)"),
                           ("rejected", "Session files refused (moved aside; the session is read again)"),
                           ("removed", "Session files removed by retention"),
                           ("bytes_written", "Bytes of session files written"),
                           ("bytes_restored", "Bytes of session files read back"),
                           ("to_host", "Sessions moved from the device to the host-memory tier"),
                           ("from_host", "Sessions moved back from the host-memory tier"),
                           ("host_to_disk", "Host-tier copies written to disk to make room in the tier"),
                           ("bytes_to_host", "Bytes moved to the host-memory tier"),
                           ("bytes_from_host", "Bytes moved back from the host-memory tier"),
                           ("to_host_seconds", "Seconds spent moving sessions to the host-memory tier"),
                           ("from_host_seconds", "Seconds spent moving sessions back from the host-memory tier")):
            out.counter({"rejected": "files_refused", "removed": "files_removed"}.get(key, key), help_, s[key])

    @staticmethod
    def _prefix_cache(out: "Families", status: dict) -> None:
        cache = status.get("prefix_cache")
        if cache is None:
            return
        out.gauge("prefix_cache_bytes", "Bytes of the prefix cache (KV rows and grid-line states)", cache["bytes"])
        out.gauge("prefix_cache_cap_bytes", "The prefix cache's bound, bytes", cache["cap_bytes"])
        out.gauge("prefix_cache_lines", "Grid lines the prefix cache holds a state at", cache["lines"])
        out.counter("prefix_cache_hits", "Sessions that started at a cached grid line", cache["hits"])
        out.counter("prefix_cache_misses", "Sessions read from the start that found no cached line", cache["misses"])
        out.counter("prefix_cache_tokens_saved", "Ids the prefix cache's hits did not read", cache["tokens_saved"])

    @staticmethod
    def _reading(out: "Families", status: dict, share: float) -> None:
        c, r = status["counters"], status["reading"]
        chunks = out.family("chunks_read", "Chunks the shadow read, by window", ["window"], CounterMetricFamily)
        seconds = out.family("read_seconds", "Device-synchronised seconds of those chunks, by window",
                             ["window"], CounterMetricFamily)
        for window in WINDOWS:
            chunks.add(window, value=c[f"chunks_{window}"])
            value = c.get("share_read_s" if window == "share" else f"{window}_s")
            if value is not None:
                seconds.add(window, value=value)
        if c.get("share_s") is not None:
            out.counter("share_charged_seconds", "Seconds the share's reads charged the engine's decodes "
                        "(--share-charge: at most their cost at load, the default, or their own seconds)", c["share_s"])
        if c.get("decode_s") is not None:
            out.counter("decode_seconds", "Seconds of the engine's decode stretches (the share's base)", c["decode_s"])
        out.gauge("share_fraction", "The in-turn share the rule grants (--share)", share)
        out.gauge("share_left_seconds", "Share the current decode stretch still holds", r["share_left_s"])
        out.gauge("engine_busy", "1 while a turn is in flight (the idle window is closed)", int(bool(r["busy"])))
        out.gauge("engine_decoding", "1 while a turn decodes (the share runs)", int(bool(r["decoding"])))
        out.gauge("last_chunk_seconds", "The last read's seconds per chunk", c["last_chunk_ms"] / 1000)
        out.gauge("max_wait_on_reader_seconds", "The longest a request waited behind a reader chunk",
                  c["max_wait_on_reader_ms"] / 1000)
        estimate = out.family("chunk_seconds_estimate", "The scheduler's cost of one chunk by the depth of its first "
                              "row", ["depth"])
        for depth, ms in r["chunk_ms_by_depth"].items():
            estimate.add(depth, value=ms / 1000)

    @staticmethod
    def _device(out: "Families", status: dict) -> None:
        jobs = status["device_jobs"]
        count = out.family("device_jobs", "Jobs the device thread ran, by kind", ["kind"], CounterMetricFamily)
        seconds = out.family("device_job_seconds", "Seconds the device thread's jobs took, by kind", ["kind"],
                             CounterMetricFamily)
        for kind in dict.fromkeys((*DEVICE_JOBS, *jobs)):
            job = jobs.get(kind, {"count": 0, "seconds": 0.0})
            count.add(kind, value=job["count"])
            seconds.add(kind, value=job["seconds"])

    @staticmethod
    def _checks(out: "Families", status: dict, held: dict) -> None:
        turns = out.family("turns", "Turns checked against the engine, by result (verified: prompt and output both)",
                           ["result"], CounterMetricFamily)
        for result in RESULTS:
            turns.add(result, value=held["turns"][result])
        out.gauge("sessions_mismatched", "Sessions with a turn that did not match the engine", held["mismatched_sessions"])
        checks = [r["id_checks"] for r in status["sessions"]]
        out.gauge("sessions_not_exact", "Sessions held with ids not verified against the engine",
                  sum(not c["exact"] for c in checks))
        out.gauge("unverified_ids", "Ids held past each session's verified prefix",
                  sum(c["ids"] - c["verified_ids"] for c in checks))
        out.gauge("resident_rollbacks", "Rollbacks of the sessions held in memory (a prompt that differed)",
                  held["rollbacks"])
        out.gauge("resident_ids_reread", "Ids the sessions held in memory read again after a rollback",
                  held["ids_reread"])
        c = status["counters"]
        for key, help_ in (("rollbacks", "Rollbacks (a prompt that differed from what a session held)"),
                           ("ids_reread", "Ids read again after a rollback")):
            if c.get(key) is not None:
                out.counter(key, help_, c[key])
        predictions = c.get("predictions")
        if predictions is not None:
            family = out.family("predictions", "Next prompts predicted at a proxied turn's end, by outcome",
                                ["outcome"], CounterMetricFamily)
            for outcome in ("made", "confirmed", "missed", "skipped"):
                family.add(outcome, value=predictions[outcome])
            out.counter("prediction_ids_not_read_twice", "Ids a confirmed prediction kept from being read twice",
                        predictions["ids_not_read_twice"])
            out.counter("prediction_holds_released", "Held outputs let go past what a fork may read (read as they came)",
                        predictions["holds_released"])
        starts = c.get("turn_starts")
        if starts is not None:
            family = out.family("turn_starts", "Turns by what their session's shadow held unread when they named it: "
                                "fresh (under a chunk), behind, or a session not held", ["state"], CounterMetricFamily)
            for state, n in starts.items():
                family.add(state, value=n)

    @staticmethod
    def _asks(out: "Families", status: dict, held: dict) -> None:
        c = status["counters"]
        out.counter("asks", "Asks answered", c["asks"])
        out.counter("standing_answered", "Standing questions answered", c["standing_answered"])
        out.counter("standing_replaced", "Standing questions a newer turn replaced before the reader reached them",
                    c["standing_replaced"])
        out.gauge("standing_pending", "Standing questions waiting for the reader", c["standing_pending"])
        out.histogram("ask_latency_seconds", "Seconds from an ask's start (the shadow ready) to its answer",
                      held["latency"])
        out.histogram("ask_wait_seconds", "Seconds an ask waited for the device before reading", held["wait"])

    def _journaled(self, out: "Families", status: dict) -> None:
        """Turns' parts, status lines and phrases: from the service's counters where it keeps them
        (`turn_parts` {part: {result: n}}, `status_lines` {kind: n}, `voice_said` n and
        `voice_refused` {reason: n}), else from the journal's records (with a journal only)."""
        c, j = status["counters"], self.journal
        with j.lock:
            checks, lines, phrases = dict(j.checks), dict(j.lines), dict(j.phrases)
        kept = j.path is not None
        if isinstance(c.get("turn_parts"), dict):
            checks, kept = {(p, r): n for p, by in c["turn_parts"].items() for r, n in by.items()}, True
        if kept:
            parts = out.family("turn_parts", "Turns' prompts and outputs apart, by result (not_read: the shadow "
                               "holds none of it)", ["part", "result"], CounterMetricFamily)
            for part in ("prompt", "output"):
                for result in PART_RESULTS:
                    parts.add(part, result, value=checks.get((part, result), 0))
        kept = j.path is not None
        if isinstance(c.get("status_lines"), dict):
            lines, kept = c["status_lines"], True
        if kept:
            shown = out.family("status_lines", "Status lines clients were shown, by kind", ["kind"],
                               CounterMetricFamily)
            for kind in sorted({*LINE_KINDS, *map(str, lines)}):
                shown.add(kind, value=lines.get(kind, 0))
        kept = j.path is not None
        if isinstance(c.get("voice_refused"), dict) and c.get("voice_said") is not None:
            phrases = {("said", ""): c["voice_said"], **{("refused", str(r)): n for r, n in c["voice_refused"].items()}}
            kept = True
        if kept:
            said = out.family("voice_phrases", "Voice phrases written, said or refused by reason", ["result", "reason"],
                              CounterMetricFamily)
            known = {("said", ""): 0, **{("refused", r): 0 for r in REFUSALS}}
            for (result, reason), n in sorted((known | phrases).items()):
                said.add(result, reason, value=n)

    @staticmethod
    def _engine(out: "Families", status: dict) -> None:
        errors = status["counters"].get("upstream_errors")
        if isinstance(errors, dict):
            family = out.family("upstream_errors", "Engine requests that failed, by kind", ["kind"], CounterMetricFamily)
            for kind in sorted({*UPSTREAM_ERRORS, *map(str, errors)}):
                family.add(kind, value=errors.get(kind, 0))

    @staticmethod
    def _latencies(out: "Families", held: dict) -> None:
        out.histogram("time_to_first_token_seconds", "Seconds from a request's start to its first token (behind a "
                      "proxy: the engine's first streamed event; a whole response has none)", held["first_token"])
        out.histogram("e2e_request_latency_seconds", "Seconds from a completion request's arrival to its last byte, "
                      "of those answered 200", held["e2e"])
        out.histogram("inter_token_latency_seconds", "Seconds between two writes of a stream that carried tokens "
                      "(a write may carry several)", held["writes"])
        chunk = out.family("chunk_read_seconds", "Seconds of one chunk, each read (a read of several: its seconds "
                           "over its chunks), by window", ["window"], HistogramMetricFamily)
        for window in WINDOWS:
            chunk.add(window, **_buckets(held["chunk"][window]))
        out.histogram("spill_seconds", "Seconds of each session file written (a spill, a host copy written out, a "
                      "write at the stop)", held["spill"])
        out.histogram("restore_seconds", "Seconds of each session read back from disk", held["restore"])
        out.histogram("time_to_fresh_seconds", "Seconds from a turn's start until the shadow has read its prompt to "
                      "its last grid line", held["fresh"])
        out.counter("turns_never_fresh", "Turns whose session's next prompt came before the shadow had read theirs",
                    held["never_fresh"])
        out.histogram("bookkeeping_seconds", "The shadow's own seconds between two rounds of the engine (or two "
                      "streamed deltas), beyond the chunks read and the phrases written", held["rounds"])


class Families:
    """The families of one scrape, each labelled by model and engine first."""

    def __init__(self, labels: list[str]):
        self.labels = labels
        self.families: list[Metric] = []

    def family(self, name: str, help_: str, extra: list[str] = (), kind=GaugeMetricFamily) -> "Family":
        metric = kind(f"shadow_{name}", help_, labels=[*LABELS, *extra])
        self.families.append(metric)
        return Family(metric, self.labels)

    def gauge(self, name: str, help_: str, value: float) -> None:
        self.family(name, help_).add(value=value)

    def counter(self, name: str, help_: str, value: float) -> None:
        self.family(name, help_, kind=CounterMetricFamily).add(value=value)

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        self.family(name, help_, kind=HistogramMetricFamily).add(**_buckets(h))


class Family:
    def __init__(self, metric: Metric, labels: list[str]):
        self.metric, self.labels = metric, labels

    def add(self, *extra: str, **value) -> None:
        self.metric.add_metric([*self.labels, *extra], **value)


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


def _buckets(h: Histogram) -> dict:
    """A histogram's buckets and sum, as `HistogramMetricFamily.add_metric` takes them (its count
    is the +Inf bucket's)."""
    return {"buckets": [(_le(b), n) for b, n in h.cumulative()], "sum_value": h.sum}


class Metrics:
    """The app's registry (its own, never the process's global one) and its exposition."""

    def __init__(self, service: ShadowService, latency: Histogram):
        self.journal = JournalCounts(service.settings.journal)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ShadowCollector(service, self.journal, latency))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        """The exposition in Prometheus's text format (0.0.4, which every scraper reads) and its
        content type."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
