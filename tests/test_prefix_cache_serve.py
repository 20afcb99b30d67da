"""The prefix cache live: twenty sessions that share a long system prompt and tool definitions (as
opencode sends them: one long system message and a `tools` list, then the session's own first
user message) through a real `shadow serve` app in front of a real `transformers serve` (random
weights, the real Qwen3.5 vocabulary and chat template). Every session after the first starts at
the shared prefix's last grid line (the journal says where) and, read to its end, is bit-equal to
a fresh prefill of its own ids; the cache's hits and tokens saved show in status and /metrics.

The same sessions through a second app without the cache (`--no-prefix-cache`), each session sent
to one app and then the other so that both share the machine's load, give the time a first
prompt's read takes without it; both are measured (the shadow's read seconds of each session's
first prompt, and the copies of a hit), never asserted. With `SHADOW_PREFIX_CACHE_TIMES=FILE` the figures are written
there as JSON (docs/BENCHMARKS.md gives the command and what it measured)."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from engines import transformers_serve_missing
from serving import serving, settled
from shadow.core.reader import common_prefix, open_reader
from shadow.core.store import SessionStore
from shadow.offline.verify import compare_states
from shadow.server.host import Shadow
from shadow.server.http.app import ShadowApp
from shadow.server.service import ShadowService
from shadow.server.settings import (EngineSettings, ModelSettings, PrefixCacheSettings, ServeSettings,
                                    StoreSettings)
from shadow.text.tokenizer import load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(transformers_serve_missing() is not None,
                                                   reason=transformers_serve_missing() or "")]

G = 512
SESSIONS = 20
WORDS = ("read", "the", "file", "before", "you", "edit", "it", "and", "run", "tests", "after", "each", "change",
         "keep", "diffs", "small", "never", "guess", "paths", "ask", "when", "unsure")


def system_prompt(words: int) -> str:
    rng = random.Random(7)
    lines = []
    for n in range(words // 40):
        lines.append(f"{n + 1}. " + " ".join(rng.choice(WORDS) for _ in range(40)) + ".")
    return "You are opencode, an interactive CLI agent for software engineering.\n\n" + "\n".join(lines)


def tools(count: int) -> list[dict]:
    rng = random.Random(11)
    out = []
    for n in range(count):
        out.append({"type": "function", "function": {
            "name": f"tool_{n}", "description": " ".join(rng.choice(WORDS) for _ in range(120)),
            "parameters": {"type": "object", "required": ["path"], "properties": {
                "path": {"type": "string", "description": " ".join(rng.choice(WORDS) for _ in range(30))},
                "limit": {"type": "integer", "description": " ".join(rng.choice(WORDS) for _ in range(20))}}}}})
    return out


SYSTEM, TOOLS = system_prompt(8000), tools(16)


def body(session: int) -> dict:
    rng = random.Random(100 + session)
    task = f"Task {session}: " + " ".join(rng.choice(WORDS) for _ in range(700))
    return {"model": "qwen3.5-tiny-big", "stream": True, "max_tokens": 1, "tools": TOOLS,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]}


def renderer_of(folder: Path):
    from shadow.text.chat_template import ChatRenderer, load_hf_tokenizer, read_template

    return ChatRenderer(read_template(folder), load_hf_tokenizer(folder))


@contextmanager
def shadow_in_front(engine: str, big_model: Path, journal: Path, cache: bool):
    """`shadow serve --upstream ENGINE --grid 512` (the prefix cache on, or --no-prefix-cache) as an
    app on loopback."""
    loaded, reader = open_reader("tiny", grid=G)
    store = SessionStore(reader, loaded.weights_hash, cap_gib=None)
    settings = ServeSettings(model=ModelSettings("tiny", grid=G), store=StoreSettings(cap_gib=None),
                             prefix=PrefixCacheSettings(on=cache), engine=EngineSettings(upstream=engine),
                             journal=journal)
    service = ShadowService(settings, Shadow(reader, store, loaded.weights_label), reader.model.config)
    app = ShadowApp(settings, service, load_tokenizer(None), "upstream", renderer=renderer_of(big_model)).app
    with serving(app) as client:
        yield client, service


def read_to_its_end(service: ShadowService, name: str, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with service.state_lock:
            s = service.store.peek(name)
            done = s is not None and len(s.ids) - s.committed < G and not service.turns
        if done:
            service.device.run(lambda: None)  # no chunk in flight
            return
        time.sleep(0.05)
    raise AssertionError(f"session {name} was not read to its end")


def read_seconds(service: ShadowService) -> tuple[float, int]:
    """The shadow's seconds of reads and of the prefix cache's copies so far, and the chunks read."""
    c = service.status()["counters"]
    cache = service.status()["prefix_cache"]
    return c["idle_s"] + c["share_read_s"] + c["ask_s"] + (cache["start_s"] if cache else 0.0), \
        c["chunks_idle"] + c["chunks_share"] + c["chunks_ask"]


def one_session(client, service: ShadowService, n: int) -> tuple[float, int, list[int]]:
    """Session n's first turn through the app and its read to the end: (the read's seconds, chunks
    read, its ids), its state checked bit for bit against a fresh prefill of its ids."""
    name = f"opencode-{n}"
    seconds, read = read_seconds(service)
    with client.stream("POST", "/v1/chat/completions", json=body(n), headers={"x-session-id": name}) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass
    settled(service, timeout=120)
    read_to_its_end(service, name)
    after, read_after = read_seconds(service)
    with service.device.hold(), service.state_lock:
        s = service.store.get(name)
        ids = list(s.ids)
        compared, mismatched, _ = compare_states(s.state, service.reader.prefill(s.ids[: s.committed]))
    assert compared > 0 and mismatched == [], (name, mismatched)
    return after - seconds, read_after - read, ids


def run_sessions(engine: str, big_model: Path, tmp_path: Path) -> dict:
    """The twenty sessions through two apps side by side, the prefix cache on in one and off in the
    other, each session sent to one and then the other (so both arms share the machine's load)."""
    arms = {True: {"reads": [], "chunks": [], "ids": {}}, False: {"reads": [], "chunks": [], "ids": {}}}
    journals = {cache: tmp_path / f"journal-{cache}.jsonl" for cache in arms}
    with shadow_in_front(engine, big_model, journals[True], True) as (on, on_service), \
            shadow_in_front(engine, big_model, journals[False], False) as (off, off_service):
        apps = {True: (on, on_service), False: (off, off_service)}
        for n in range(SESSIONS):
            for cache, (client, service) in apps.items():
                seconds, chunks, ids = one_session(client, service, n)
                arms[cache]["reads"].append(seconds)
                arms[cache]["chunks"].append(chunks)
                arms[cache]["ids"][f"opencode-{n}"] = ids
        for cache, (client, service) in apps.items():
            arms[cache]["status"] = service.status()
            arms[cache]["metrics"] = client.get("/metrics").text
    for cache, journal in journals.items():
        turns = [json.loads(line) for line in journal.read_text().splitlines()]
        arms[cache]["lines"] = {r["session"]: r["prefix_cache_line"] for r in turns if r.get("kind") == "turn"}
    return arms


def test_twenty_sessions_sharing_a_system_prompt_and_tools_start_at_its_last_line(transformers_engine, big_model,
                                                                               tmp_path):
    arms = run_sessions(transformers_engine, big_model, tmp_path)
    with_cache, without = arms[True], arms[False]
    first = with_cache["ids"]["opencode-0"]
    shared = {name: common_prefix(first, ids) // G * G for name, ids in with_cache["ids"].items()}
    assert 10_000 < len(first) < 16_000 and min(list(shared.values())[1:]) >= 10_000  # a 12k-token prefix
    assert with_cache["lines"]["opencode-0"] == 0
    for n in range(1, SESSIONS):
        name = f"opencode-{n}"
        assert with_cache["lines"][name] == shared[name], name  # the shared prefix's last grid line
    cache = with_cache["status"]["prefix_cache"]
    assert cache["hits"] == SESSIONS - 1 and cache["tokens_saved"] == sum(list(shared.values())[1:])
    assert "shadow_prefix_cache_hits_total{" in with_cache["metrics"]
    assert "shadow_prefix_cache_tokens_saved_total" in with_cache["metrics"]
    assert "shadow_prefix_cache_bytes" in with_cache["metrics"]

    assert without["status"]["prefix_cache"] is None and set(without["lines"].values()) == {0}
    assert "shadow_prefix_cache" not in without["metrics"]
    assert without["ids"] == with_cache["ids"]  # the same prompts, read the same way but from their start
    assert all(c == len(i) // G for c, i in zip(without["chunks"], without["ids"].values()))

    out = os.environ.get("SHADOW_PREFIX_CACHE_TIMES")
    if out:
        later_with, later_without = with_cache["reads"][1:], without["reads"][1:]
        Path(out).write_text(json.dumps({
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads 1 (tests/conftest.py)",
            "load_average_after": os.getloadavg(),
            "sessions": SESSIONS, "grid": G, "first_prompt_tokens": len(first),
            "shared_line": shared["opencode-1"],
            "read_s_with_cache": {"first": with_cache["reads"][0], "later_median": statistics.median(later_with)},
            "read_s_without_cache": {"first": without["reads"][0], "later_median": statistics.median(later_without)},
            "chunks_with_cache_later": with_cache["chunks"][1:], "chunks_without_cache_later": without["chunks"][1:],
            "speedup_median": statistics.median(later_without) / statistics.median(later_with),
            "speedup_paired_median": statistics.median(b / a for a, b in zip(later_with, later_without)),
            "prefix_cache": with_cache["status"]["prefix_cache"],
        }, indent=1) + "\n")
