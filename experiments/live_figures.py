"""The figures of a live density run (`experiments/live_density.py`), from its records: what the
driver saw (each request's start, first token, end and token times; each ask's answer), the
service's status polled during the run and its journal, read with the library's readers
(`shadow.server.journaled.JournalCounts`, `shadow.offline.ledger`, `shadow.offline.timelines`,
`shadow.offline.metrics.spread`). Also the run's ledger, its replay (`shadow replay-ledger`, the
same settings, the costs the live service measured), and the engine's decode with the shadow off
and on, window by window. Prints nothing; `table` returns the short table as text.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from shadow.offline.ledger import Request, write_ledger
from shadow.offline.metrics import spread
from shadow.offline.timelines import density
from shadow.server.journaled import STATES, JournalCounts

CHUNKS = ("chunks_idle", "chunks_share", "chunks_ask", "rollbacks")


@dataclass
class Sent:
    """One request the driver sent: its session, turn (index in the trajectory), times (s from the
    run's start; first_token and end None when it never got one), the engine's usage counts, the
    output ids (the ids beside the logprobs), each streamed token's arrival time, and its messages
    (for the engine's tokenization after the run)."""

    session: str
    turn: int
    start: float
    messages: list[dict]
    first_token: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    status: int = 0
    error: str | None = None
    prompt_ids: list[int] | None = None  # the engine's own, after the run


@dataclass(frozen=True)
class Asked:
    """One ask: `kind` 'turn' (sent at a turn start of a session with earlier turns) or 'random';
    `held` the ids the session held before that turn (turn asks; the answer's `insertion` above it
    means the new prompt was fed first: `raced`); of its latency, the wait for the device thread and
    the kind of job the device ran when it came (the answer's `device_wait_ms`, `device_busy_with`),
    the whole split (`parts_ms`) and what it brought back onto the device (`brought_back`)."""

    kind: str
    session: str
    time: float
    status: int
    latency_ms: float | None = None
    behind: int | None = None
    read_chunks: int | None = None
    insertion: int | None = None
    held: int | None = None
    device_wait_ms: float | None = None
    device_busy_with: str | None = None
    parts_ms: dict | None = None  # the answer's split of its latency (`Asking.ask`: device_wait, ..., forward, back)
    brought_back: dict | None = None  # what the ask brought back onto the device: {"tier", "bytes"}, or None

    @property
    def raced(self) -> bool:
        return self.kind == "turn" and self.insertion is not None and self.held is not None and self.insertion > self.held


@dataclass(frozen=True)
class Poll:
    """The service's status at time `time`: each session's committed ids, and its counters."""

    time: float
    committed: dict[str, int]
    counters: dict
    store: dict


def new_prompt_tokens(requests: list[Sent]) -> dict[int, int]:
    """Each request's prompt ids past the prefix it shares with its session's previous prompt and
    output (by `id()`; a session's first request: its whole prompt), as the ledger defines them."""
    from shadow.core.reader import common_prefix

    out, last = {}, {}
    for r in sorted(requests, key=lambda r: r.start):
        ids = r.prompt_ids or []
        before = last.get(r.session)
        out[id(r)] = len(ids) - (common_prefix(before, ids) if before is not None else 0)
        last[r.session] = ids + r.output_ids
    return out


def ledger(requests: list[Sent]) -> list[Request]:
    """The run's requests that got a first token and an end, as ledger requests (prompt and
    output counts from the engine's usage; new prompt ids from the engine's own ids)."""
    done = [r for r in requests if r.first_token is not None and r.end is not None]
    new = new_prompt_tokens(done)
    return [Request(r.session, r.start, r.first_token, r.end, r.prompt_tokens,
                    min(r.prompt_tokens, max(0, new[id(r)])), r.output_tokens) for r in sorted(done, key=lambda r: r.start)]


def journal_turns(journal: Path) -> dict[str, list[dict]]:
    """The service journal's turn records, session by session in the order written (none where
    the file is missing)."""
    turns: dict[str, list[dict]] = {}
    if journal.exists():
        for line in journal.read_text().splitlines():
            record = json.loads(line) if line.strip() else None
            if isinstance(record, dict) and record.get("kind") == "turn":
                turns.setdefault(record.get("session"), []).append(record)
    return turns


def outputs_unseen(requests: list[Request], journal: Path) -> tuple[list[Request], int | None]:
    """`requests` (a ledger's) with `output_seen` false where the service journaled the turn's
    output as not read (the engine gave no ids it could check; the next prompt brought them), and
    how many. A session's journal turns are matched to its requests in start order by their prompt's
    length (`prompt_ids`, the engine's count), passing over turns the ledger left out (no first token
    or no end). Unchanged, with None, where a request finds no such turn (no mark rather than a
    wrong one)."""
    turns = journal_turns(journal)
    out, at, unseen = [], Counter(), 0
    for r in sorted(requests, key=lambda r: r.start):
        records = turns.get(r.session, [])
        k = next((k for k in range(at[r.session], len(records)) if records[k].get("prompt_ids") == r.prompt_tokens), None)
        if k is None:
            return requests, None
        at[r.session] = k + 1
        shown = records[k].get("output_check") != "not_read"
        unseen += not shown
        out.append(r if shown else replace(r, output_seen=False))
    return out, unseen


def to_fresh(requests: list[Sent], polls: list[Poll], grid: int, until: float) -> list[tuple[float, bool]]:
    """Each request's (seconds until a poll saw its session read to its prompt's last grid line,
    censored): censored where no poll did before the session's next request or `until`."""
    nxt: dict[int, float] = {}
    by: dict[str, list[Sent]] = {}
    for r in sorted(requests, key=lambda r: r.start):
        by.setdefault(r.session, []).append(r)
    for rs in by.values():
        for a, b in zip(rs, rs[1:]):
            nxt[id(a)] = b.start
    out = []
    for r in requests:
        line = r.prompt_tokens // grid * grid
        stop = min(nxt.get(id(r), until), until)
        seen = next((p.time for p in polls if r.start <= p.time <= stop and p.committed.get(r.session, -1) >= line), None)
        out.append((stop - r.start, True) if seen is None else (seen - r.start, False))
    return out


def active_until(requests: list[Request], until: float) -> float:
    """Sessions active at once, time-averaged from the first request's start to `until` (the density
    phase's end): a session is active from its first request's start to its last request's end, as
    `timelines.density` counts it over the whole span (which the phase's last, longest responses
    stretch past `until`)."""
    if not requests:
        return 0.0
    spans: dict[str, list[float]] = {}
    for r in requests:
        a = spans.setdefault(r.session, [r.start, r.end])
        a[0], a[1] = min(a[0], r.start), max(a[1], r.end)
    t0 = min(a for a, _ in spans.values())
    if until <= t0:
        return 0.0
    return sum(max(0.0, min(b, until) - a) for a, b in spans.values()) / (until - t0)


def decode_union_s(requests: list[Request]) -> float:
    """Seconds in which at least one request was decoding (its first token to its end)."""
    spans = sorted((r.first_token, r.end) for r in requests if r.end > r.first_token)
    total, reach = 0.0, -math.inf
    for a, b in spans:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _delta(polls: list[Poll], key: str, t0: float, t1: float) -> float | None:
    """A counter's growth between the last polls at or before t0 and t1."""
    a = [p for p in polls if p.time <= t0] or polls[:1]
    b = [p for p in polls if p.time <= t1]
    if not a or not b:
        return None
    return float(b[-1].counters.get(key, 0.0)) - float(a[-1].counters.get(key, 0.0))


def live(requests: list[Sent], asks: list[Asked], polls: list[Poll], journal: Path, grid: int,
         phase_end: float) -> dict:
    """The live figures of the density phase (requests started before `phase_end`; the counters'
    growth from the first poll to the last one at or before it) and the journal's counts over the
    whole run."""
    mine = [r for r in requests if r.start < phase_end]
    turn = [a for a in asks if a.kind == "turn" and a.time < phase_end and a.status == 200]
    kept = [a for a in turn if not a.raced]
    rand = [a for a in asks if a.kind == "random" and a.time < phase_end and a.status == 200]
    times = to_fresh([r for r in mine if r.first_token is not None], polls, grid, phase_end)
    fresh = [math.inf if censored else s for s, censored in times]
    share = _delta(polls, "share_s", 0.0, phase_end)
    decode = _delta(polls, "decode_s", 0.0, phase_end)
    counts = JournalCounts(None)
    counts.path = journal  # read from the file's start (JournalCounts counts from its own start)
    counts.update()
    return {
        "requests": len(mine), "failed": sum(r.error is not None for r in mine),
        "sessions": len({r.session for r in mine}),
        "turn_starts": {"n": len(kept), "raced": len(turn) - len(kept),
                        "fresh_pct": _pct([a.behind < grid for a in kept]),
                        "at_arrival": service_turn_starts(mine, journal, grid),
                        "behind": spread([a.behind for a in kept], digits=0),
                        "ask_ms": spread([a.latency_ms for a in kept]), **device_waits(kept)},
        "random": {"n": len(rand), "ask_ms": spread([a.latency_ms for a in rand]), **device_waits(rand),
                   "lag": spread([a.behind for a in rand], digits=0),
                   "stale_pct": _pct([a.behind >= grid for a in rand])},
        "asks_failed": sum(a.status != 200 for a in asks if a.time < phase_end),
        "to_fresh_s": {**spread(fresh), "n": len(fresh), "never": sum(c for _, c in times),
                       "poll_s": _poll_step(polls)},
        "share": {"share_s": _round(share), "decode_s": _round(decode),
                  "charged_pct": _round(100 * share / decode) if share is not None and decode else None},
        "chunks": {k: _int(_delta(polls, k, 0.0, phase_end)) for k in CHUNKS},
        "journal": {"turns": sum(counts.checks[("prompt", s)] for s in STATES),
                    "prompt": {s: counts.checks[("prompt", s)] for s in STATES},
                    "output": {s: counts.checks[("output", s)] for s in STATES}},
    }


def device_waits(asks: list[Asked], long_ms: float = 50.0, slow_ms: float = 100.0) -> dict:
    """Of the asks' latencies, the wait for the device thread (p50/p90/p99/max ms), and for the
    asks that waited `long_ms` or more, how many waited behind each kind of job (empty where the
    service gave no such field: an earlier build); and for the asks of `slow_ms` or more whose
    answers split their latency (`parts_ms`), how many and the mean ms of each part."""
    waits = [a for a in asks if a.device_wait_ms is not None]
    if not waits:
        return {}
    long = Counter(a.device_busy_with or "idle" for a in waits if a.device_wait_ms >= long_ms)
    out = {"device_wait_ms": spread([a.device_wait_ms for a in waits]),
           f"waited_{long_ms:g}ms_behind": dict(long.most_common())}
    slow = [a.parts_ms for a in waits if a.parts_ms and a.latency_ms is not None and a.latency_ms >= slow_ms]
    if any(a.parts_ms for a in waits):
        out[f"over_{slow_ms:g}ms"] = {"n": len(slow), "mean_parts_ms": {
            k: _round(statistics.fmean(p.get(k, 0.0) for p in slow)) for k in slow[0]} if slow else {}}
    return out


def arrival_unread(requests: list[Sent], journal: Path) -> dict[str, list[int | None]] | None:
    """For each session of `requests`, the ids it held unread at each later turn's arrival, as the
    service journaled them (`unread_at_start`; None where the service had no shadow then): a
    session's journal lines are its turns in order, matched to its requests by start. None where the
    journal has no such field (an earlier build), a session's counts differ (a request the service
    never journaled), or a value is not the service's field as it writes it (no figure rather than
    a wrong one)."""
    turns = journal_turns(journal)
    if not turns or any("unread_at_start" not in t for ts in turns.values() for t in ts):
        return None
    sent = Counter(r.session for r in requests)
    out = {}
    for session, n in sent.items():
        records = turns.get(session, [])
        if len(records) < n:
            return None
        out[session] = [t["unread_at_start"] for t in records[1:n]]
        if any(u is not None and (not isinstance(u, int) or isinstance(u, bool)) for u in out[session]):
            return None
    return out


def service_turn_starts(requests: list[Sent], journal: Path, grid: int) -> dict | None:
    """Turn starts fresh as the service saw them at each request's arrival (`arrival_unread`: the
    ids the session held unread when the turn named it, the instant the replay takes too), for
    `requests` of sessions with an earlier turn; None where `arrival_unread` gives none. A count
    below zero (an ask's fork open on the session, its rows counted as read: `read_past_ids`) is
    counted apart and left out of the figure."""
    found = arrival_unread(requests, journal)
    if found is None:
        return None
    unread = [u for us in found.values() for u in us if u is not None]
    past = [u for u in unread if u < 0]
    unread = [u for u in unread if u >= 0]
    return {"n": len(unread), "fresh_pct": _pct([u < grid for u in unread]), "behind": spread(unread, digits=0),
            "read_past_ids": len(past)}


STORE_MOVES = ("spills", "restores", "drops", "to_host", "from_host", "host_to_disk")


def scraped(text: str) -> dict:
    """From a `/metrics` scrape of the service: the store's moves since it started (spills,
    restores, drops, moves to and from the host tier) and its own time to fresh (each turn's
    seconds until its prompt was read to its last grid line, a histogram: count, mean, and the
    bucket bound under which half and 90 % of turns were fresh)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "shadow_time_to_fresh_seconds_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif not set(s.labels) - {"engine", "instance", "model"}:
                samples[s.name] = s.value
    count = samples.get("shadow_time_to_fresh_seconds_count", 0.0)

    def bound(q: float) -> float | None:
        return next((le for le, n in sorted(buckets) if count and n >= q * count), None)

    return {"store": {k: int(samples[f"shadow_{k}_total"]) for k in STORE_MOVES if f"shadow_{k}_total" in samples},
            "to_fresh_s": {"n": int(count), "mean": _round(samples.get("shadow_time_to_fresh_seconds_sum", 0.0) / count)
                           if count else None, "p50_bucket": bound(0.5), "p90_bucket": bound(0.9)}}


def costs_document(status: dict) -> dict:
    """A `read-rate --json`-shaped document of the chunk costs the live service had learned (its
    `reading.chunk_ms_by_depth` at the run's end), for the replay to charge the same."""
    rows = [{"context": int(d), "ms_per_chunk": float(ms)} for d, ms in status["reading"]["chunk_ms_by_depth"].items()]
    return {"source": "live status reading.chunk_ms_by_depth", "rows": sorted(rows, key=lambda r: r["context"])}


def ask_forwards(asks: list[Asked], until: float) -> list[float]:
    """The forward (ms, `parts_ms.forward`) of every ask answered before `until`: what the replay
    draws an ask's forward from (`replay-ledger --ask-forwards-json`), the engine's work beside it
    and all."""
    return [a.parts_ms["forward"] for a in asks if a.time < until and a.status == 200 and a.parts_ms
            and isinstance(a.parts_ms.get("forward"), (int, float)) and a.parts_ms["forward"] > 0]


def host_rates(asks: list[Asked], until: float) -> list[float]:
    """GiB/s of every move back from the host tier that an ask answered before `until` made
    (`brought_back`'s bytes over `parts_ms.restore`, which also holds the wait for the lock): what
    the replay draws a move's speed from (`replay-ledger --host-rates-json`), the engine's work
    beside it and all."""
    out = []
    for a in asks:
        back, parts = a.brought_back, a.parts_ms or {}
        ms = parts.get("restore")
        if (a.time < until and a.status == 200 and isinstance(back, dict) and back.get("tier") == "host"
                and isinstance(back.get("bytes"), int) and back["bytes"] > 0 and isinstance(ms, (int, float)) and ms > 0):
            out.append(back["bytes"] / 2**30 / (ms / 1000))
    return out


def charge_document(status: dict) -> dict | None:
    """A `read-rate --json`-shaped document of what the live service charged a share read at most
    (`reading.charge_ms_by_depth` and `charge_batch_ms_by_depth`: the costs it kept at load under
    `--share-charge alone`), for the replay to charge the same (`replay-ledger --charge-json`); None
    where the service charged its reads' own seconds (`wall`, or a status from before the option)."""
    reading = status.get("reading") or {}
    if reading.get("charge") != "alone" or not reading.get("charge_ms_by_depth"):
        return None
    rows = [{"context": int(d), "ms_per_chunk": float(ms)} for d, ms in reading["charge_ms_by_depth"].items()]
    batches = [{"batch": int(b), "context": int(d), "ms_per_read": float(ms)}
               for b, by_depth in (reading.get("charge_batch_ms_by_depth") or {}).items() for d, ms in by_depth.items()]
    return {"source": "live status reading.charge_ms_by_depth", "rows": sorted(rows, key=lambda r: r["context"]),
            "batch_rows": sorted(batches, key=lambda r: (r["batch"], r["context"]))}


def live_rates(metrics: str) -> dict:
    """From the service's `/metrics` at the density phase's end, what the replay charges as live:
    `host_gib_s`, the host tier's moves (bytes to and from the host over their seconds), and
    `ask_chunk_scale`, an ask's seconds per chunk over the share's. The replay applies the scale to
    the service's learned cost table, an average of its recent reads of either kind, which beside a
    busy engine sits near the share's (the fourth live run: 13 to 21 ms a chunk at the phase's end,
    the share's mean 13.4, the asks' 7.9). Each None where the run made none, or where the value is
    not a finite number `replay-ledger` takes (a rate above 0, a scale in (0, 100])."""
    from prometheus_client.parser import text_string_to_metric_families

    total: Counter = Counter()
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            window = sample.labels.get("window")
            total[sample.name + (f"/{window}" if window else "")] += sample.value
    moved = total["shadow_bytes_to_host_total"] + total["shadow_bytes_from_host_total"]
    seconds = total["shadow_to_host_seconds_total"] + total["shadow_from_host_seconds_total"]
    per = {w: total[f"shadow_read_seconds_total/{w}"] / total[f"shadow_chunks_read_total/{w}"]
           for w in ("share", "ask") if total[f"shadow_chunks_read_total/{w}"] > 0}
    host = moved / 2**30 / seconds if moved > 0 and seconds > 0 else None
    scale = per["ask"] / per["share"] if per.get("ask", 0) > 0 and per.get("share", 0) > 0 else None
    return {"host_gib_s": host if host is not None and math.isfinite(host) and host > 0 else None,
            "ask_chunk_scale": scale if scale is not None and math.isfinite(scale) and 0 < scale <= 100 else None}


def replay_ids(journal: Path) -> str:
    """The replay's `--ids` for the way the live proxy took the run's ids: `end` where most turns'
    output ids came beside the engine's logprobs (llama-server: the proxy has them, and feeds them,
    only once the response is over), else `tokenizer` (the prompt through the template round trip,
    the output fed as streamed). Read from the journal's turn records (`ids_source`)."""
    sources = Counter()
    with open(journal) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "turn":
                sources[(record.get("ids_source") or {}).get("output")] += 1
    return "end" if sources and sources.most_common(1)[0][0] == "logprobs" else "tokenizer"


def service_disk(status: dict) -> bool:
    """Whether the live service's store had a disk (`--disk`, or serve's default folder): its status
    names a disk cap only then."""
    return (status.get("store") or {}).get("disk_cap_bytes") is not None


def asks_at(asks: list[Asked], sessions: set[str], until: float, path: Path) -> int:
    """The asks sent before `until` about the ledger's `sessions`, as `shadow replay-ledger
    --asks-at` takes them (JSON Lines: time, session, kind: 'turn', 'turn raced' or 'random');
    written to `path`, their number returned."""
    sent = [a for a in asks if a.time < until and a.session in sessions]
    path.write_text("".join(json.dumps({"time": round(a.time, 6), "session": a.session,
                                        "kind": "turn raced" if a.raced else a.kind}) + "\n" for a in sent))
    return len(sent)


def replay(ledger_path: Path, costs_path: Path, settings: dict, out_dir: Path, name: str = "replay.txt") -> dict:
    """`shadow replay-ledger` over the run's ledger with the run's settings (`settings`: share,
    grid, cap_gib, batch, disk, model, the asks (`asks_at`: a file of the asks as sent, else
    `asks_per_hour`), ask_ms, seed, ids (`replay_ids`), voice_share (0 where the live service
    said no phrase; None: the replay's default), host_gib_s and ask_chunk_scale (`live_rates`;
    None: the replay's defaults), charge_json (`charge_document`'s file; None: a share read charged
    its seconds), ask_forwards_json (`ask_forwards` as a file; None: every ask's forward `ask_ms`),
    host_rates_json (`host_rates` as a file; None: every move back at host_gib_s))
    and the live chunk costs; its `--json` document (the arm
    with the share). Its output goes to `out_dir / name`."""
    asks = ["--asks-at", settings["asks_at"]] if settings.get("asks_at") else \
        ["--asks-per-hour", str(settings["asks_per_hour"])]
    cmd = [sys.executable, "-c", "from shadow.cli.main import main; main()", "replay-ledger", str(ledger_path),
           "--format", "ledger", "--ids", settings.get("ids", "tokenizer"), "--read-rate-json", str(costs_path),
           "--share", str(settings["share"]), "--grid", str(settings["grid"]), "--model", settings["model"],
           *asks, "--seed", str(settings["seed"]), "--disk" if settings.get("disk") else "--no-disk", "--json",
           "--turns", str(out_dir / (Path(name).stem + "-turns.jsonl"))]
    if settings.get("cap_gib") is not None:
        cmd += ["--cap-gib", str(settings["cap_gib"])]
    if settings.get("batch", 1) > 1:
        cmd += ["--batch", str(settings["batch"])]
    if settings.get("ask_ms") is not None:
        cmd += ["--ask-ms", str(settings["ask_ms"])]
    for key in ("host_gib_s", "ask_chunk_scale"):  # the live run's (`live_rates`), where it measured them
        if settings.get(key) is not None:
            cmd += ["--" + key.replace("_", "-"), str(settings[key])]
    if settings.get("voice_share") is not None:
        cmd += ["--voice-share", str(settings["voice_share"])]
    if settings.get("charge_json"):  # what the live service charged a share read at most (`charge_document`)
        cmd += ["--charge-json", settings["charge_json"]]
    if settings.get("ask_forwards_json"):  # the live asks' forwards (`ask_forwards`), one drawn an ask
        cmd += ["--ask-forwards-json", settings["ask_forwards_json"]]
    if settings.get("host_rates_json"):  # the live asks' moves back from the host tier (`host_rates`), one drawn a move
        cmd += ["--host-rates-json", settings["host_rates_json"]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    (out_dir / name).write_text(done.stdout + done.stderr)
    if done.returncode not in (0, 1):  # 1: its monotone checks failed; the figures are still there
        raise RuntimeError(f"replay-ledger exit {done.returncode}: {done.stderr[-2000:]}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    arm = next(a for a in doc["arms"] if a["share"])
    turns = [json.loads(x) for x in (out_dir / (Path(name).stem + "-turns.jsonl")).read_text().splitlines()]
    return {"command": " ".join(cmd[3:]), "density": doc["density"], "ask_ms": doc["limits"]["ask_ms"],
            "arm": arm["arm"], "summary": arm["summary"], "share_s": arm["share_s"],
            "share_charged_s": arm.get("share_charged_s", arm["share_s"]),
            "chunks": {k: arm[k] for k in CHUNKS}, "checks_ok": doc["checks"]["ok"],
            "turns": [(t["session"], t["behind"]) for t in turns if t["arm"] == arm["arm"] and t["share"] == arm["share"]]}


def turn_by_turn(requests: list[Sent], journal: Path, replayed: list, grid: int) -> dict | None:
    """The turn starts live (`arrival_unread`) and replayed (the replay's `turns`: (session, behind)
    in start order) set side by side, session by session in order: how many were fresh on both
    sides, live only (and of those, how many the replay had within one chunk more, and how many
    exactly the previous response's output more: `live_only_by_last_output`, the live count taken
    before the shadow was fed that output), replayed only, neither; None where `arrival_unread`
    gives none. A live count below zero (an open fork's) or none (no shadow then) leaves that turn out."""
    live = arrival_unread(requests, journal)
    if live is None:
        return None
    ours: dict[str, list[int]] = {}
    for session, behind in replayed:
        ours.setdefault(session, []).append(behind)
    sent: dict[str, list[Sent]] = {}
    for r in sorted(requests, key=lambda r: r.start):
        sent.setdefault(r.session, []).append(r)
    counts = Counter()
    for session, behinds in ours.items():
        for k, (u, b) in enumerate(zip(live.get(session, []), behinds)):
            if u is None or u < 0:
                continue
            if u < grid and b < grid:
                counts["both"] += 1
            elif u < grid:
                counts["live_only"] += 1
                counts["live_only_replay_within_a_chunk"] += b < 2 * grid
                counts["live_only_by_last_output"] += b - u == sent[session][k].output_tokens
            elif b < grid:
                counts["replay_only"] += 1
            else:
                counts["neither"] += 1
    keys = ("both", "live_only", "live_only_replay_within_a_chunk", "live_only_by_last_output", "replay_only", "neither")
    return {k: counts[k] for k in keys}


def side_by_side(live_: dict, replayed: dict, requests: list[Request]) -> dict:
    """The figures both give, live beside replayed: an ask live is its whole `latency_ms` (the wait
    for the device, the reading, its own forward). Replayed, where the replay had the run's asks at
    their times (`asks_at`), the same asks answered on its device, queue included, and of them the
    wait for the device beside the live `device_wait_ms`; otherwise the reading an ask would wait
    for plus the forward the replay charges (`--ask-ms`: the median latency of the live asks that
    read no chunk), with no queue. The share charged live is the service's `share_s` over its
    `decode_s`, replayed its share seconds over the ledger's decode time (a stream decoding)."""
    s, store = replayed["summary"], live_["service"]["store"]
    union = decode_union_s(requests)
    forward = replayed["ask_ms"] or 0.0
    by_kind = (s.get("asks") or {}).get("by_kind") or {}
    where_ = (("turn starts", "turn_starts", "turn"), ("random times", "random", "random"))

    def asked(key: str, kind: str, q: int) -> float | None:
        if kind in by_kind:
            return by_kind[kind]["wait_ms"][f"p{q}"]
        return _plus(s[key]["ask_wait_ms"][f"p{q}"], forward)

    rows = {
        "turn starts fresh %": (live_["turn_starts"]["fresh_pct"], s["turn_starts"]["fresh_pct"]),
        "turn starts fresh at arrival %": ((live_["turn_starts"].get("at_arrival") or {}).get("fresh_pct"),
                                           s["turn_starts"]["fresh_pct"]),
        **{f"ask at {where} p{q} ms": (live_[key]["ask_ms"][f"p{q}"], asked(key, kind, q))
           for where, key, kind in where_ for q in (50, 99)},
        **{f"ask's device wait at {where} p99 ms": ((live_[key].get("device_wait_ms") or {}).get("p99"),
                                                   by_kind[kind]["queued_ms"]["p99"])
           for where, key, kind in where_ if kind in by_kind},
        "time to fresh p50 s": (live_["to_fresh_s"]["p50"], s["to_fresh_s"]["p50"]),
        "time to fresh p90 s": (live_["to_fresh_s"]["p90"], s["to_fresh_s"]["p90"]),
        "share charged %": (live_["share"]["charged_pct"],
                            _round(100 * replayed.get("share_charged_s", replayed["share_s"]) / union) if union else None),
        "spills": (store.get("spills"), s["store"]["spills"]),
        "restores": (store.get("restores"), s["store"]["restores"]),
        "drops": (store.get("drops"), s["store"]["drops"]),
        "to host / from host": (_pair(store, "to_host", "from_host"), _pair(s["store"], "to_host", "from_host")),
        "chunks idle": (live_["chunks"].get("chunks_idle"), replayed["chunks"]["chunks_idle"]),
        "chunks share": (live_["chunks"].get("chunks_share"), replayed["chunks"]["chunks_share"]),
    }
    return {k: {"live": a, "replay": b} for k, (a, b) in rows.items()}


def engine_cost(requests: list[Sent], windows: list[tuple[str, float, float]], polls: list[Poll],
                counters: list[tuple[dict, dict]] | None = None, others: list[Sent] = (),
                gpu: list[tuple[float, float]] = ()) -> dict:
    """The engine's decode in each window ('off' or 'on', start, end; seconds from the run's
    start) of `requests` (the streams measured): tokens streamed in it over the seconds in it with
    a stream decoding (aggregate decode tokens/s), the gaps between a stream's consecutive tokens
    within it (p50, p99 ms), the share charged in it (from the polls), `others` still in flight in
    it (load beside the streams measured), and where `counters` gives llama-server's own counters
    at the window's ends (`--metrics`), the tokens it predicted over the window's seconds and per
    decode call (how many streams a batched step carried), and where `gpu` holds samples of the GPU's
    busy % (seconds, %), their mean in it (`gpu_busy_pct`: an engine that leaves the GPU idle between
    its steps loses little to the shadow's kernels whatever the share). Windows pair as `_pairs` says
    (off-on or on-off): each pair's change of decode tokens/s with the shadow on, and over the pairs their
    median and mean, the share charged in the on windows (and, where the service reports them, its
    reads' own seconds: `share_read_pct`, apart from the charge under `--share-charge alone`), and the
    cost beyond it (points: the decode lost less the share charged)."""
    rows = []
    for w, (kind, a, b) in enumerate(windows):
        times, gaps, spans = 0, [], []
        for r in requests:
            inside = [t for t in r.token_times if a <= t < b]
            times += len(inside)
            gaps += [(y - x) * 1000 for x, y in zip(inside, inside[1:])]
            if inside:
                spans.append(Request(r.session, a, max(a, r.first_token or a), min(b, r.end or b), 0, 0, 0))
        busy = decode_union_s(spans)
        share, decode = _delta(polls, "share_s", a, b), _delta(polls, "decode_s", a, b)
        # the share's reads' own seconds, where the service reports them apart from what they charged
        read = _delta(polls, "share_read_s", a, b) if polls and "share_read_s" in polls[-1].counters else None
        rows.append({"shadow": kind, "start": round(a, 3), "end": round(b, 3), "tokens": times,
                     "others_in_flight": sum(r.start < b and (r.end is None or r.end > a) for r in others),
                     "decode_busy_s": round(busy, 3), "tok_s": _round(times / busy) if busy else None,
                     "gap_ms": spread(gaps), "gaps": len(gaps),
                     "share_charged_pct": _round(100 * share / decode) if share is not None and decode else None,
                     "share_read_pct": _round(100 * read / decode) if read is not None and decode else None,
                     "gpu_busy_pct": gpu_busy(gpu, a, b),
                     "engine": _engine_window(counters[w], b - a) if counters and w < len(counters) else None})
    pairs = []
    for x, y in _pairs(rows):
        off, on = (x, y) if x["shadow"] == "off" else (y, x)
        if off["shadow"] == "off" and on["shadow"] == "on" and off["tok_s"] and on["tok_s"]:
            pairs.append({"order": f"{x['shadow']}-{y['shadow']}",
                          "tok_s_change_pct": _round(100 * (on["tok_s"] / off["tok_s"] - 1)),
                          "gap_p99_ms": (off["gap_ms"]["p99"], on["gap_ms"]["p99"]),
                          "engine_decodes_per_s": tuple((x["engine"] or {}).get("decodes_per_s") for x in (off, on)),
                          "gpu_busy_pct": (off["gpu_busy_pct"], on["gpu_busy_pct"]),
                          "share_charged_pct": on["share_charged_pct"], "share_read_pct": on["share_read_pct"]})
    return {"windows": rows, "pairs": pairs, "summary": _pairs_summary(pairs), "drift": drift_fit(rows)}


def _pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """The windows two by two: in the order off-on, on-off, ... (`--order abba`), each two in turn;
    in the order off, on, off, ... (`alternate`), each window with the next, so the pairs go
    off-on, on-off, ... and a steady drift counts one way in half of them and the other way in the
    rest (every window but the ends sits in two pairs)."""
    if len(rows) > 2 and all(a["shadow"] != b["shadow"] for a, b in zip(rows, rows[1:])):
        return list(zip(rows, rows[1:]))
    return list(zip(rows[0::2], rows[1::2]))


def drift_fit(rows: list[dict]) -> dict | None:
    """The decode lost with the shadow on, the engine's drift taken out (its streams deepen, so its
    tokens/s falls as the windows go on): a least-squares fit of each window's tokens/s to a quadratic
    in the window's middle time plus a step while the shadow is on. `lost_pct`, the step as a % of the
    fitted rate with the shadow off averaged over the windows' times, and `lost_se_pts`, its standard
    error (from the fit's residuals over `dof` degrees of freedom; the windows taken as independent
    and the drift as quadratic, the base's own error left out). `neighbours_median_pct`, the median
    of the loss each window gives against the mean of its two neighbours where both are of the other
    kind (a linear drift cancels), a check that needs no model of the drift. `share_charged_pct` and
    `share_read_pct`, their means over the on windows; `beyond_share_pts`, lost less charged. None
    with fewer than six windows that have a rate, or with no window of either kind."""
    import numpy as np

    used = [w for w in rows if w["tok_s"]]
    ons = [w["shadow"] == "on" for w in used]
    if len(used) < 6 or all(ons) or not any(ons):
        return None
    mid = np.array([(w["start"] + w["end"]) / 2 for w in used])
    tau = (mid - mid.mean()) / max(float(np.ptp(mid)), 1e-9)
    x = np.column_stack([np.ones_like(tau), tau, tau ** 2, np.array(ons, dtype=float)])
    y = np.array([w["tok_s"] for w in used], dtype=float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    dof = len(y) - x.shape[1]
    se = None
    if dof > 0:
        rss = float(np.sum((y - x @ coef) ** 2))
        se = math.sqrt(rss / dof * float(np.linalg.pinv(x.T @ x)[3, 3]))
    base = float(coef[0] + coef[2] * np.mean(tau ** 2))  # the fitted off rate, averaged over the windows' times
    lost = -100 * float(coef[3]) / base
    near = []
    for i in range(1, len(rows) - 1):
        w, a, b = rows[i], rows[i - 1], rows[i + 1]
        if w["tok_s"] and a["tok_s"] and b["tok_s"] and a["shadow"] == b["shadow"] != w["shadow"]:
            ratio = w["tok_s"] / ((a["tok_s"] + b["tok_s"]) / 2)
            near.append(100 * (1 - ratio) if w["shadow"] == "on" else 100 * (ratio - 1))
    on = [w for w in used if w["shadow"] == "on"]
    charged = [w["share_charged_pct"] for w in on if w["share_charged_pct"] is not None]
    read = [w["share_read_pct"] for w in on if w.get("share_read_pct") is not None]
    share = statistics.fmean(charged) if charged else None
    return {"windows": len(used), "dof": dof, "lost_pct": _round(lost), "lost_se_pts": _round(100 * se / base) if se is not None else None,
            "neighbours": len(near), "neighbours_median_pct": _round(statistics.median(near)) if near else None,
            "share_charged_pct": _round(share), "share_read_pct": _round(statistics.fmean(read)) if read else None,
            "beyond_share_pts": _round(lost - share) if share is not None else None}


def gpu_busy(samples, start: float, end: float) -> float | None:
    """The mean of the GPU busy % samples (seconds, %) taken in [start, end); None where none was."""
    inside = [pct for t, pct in samples if start <= t < end]
    return _round(statistics.fmean(inside)) if inside else None


def _pairs_summary(pairs: list[dict]) -> dict | None:
    """Over the pairs: the change of decode tokens/s with the shadow on (median, mean, range), the
    share charged in the on windows (mean), and the decode lost beyond it (points, from the median)."""
    changes = [p["tok_s_change_pct"] for p in pairs]
    charged = [p["share_charged_pct"] for p in pairs if p["share_charged_pct"] is not None]
    read = [p["share_read_pct"] for p in pairs if p.get("share_read_pct") is not None]
    if not changes:
        return None
    median, share = statistics.median(changes), statistics.fmean(charged) if charged else None
    return {"n": len(changes), "change_median_pct": _round(median), "change_mean_pct": _round(statistics.fmean(changes)),
            "change_range_pct": (min(changes), max(changes)), "share_charged_pct": _round(share),
            "share_read_pct": _round(statistics.fmean(read)) if read else None,
            "beyond_share_pts": _round(-median - share) if share is not None else None}


def _engine_window(ends: tuple[dict, dict], seconds: float) -> dict | None:
    """llama-server's counters over one window: decode calls (and a second: with every slot decoding,
    its step rate), the tokens predicted by the requests that ended in it (llama-server counts a
    request's tokens when it ends) with their ratio to the calls (None where none ended), and the
    prompt tokens it read (counted at a request's first token, its ids served from its cache left out)."""
    before, after = ends
    if "llamacpp:tokens_predicted_total" not in before or "llamacpp:tokens_predicted_total" not in after:
        return None
    tokens = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    decodes = after.get("llamacpp:n_decode_total", 0.0) - before.get("llamacpp:n_decode_total", 0.0)
    prompt = after.get("llamacpp:prompt_tokens_total", 0.0) - before.get("llamacpp:prompt_tokens_total", 0.0)
    return {"tokens_predicted": int(tokens), "prompt_tokens": int(prompt), "decodes": int(decodes),
            "decodes_per_s": _round(decodes / seconds) if seconds > 0 else None,
            "tokens_per_decode": _round(tokens / decodes) if decodes and tokens else None}


def table(doc: dict) -> str:
    """The short table: live beside replayed, then the engine's pairs."""
    lines = [f"{'figure':42} {'live':>14} {'replay':>14}"] if doc["side_by_side"] else []  # none: the cost phase alone
    for name, v in doc["side_by_side"].items():
        lines.append(f"{name:42} {_fmt(v['live']):>14} {_fmt(v['replay']):>14}")
    dens = doc.get("live", {}).get("density") or {}
    if dens.get("active_in_phase") is not None:
        lines.append(f"sessions active: {dens['active_in_phase']:.2f} over the density phase, {dens['active']:.2f} over "
                     f"the ledger's span ({dens['span_s']:.0f} s, to the last response's end)")
    unseen = (doc.get("settings", {}).get("replay") or {}).get("outputs_unseen")
    if unseen is not None:
        lines.append(f"outputs the engine gave no ids for: {unseen} (both sides read them with the next prompt)")
    for i, p in enumerate(doc.get("engine", {}).get("pairs", [])):
        calls = p.get("engine_decodes_per_s") or (None, None)  # absent from a run of an earlier driver
        busy = p.get("gpu_busy_pct") or (None, None)
        lines.append(f"pair {i + 1} ({p.get('order', 'off-on')}): decode tok/s {p['tok_s_change_pct']:+.2f} % with the shadow on, inter-token p99 "
                     f"{_fmt(p['gap_p99_ms'][0])} -> {_fmt(p['gap_p99_ms'][1])} ms, engine's decode calls/s "
                     f"{_fmt(calls[0])} -> {_fmt(calls[1])}, share charged {_fmt(p['share_charged_pct'])} %"
                     + (f", GPU busy {_fmt(busy[0])} -> {_fmt(busy[1])} %" if any(v is not None for v in busy) else ""))
    pairs = doc.get("turn_by_turn")
    if pairs:
        lines.append(f"turn starts fresh, turn by turn: both {pairs['both']}, live only {pairs['live_only']} "
                     f"(the replay within a chunk more: {pairs['live_only_replay_within_a_chunk']}; by exactly the "
                     f"last response's output: {pairs.get('live_only_by_last_output', '-')}), replayed only "
                     f"{pairs['replay_only']}, neither {pairs['neither']}")
    for kind in ("turn_starts", "random"):
        slow = doc.get("live", {}).get(kind, {}).get("over_100ms")
        if slow and slow["n"]:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in slow["mean_parts_ms"].items())
            lines.append(f"asks over 100 ms ({kind.replace('_', ' ')}): {slow['n']}, mean ms {parts}")
    d = doc.get("engine", {}).get("drift")
    if d:
        lines.append(f"drift fit over {d['windows']} windows: decode lost with the shadow on {d['lost_pct']:+.2f} % "
                     f"(se {_fmt(d['lost_se_pts'])} points; against neighbours, median {_fmt(d['neighbours_median_pct'])} % "
                     f"of {d['neighbours']}), share charged {_fmt(d['share_charged_pct'])} %"
                     + (f" (its reads' own seconds {_fmt(d['share_read_pct'])} %)" if d.get("share_read_pct") is not None else "")
                     + f", lost beyond the share {_fmt(d['beyond_share_pts'])} points")
    s = doc.get("engine", {}).get("summary")
    if s:
        lines.append(f"pairs: decode tok/s median {s['change_median_pct']:+.2f} % (mean {s['change_mean_pct']:+.2f} %, "
                     f"{s['n']} pairs), share charged {_fmt(s['share_charged_pct'])} %"
                     + (f" (its reads' own seconds {_fmt(s['share_read_pct'])} %)" if s.get("share_read_pct") is not None else "")
                     + f", lost beyond the share {_fmt(s['beyond_share_pts'])} points")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.2f}" if isinstance(v, float) else str(v)


def _pair(store: dict, a: str, b: str) -> str | None:
    return f"{store[a]} / {store[b]}" if a in store and b in store else None


def _plus(v: float | None, forward: float) -> float | None:
    return None if v is None else round(v + forward, 3)


def _int(v: float | None) -> int | None:
    return None if v is None else int(v)


def _pct(flags: list[bool]) -> float | None:
    return round(100 * sum(flags) / len(flags), 2) if flags else None


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _poll_step(polls: list[Poll]) -> float | None:
    steps = sorted(b.time - a.time for a, b in zip(polls, polls[1:]))
    return round(steps[len(steps) // 2], 3) if steps else None


__all__ = ["Asked", "Poll", "Sent", "arrival_unread", "costs_document", "decode_union_s", "density", "engine_cost", "ledger", "live",
           "journal_turns", "live_rates", "new_prompt_tokens", "outputs_unseen", "active_until", "replay", "replay_ids", "scraped", "service_disk", "service_turn_starts", "side_by_side", "table", "to_fresh", "turn_by_turn", "write_ledger"]
