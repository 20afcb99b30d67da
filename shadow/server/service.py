"""The live shadow: sessions fed from served turns, read under the bandwidth rule, asked over HTTP.

One thread owns the device (`DeviceThread`): the generator's turns (or, behind a proxy, the
feeding of the shadow), the reader's chunks, asks and spills all run on it, one at a time. The
idle window is a thread of its own: every poll it looks whether a request runs or waits, and if
none does it hands the device one chunk at a time for at most a burst, checking before every
chunk, so a request waits for at most one chunk. Inside a turn, `share_slice` runs between decode
rounds (or streamed deltas) and reads whole chunks within the share of the time since the turn's
first token.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from shadow.errors import ShadowInputError, ShadowNotExact, ShadowUnavailable
from shadow.model.config import ModelConfig
from shadow.reader import Reader, Session, common_prefix
from shadow.routereval import ids_crc
from shadow.schedule import BandwidthRule
from shadow.server.device import DeviceThread
from shadow.server.idcheck import SessionChecks, TurnCheck, TurnIds
from shadow.voice.voice import Phrase, Voice, VoiceBudget
from shadow.store import SessionStore

T = TypeVar("T")
log = logging.getLogger("shadow.serve")


@dataclass
class Turn:
    """One request being served: its session (the store's name: the session, or a side branch of
    it), the name the request gave (None: found by prefix or new), when it started, when its
    first token came."""

    session: str | None
    started: float
    requested: str | None = None
    prompt_len: int = 0  # ids of the prompt fed
    output_len: int = 0  # output ids fed after it
    first_token: float | None = None
    share_used: float = 0.0
    voice: VoiceBudget = field(default_factory=VoiceBudget)
    phrases: deque = field(default_factory=deque)  # phrase requests waiting for this turn's rounds (embedded)
    embedded: bool = False  # the embedded engine's turn: it holds the device through its rounds
    prompt_fed: bool = False
    reference: str | None = None


@dataclass(frozen=True)
class StandingQuestion:
    """A question asked of the shadow at every qualifying turn's insertion point (the prompt's last
    <|im_end|>), answered when the reader reaches it, journaled beside the turn's reference label
    (a request header). Nothing of the turn changes."""

    name: str
    question_ids: tuple[int, ...]
    choice_ids: tuple[int, ...]
    labels: tuple[str, ...]
    min_prompt_tokens: int = 8192
    label_header: str = "x-shadow-label"
    text: str = ""  # as written in the file (what the upstream model is asked, when it labels)


def load_standing(path: Path, tokenizer) -> StandingQuestion:
    """A standing question from a JSON file {name, text, choices, min_prompt_tokens, label_header}."""
    try:
        doc = json.loads(Path(path).read_text())
        labels = tuple(str(c) for c in doc["choices"])
        return StandingQuestion(
            name=str(doc.get("name", Path(path).stem)), question_ids=tuple(tokenizer.encode(doc["text"])),
            choice_ids=tuple(tokenizer.single_token(c) for c in labels), labels=labels,
            min_prompt_tokens=int(doc.get("min_prompt_tokens", 8192)),
            label_header=str(doc.get("label_header", "x-shadow-label")).lower(), text=str(doc["text"]),
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ShadowInputError(f"{path}: not a standing question file ({type(e).__name__}: {e})") from None


@dataclass
class Pending:
    session: str
    insertion: int
    reference: str | None
    behind: int  # ids of the session not read when the turn began
    registered: float
    turn_id: int | None = None
    label_wanted: bool = False  # the upstream model is being asked for the reference label
    reference_source: str | None = None  # "header" or "upstream"
    upstream_answer: str | None = None


@dataclass
class Counters:
    requests: int = 0
    chunks_idle: int = 0
    chunks_share: int = 0
    share_s: float = 0.0  # seconds of reading charged to turns' shares (inside their decodes)
    chunks_ask: int = 0
    max_wait_on_reader_ms: float = 0.0  # the longest a request waited behind a reader chunk
    last_chunk_ms: float = 0.0
    asks: int = 0
    standing_answered: int = 0
    standing_replaced: int = 0  # a newer turn came before the reader reached the older point
    unloads: int = 0  # times the model was unloaded after an idle burst (sessions parked on disk)
    idle_errors: int = 0  # idle rounds that failed (the reader went on)
    idle_last_error: str | None = None
    last_answers: deque = field(default_factory=lambda: deque(maxlen=20))


class ShadowService:
    """The live shadow. With `reader` and `store` it is ready at once; with `load` instead (a
    function returning reader, store and the weights' label) it loads on the device thread as
    its first job after `start`, while requests pass through (proxy mode); until then nothing
    is fed, `match_session` finds nothing, and asks wait for it. With a loader, a disk and
    `unload_slack_bytes`, an idle burst that leaves more than that free in the device's memory
    pool (`pool_free`, by default CUDA's reserved minus allocated bytes) parks every session on
    disk and drops the model; the next turn or ask loads it again and reads on from disk."""

    def __init__(
        self, reader: Reader | None, store: SessionStore | None, rule: BandwidthRule = BandwidthRule(),
        journal: Path | None = None, weights: str = "", clock=time.monotonic,
        standing: StandingQuestion | None = None,
        load: Callable[[], tuple[Reader, SessionStore, str]] | None = None, config: ModelConfig | None = None,
        unload_slack_bytes: int | None = None, pool_free: Callable[[], int] | None = None,
        label_from_upstream: bool = False, prefix_match: bool = False, require_exact: bool = False,
        max_branches: int = 8, max_ask_tail: int | None = None, voice_tokenizer=None, voice_share: float = 0.03,
        voice_reader: Reader | None = None,
    ):
        if (reader is None or store is None) and (load is None or config is None):
            raise ValueError("give a reader and a store, or a function that loads them and the model's config")
        self.config = reader.model.config if reader is not None else config
        self.reader: Reader | None = None
        self.store: SessionStore | None = None
        self.weights, self.weights_hash = weights, ""
        self.ready = threading.Event()  # the model is loaded
        self._load_ended = threading.Event()  # loaded, or failed to
        self.load_error: str | None = None
        self._load = load
        self._loading = False
        self.unload_slack = unload_slack_bytes  # None: never unload
        self.label_from_upstream = label_from_upstream  # a turn with no label header: the proxy asks the engine
        self._awaiting_label: dict[int, dict] = {}  # turn id -> a standing answer waiting for its label
        self._pool_free = pool_free or self._cuda_pool_free
        self.voice_tokenizer = voice_tokenizer  # with it, the voice writes phrases after status lines
        self.voice_reader = voice_reader  # a model of its own for the voice (else the shadow's, forked)
        self.voice_share = voice_share
        self.voice: Voice | None = None
        self.voice_enabled = True  # switched off (A/B runs), no phrase is written
        if reader is not None and store is not None:
            self._use(reader, store, weights)
        self.rule = rule
        self.journal = Path(journal) if journal else None
        self.enabled = True  # switched off, the shadow feeds and reads nothing (for A/B runs)
        self.standing = standing
        self.pending: dict[str, Pending] = {}
        self.clock = clock
        # the GPU (or CPU): generator, reader, asks, and any spill of a session to disk
        self.device = DeviceThread()
        self.state_lock = threading.Lock()  # sessions, turns, counters
        self.turns: dict[int, Turn] = {}
        self.waiting = 0
        self.counters = Counters()
        self._recent: list[str] = []
        self._latest: dict[str, int] = {}  # session -> the newest turn that fed its prompt
        self.engine: dict | None = None  # proxy mode: the engine's dialect and id sources
        self.prefix_match = prefix_match  # a request with no session name continues the longest matching session
        self.require_exact = require_exact  # asks on sessions not verified against the engine answer 409
        self.max_branches = max_branches
        self.max_ask_tail = max_ask_tail  # unread ids an ask or summary may prefill in one fork
        self.checks: dict[str, SessionChecks] = {}  # store name -> its turns' checks against the engine
        self._heads: dict[str, list[int]] = {}  # store name -> its first grid of ids (to tell side requests)
        self._branches: dict[str, list[str]] = {}  # session name -> its side branches' store names
        self._auto_names = 0
        self._stop = threading.Event()
        self._idle = threading.Thread(target=self._idle_window, name="shadow-idle", daemon=True)

    # lifecycle --------------------------------------------------------------------------

    def _use(self, reader: Reader, store: SessionStore, weights: str) -> None:
        self.reader, self.store, self.weights = reader, store, weights
        if self.voice_tokenizer is None:
            self.voice = None
        elif self.voice_reader is not None:  # --voice-model: its own model, reading a window of each session
            self.voice = Voice(self.voice_reader, self.voice_tokenizer, own_model=True)
        else:
            self.voice = Voice(reader, self.voice_tokenizer)
        self.weights_hash = store.identity.weights_hash
        self.ready.set()
        self._load_ended.set()

    def _start_load(self) -> None:
        """Hand the device a load job, unless the model is there or a load is on its way."""
        with self.state_lock:
            if self._loading or self.ready.is_set() or self._load is None:
                return
            self._loading = True
            self._load_ended.clear()
        self.device.submit(self._load_now, "load")

    def _load_now(self) -> None:
        """On the device thread: load the model (unless there); a failure is kept for status and asks."""
        try:
            if not self.ready.is_set():
                self._use(*self._load())
                self.load_error = None
        except Exception as e:  # the proxy goes on passing requests through without a shadow
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("the shadow failed to load: %s", self.load_error)
        finally:
            with self.state_lock:
                self._loading = False
            self._load_ended.set()

    def start(self) -> None:
        self._start_load()
        self._idle.start()

    def _ensure_loaded(self) -> None:
        """On the device thread, before model work: load again if an idle burst unloaded the model."""
        if not self.ready.is_set() and self.load_error is None:
            self._load_now()
        if not self.ready.is_set():
            raise ShadowUnavailable(f"the shadow failed to load ({self.load_error})")

    def _wait_ready(self, timeout_s: float) -> None:
        """Wait for the model (loading in the background, or loaded again after an unload), up to timeout_s."""
        if not self.ready.is_set() and self.load_error is None:
            self._start_load()
        self._load_ended.wait(timeout_s)
        if not self.ready.is_set():
            raise ShadowUnavailable(self.load_error and f"the shadow failed to load ({self.load_error})"
                                    or "the shadow is still loading its model")

    def stop(self) -> None:
        """A planned stop: the idle reader ends after its chunk in flight; sessions go to disk."""
        self._stop.set()
        if self._idle.is_alive():
            self._idle.join(timeout=30)

        def close() -> tuple[int, list[tuple[str, str]]]:
            with self.state_lock:
                if self.store is None:
                    return 0, []
                n = len(self.store.names()) if self.store.disk is not None else 0
                return n, self.store.close()

        held, failed = self.device.run(close, "stop")
        self.device.close()
        if self.store is not None and self.store.disk is not None:
            log.info("stopped: %d session(s) on %s", held - len(failed), self.store.disk)
        for name, reason in failed:
            log.error("stopped: session %s could not be written: %s", name, reason)

    # turns ------------------------------------------------------------------------------

    def run_request(self, fn: Callable[[], T]) -> T:
        """Run a request's device work (a turn, the feeding of a proxied one) on the device; while it
        waits it counts as waiting (the idle reader stops), and how long it waited behind the
        reader is recorded."""
        with self.state_lock:
            self.waiting += 1
            behind_reader = self.device.running == "reader"
        start = self.clock()

        def job() -> T:
            waited = (self.clock() - start) * 1000
            with self.state_lock:
                self.waiting -= 1
                if behind_reader:
                    self.counters.max_wait_on_reader_ms = max(self.counters.max_wait_on_reader_ms, waited)
            return fn()

        return self.device.run(job, "turn")

    def begin_turn(self, turn_id: int, session: str | None, prompt_ids: Sequence[int] | None = None,
                   reference: str | None = None, requested: str | None = None) -> None:
        """A request starts (the idle window stops). `session` is the store name when known (see
        `session_for`); else it is found when the prompt comes, from `requested` (the name the
        request gave, or None). With its prompt, the prompt is fed (rolling back where it
        differs), on the device thread. Checks ids before any change."""
        ids = None if prompt_ids is None or not self.ready.is_set() else self.reader.check_ids(prompt_ids)
        with self.state_lock:
            self.turns[turn_id] = Turn(session, self.clock(), requested=requested, reference=reference,
                                       voice=VoiceBudget(self.voice_share))
            self.counters.requests += 1
        if ids is not None:
            self.set_prompt(turn_id, ids)

    def set_prompt(self, turn_id: int, prompt_ids: Sequence[int]) -> None:
        """Feed a turn's prompt once known (a proxy learns it from the engine), on the device thread."""
        if not self.ready.is_set() and self.load_error is None and self.enabled:
            self._load_now()  # unloaded after an idle burst: load again, then read on from disk
        if not self.ready.is_set() or not self.enabled:  # no model (it failed to load), or switched off
            return
        ids = self.reader.check_ids(prompt_ids)
        if self.turns[turn_id].session is None:
            name = self.session_for(self.turns[turn_id].requested, ids)
            with self.state_lock:
                self.turns[turn_id].session = name
        with self.state_lock:
            turn = self.turns[turn_id]
            if self._latest.get(turn.session, 0) > turn_id:
                return  # a newer turn of this session has fed already: this one came too late
            self._latest[turn.session] = turn_id
            session = self.store.get(turn.session)
            behind = len(session.ids) - session.committed
            known = len(session.ids)
            feed = self.reader.feed_prompt(session, ids)
            self.checks.setdefault(turn.session, SessionChecks()).replaced(
                known if feed.first_diff is None else feed.first_diff)
            turn.prompt_fed, turn.prompt_len, turn.output_len = True, len(ids), 0
            self._touch(turn.session)
            self._register_standing(session, ids, turn.reference, behind, turn_id)
        self._answer_if_ready(session)

    def session_for(self, requested: str | None, prompt: Sequence[int]) -> str:
        """The store name a prompt is read into: the named session (or, unnamed, the resident
        session sharing the longest prefix, with prefix matching on; else a new `auto-N`), or
        one of its side branches. A prompt that shares less than half of a session's first block
        of the grid (of its first ids, if it has fewer) is a side request (opencode's title
        request beside its conversation: another system prompt) and is read as a side branch
        (`NAME~K`) instead of rolling the session back; an ordinary new turn, even one that
        differs where the last prompt's generation prompt was, shares far more. Later prompts
        continue whichever branch they share most with."""
        with self.state_lock:
            name = requested
            if name is None and self.prefix_match:
                name = self._match(prompt)
            if name is None:
                self._auto_names += 1
                name = f"auto-{self._auto_names}"
            grid = self.reader.grid if self.reader is not None else 512
            best, best_shared = None, -1
            for candidate in [name, *self._branches.get(name, [])]:
                head = self._heads.get(candidate)
                if not head:
                    if candidate == name and best is None:
                        best, best_shared = name, 0  # empty or new: anything continues it
                    continue
                shared = common_prefix(head, prompt)
                if 2 * shared >= min(grid, len(head), len(prompt)) and shared > best_shared:
                    best, best_shared = candidate, shared
            if best is None:
                branches = self._branches.setdefault(name, [])
                if len(branches) >= self.max_branches:  # the least recently used branch is reused
                    best = min(branches, key=lambda b: self._recent.index(b) if b in self._recent else -1)
                else:
                    best = f"{name}~{len(branches) + 1}"
                    branches.append(best)
            self._heads[best] = list(prompt[:grid])
            return best

    def cached_prefix(self, requested: str | None, prompt: Sequence[int]) -> int:
        """How many of a prompt's ids the session (or one of its branches) held already: what an
        engine with a prefix cache holds for it, so the rest is what it must read."""
        with self.state_lock:
            if requested is None or self.store is None:
                return 0
            best = 0
            for name in [requested, *self._branches.get(requested, [])]:
                s = self.store.peek(name)
                if s is not None:
                    best = max(best, common_prefix(s.ids, prompt))
            return best

    def _match(self, prompt: Sequence[int], minimum: int = 64) -> str | None:
        """The resident main session sharing the longest prefix (at least `minimum` ids); the caller holds the lock."""
        best, best_len = None, minimum - 1
        if not self.ready.is_set():
            return None
        side = {b for branches in self._branches.values() for b in branches}
        for name in self._recent:
            s = self.store.peek(name)
            if s is None or name in side:
                continue
            n = common_prefix(s.ids, prompt)
            if n > best_len:
                best, best_len = name, n
        return best

    def record_turn(self, turn_id: int, check: TurnCheck, ids: TurnIds | None = None,
                    lines: list[dict] | None = None) -> None:
        """A turn's check against the engine: counted for its session, journaled (with the status
        lines the client was shown, each with its kind and time), and a session's first mismatch
        logged once."""
        with self.state_lock:
            turn = self.turns.get(turn_id)
            name = (turn.session or turn.requested) if turn else None
            name = name or "(no session)"
            checks = self.checks.setdefault(name, SessionChecks())
            latest = turn is not None and turn.prompt_fed and self._latest.get(name) == turn_id
            first = checks.add(turn_id, check, turn.prompt_len if turn else 0, turn.output_len if turn else 0, latest)
            record = {"kind": "turn", "session": name, "turn": turn_id, **check.as_dict(),
                      "prompt_ids": None if ids is None or ids.prompt is None else len(ids.prompt),
                      "output_ids": None if ids is None else len(ids.output),
                      "notes": [] if ids is None else ids.notes, "time": time.time()}
            if lines:
                record["status_lines"] = lines
            self._journal(record)
        if first:
            log.warning("session %s: turn %s does not match the engine (%s); the session is not exact from here on",
                        name, turn_id, "; ".join(check.reasons))

    def journal_lines(self, turn_id: int, session: str, lines: list[dict]) -> None:
        """The status lines a turn's client was shown, each with its kind, time and voice phrase
        (the embedded engine's turns: their check is journaled before their stream ends)."""
        if lines:
            with self.state_lock:
                self._journal({"kind": "status_lines", "session": session, "turn": turn_id, "status_lines": lines,
                               "time": time.time()})

    def exactness(self, session: str) -> dict:
        """What the session's answers say of its ids: exact (every turn verified) or why not."""
        with self.state_lock:
            checks = self.checks.get(session, SessionChecks())
            length = self._length(session)
            return {"exact": checks.exact(length), "why_not": checks.why_not(length), "id_checks": checks.as_dict(length)}

    def has_prompt(self, turn_id: int) -> bool:
        with self.state_lock:
            return self.turns[turn_id].prompt_fed

    def first_token(self, turn_id: int) -> None:
        with self.state_lock:
            self.turns[turn_id].first_token = self.clock()

    # the voice ---------------------------------------------------------------------------

    def voice_phrase(self, turn_id: int, kind: str, extra: Sequence[int] = (), recent: Sequence[str] = (),
                     lang: str = "en", wait_s: float = 0.3) -> Phrase | None:
        """A voice phrase for a status line of this turn, if the turn's voice budget holds one and
        the device can write it now: at once where the device is free (proxy mode), else between
        two of the turn's own rounds (embedded), waiting at most `wait_s`. None: nothing tried."""
        with self.state_lock:
            turn = self.turns.get(turn_id)
            if (self.voice is None or not self.enabled or not self.voice_enabled or turn is None or turn.session is None or not turn.prompt_fed
                    or not turn.voice.allows(turn.first_token, self.clock(), self.voice.cost_s)):
                return None
        job = lambda: self._phrase(turn, kind, extra, recent, lang)  # noqa: E731
        ran, result = self.device.run_if_idle(job, "voice")
        if ran:
            return result
        if turn.embedded:  # the turn's own rounds hold the device: it serves phrases between them
            request = Future()
            turn.phrases.append((job, request))
            try:
                return request.result(timeout=wait_s)
            except FutureTimeout:
                request.cancel()
        return None

    def serve_phrases(self, turn_id: int) -> None:
        """Between two rounds of a turn, on the device: write the phrases its stream asked for."""
        turn = self.turns.get(turn_id)
        while turn is not None and turn.phrases:
            job, request = turn.phrases.popleft()
            if request.set_running_or_notify_cancel():
                try:
                    request.set_result(job())
                except Exception as e:  # noqa: BLE001 - the stream gets no phrase; the turn goes on
                    request.set_exception(e)

    def _phrase(self, turn: Turn, kind: str, extra, recent, lang) -> Phrase | None:
        with self.state_lock:
            session = self.store.get(turn.session)
        if not self.voice.fits(session, extra):
            return None
        phrase = self.voice.phrase(session, kind, extra, recent, lang)
        turn.voice.used_s += phrase.seconds
        return phrase

    def add_output(self, turn_id: int, ids: Sequence[int]) -> None:
        """Append output ids, unless a newer turn of the session has fed its prompt since (that
        prompt holds this answer already, re-rendered)."""
        if not self.enabled or not self.has_prompt(turn_id):
            return
        with self.state_lock:
            if self._latest.get(self.turns[turn_id].session) != turn_id:
                return
            turn = self.turns[turn_id]
            self.reader.feed_output(self.store.get(turn.session), ids)
            turn.output_len += len(ids)

    def share_slice(self, turn_id: int) -> int:
        """Between two rounds, on the device thread: read whole chunks of this turn's
        session within the share of the time since its first token, at most one slice."""
        with self.state_lock:
            turn = self.turns[turn_id]
            if turn.first_token is None or not turn.prompt_fed:
                return 0
            budget = self.rule.share_budget(turn.first_token, self.clock(), turn.share_used)
            session = self.store.get(turn.session)
        if self.counters.last_chunk_ms:  # the next chunk's cost estimated from the last one
            chunks = self.rule.slice_chunks(budget, self.counters.last_chunk_ms / 1000)
        else:  # no cost known yet: one chunk, to measure it
            chunks = 1 if budget > 0 else 0
        if chunks == 0:
            return 0
        start = self.clock()
        done = self._read(session, chunks)
        with self.state_lock:
            used = self.clock() - start
            turn.share_used += used
            self.counters.share_s += used
            self.counters.chunks_share += done
        return done

    def end_turn(self, turn_id: int) -> None:
        """The request is over; sessions past the cap spill, on the device (a spill reads session
        tensors, which nothing may change meanwhile)."""

        def end() -> None:
            with self.state_lock:
                turn = self.turns.pop(turn_id)
                if turn.prompt_fed:
                    self.store.settle(keep=turn.session)

        self.device.run(end, "end turn")

    # the idle window ----------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.turns) or self.waiting > 0

    def _idle_window(self) -> None:
        """The idle reader's thread: one poll round after another until the stop. A round that
        fails (a spill's disk, a bug) is logged and counted, and the next round goes on: the
        thread never dies (status shows its errors and the last one)."""
        while not self._stop.is_set():
            try:
                self._idle_round()
            except Exception as e:  # noqa: BLE001 - kept, counted, shown; the reader goes on
                with self.state_lock:
                    self.counters.idle_errors += 1
                    self.counters.idle_last_error = f"{type(e).__name__}: {e}"
                log.exception("an idle round failed; the idle reader goes on")
                self._stop.wait(1.0)

    def _idle_round(self) -> None:
        now = self.clock()
        self._stop.wait(max(0.0, self.rule.next_poll(now + 1e-6) - now))
        if not (self._stop.is_set() or self.busy() or not self.enabled):
            burst_start = self.clock()
            while not self._stop.is_set() and not self.busy() and self.device.idle():
                chunk_s = self.counters.last_chunk_ms / 1000
                if not self.rule.burst_allows(burst_start, self.clock(), chunk_s):
                    break
                if not self.device.run(self._idle_chunk, "reader"):
                    break
            if self.unload_slack is not None and not self.busy() and self.device.idle():
                self.device.run(self._unload_if_slack, "unload")

    def _cuda_pool_free(self) -> int:
        """Bytes the caching allocator holds for the model's device and nothing uses (0 off CUDA)."""
        device = self.reader.model.device if self.reader is not None else None
        if device is None or device.type != "cuda":
            return 0
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def _unload_if_slack(self) -> None:
        """On the device, after an idle burst with nothing left to read: when more than the slack
        sits free in the pool, park every session on disk and let the model go (DESIGN 7); the
        next turn or ask loads it again and reads on from disk."""
        if (self.busy() or not self.ready.is_set() or self._load is None or self.store.disk is None
                or self.pending or self._pool_free() <= self.unload_slack):
            return
        with self.state_lock:
            if self._next_backlog() is not None:
                return
            if self.store.close():  # a session that could not be written stays: no unload
                return
            self.reader, self.store = None, None
            self.ready.clear()
            self._load_ended.clear()
            self.counters.unloads += 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _idle_chunk(self) -> int:
        """One chunk of the session with the most recent turn that has one, unless a request came
        (checked on the device, before every chunk: a waiting request goes first)."""
        if self.busy() or not self.ready.is_set():
            return 0
        with self.state_lock:
            session = self._next_backlog()
        if session is None:
            return 0
        done = self._read(session, 1)
        with self.state_lock:
            self.counters.chunks_idle += done
            self.store.settle(keep=session.name)
        return done

    def _next_backlog(self) -> Session | None:
        """The resident session with the most recent turn that has a whole chunk to read (spilled
        sessions wait on disk for their next turn rather than thrash the cap)."""
        for name in reversed(self._recent):
            s = self.store.peek(name)
            if s is not None and s.committed + self.reader.grid <= len(s.ids):
                return s
        return None

    def _register_standing(self, session: Session, prompt: list[int], reference: str | None, behind: int,
                           turn_id: int | None = None) -> None:
        q = self.standing
        if q is None or len(prompt) < q.min_prompt_tokens:
            return
        eos = self.reader.model.config.eos_token_id
        last = max((i for i, t in enumerate(prompt) if t == eos), default=None)
        if last is None:
            return
        if session.name in self.pending:
            self.counters.standing_replaced += 1
        wanted = self.label_from_upstream and reference is None
        self.pending[session.name] = Pending(session.name, last + 1, reference, behind, self.clock(), turn_id, wanted,
                                             "header" if reference is not None else None)

    def wants_label(self, turn_id: int) -> bool:
        """Whether this turn's standing question waits for a label from the upstream model."""
        with self.state_lock:
            return turn_id in self._awaiting_label or any(
                p.turn_id == turn_id and p.label_wanted for p in list(self.pending.values()))

    def upstream_label(self, turn_id: int, label: str | None, answer: str | None) -> None:
        """The upstream model's answer to the turn's standing question (`label` when it is one of
        the choices, else None): it becomes the reference of the shadow's answer, which is then
        journaled (at once if the shadow answered already)."""

        def attach() -> None:
            record = self._awaiting_label.pop(turn_id, None)
            if record is not None:
                self._record(record | {"reference": label, "reference_source": "upstream", "upstream_answer": answer})
                return
            for p in self.pending.values():
                if p.turn_id == turn_id and p.label_wanted:
                    p.reference, p.reference_source, p.upstream_answer = label, "upstream", answer
                    p.label_wanted = False

        self.device.run(attach, "label")

    def _answer_if_ready(self, session: Session) -> None:
        """Answer the session's standing question once the reader sits at its insertion point's
        grid line (on the device thread)."""
        p = self.pending.get(session.name)
        line = None if p is None else p.insertion // self.reader.grid * self.reader.grid
        if p is None or session.committed < line:
            return
        if session.committed > line or p.insertion > len(session.ids):
            self.pending.pop(session.name)  # the session changed under it: nothing valid to ask
            return
        q = self.standing
        probs = self.reader.ask(session, q.question_ids, q.choice_ids, end=p.insertion).tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        self.pending.pop(session.name)
        record = {
            "standing": q.name, "session": session.name, "choices": list(q.labels), "probs": probs,
            "label": q.labels[best], "reference": p.reference, "reference_source": p.reference_source,
            "fresh": None, "behind": p.behind, "lag_s": round(self.clock() - p.registered, 4),
            "weights": self.weights, "weights_hash": self.weights_hash, "grid": self.reader.grid,
            "arithmetic": self.store.identity.arithmetic, "insertion": p.insertion,
            "prefix_crc": ids_crc(session.ids[: p.insertion]), "question_tokens": len(q.question_ids),
            "question_ids": list(q.question_ids), "time": time.time(),
        }
        if p.upstream_answer is not None:
            record["upstream_answer"] = p.upstream_answer
        self.counters.standing_answered += 1
        if p.label_wanted and p.turn_id is not None:  # journaled when the upstream's label comes
            self._awaiting_label[p.turn_id] = record
        else:
            self._record(record)

    def _record(self, answer: dict) -> None:
        self.counters.last_answers.append(answer)
        self._journal(answer)

    def _journal(self, record: dict) -> None:
        """Append a record; the journal is the service's own (mode 0600: it holds what was asked)."""
        if self.journal:
            fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _read(self, session: Session, chunks: int) -> int:
        """Read up to `chunks` whole chunks, stopping at a standing question's grid line to answer
        it; the device is synchronised so the cost is known."""
        p = self.pending.get(session.name)
        if p is not None:
            line = p.insertion // self.reader.grid * self.reader.grid
            chunks = min(chunks, max(0, (line - session.committed) // self.reader.grid))
        start = time.perf_counter()
        done = self.reader.advance(session, max_chunks=chunks) if chunks else 0
        if self.reader.model.device.type == "cuda":
            torch.cuda.synchronize()
        if done:
            self.counters.last_chunk_ms = (time.perf_counter() - start) * 1000 / done
        if p is not None:
            self._answer_if_ready(session)
        return done

    def _touch(self, name: str) -> None:
        if name in self._recent:
            self._recent.remove(name)
        self._recent.append(name)

    # questions --------------------------------------------------------------------------

    def main_branch(self, session: str) -> str:
        """The store name an ask about `session` reads: of the session and its side branches, the
        one holding the most ids (the conversation, not a title request beside it)."""
        with self.state_lock:
            names = [session, *self._branches.get(session, [])]
            if len(names) == 1:
                return session
            return max(names, key=lambda n: self._length(n))

    def _rollbacks(self, name: str) -> int | None:
        s = self.store.peek(name) if self.store is not None else None
        return None if s is None else s.rollbacks

    def _length(self, name: str) -> int:
        s = self.store.peek(name) if self.store is not None else None
        if s is not None:
            return len(s.ids)
        row = next((r for r in self.store.status() if r.name == name), None) if self.store is not None else None
        return row.committed + row.pending if row is not None else 0

    def _check_tail(self, s: Session) -> None:
        """An ask forwards the unread tail in one fork: refuse one longer than the limit (memory)."""
        tail = len(s.ids) - s.committed
        if self.max_ask_tail is not None and tail > self.max_ask_tail:
            raise ShadowUnavailable(f"session {s.name!r} is {tail:,} ids behind (more than {self.max_ask_tail:,} "
                                    "to read in one fork); ask again with a longer timeout_s")

    def _exact_or_refuse(self, session: str) -> dict:
        exact = self.exactness(session)
        if self.require_exact and not exact["exact"]:
            raise ShadowNotExact(f"session {session!r} is not exact: {exact['why_not']}")
        return exact

    def known(self, session: str) -> bool:
        with self.state_lock:
            return session in self._recent or (self.store is not None and session in self.store.names())

    def _read_to_end(self, session: str, timeout_s: float, started: float) -> tuple[Session, int, int]:
        """On the device: read `session` to its last whole chunk (answering standing questions on
        the way) until timeout_s after `started`; returns (session, ids unread before, chunks read)."""
        with self.state_lock:
            s = self.store.get(session)
            behind = len(s.ids) - s.committed
        read = 0
        while self.clock() - started < timeout_s:
            waiting = s.name in self.pending
            if self._read(s, 1):
                read += 1
            elif not (waiting and s.name not in self.pending):  # nothing read, nothing answered
                break
        return s, behind, read

    def ask(self, session: str, question: Sequence[int], choices: Sequence[int], labels: Sequence[str],
            timeout_s: float = 10.0, reference: str | None = None, fresh: bool | None = None) -> dict:
        """Read the session up to the question's insertion point (its last id, within timeout_s),
        then one forward of the pending tail and the question in a fork: the letters' softmax."""
        self._wait_ready(timeout_s)
        question = self.reader.check_ids(question)
        choice_ids = self.reader.check_ids(choices)
        if not self.known(session):
            raise ShadowInputError(f"unknown session {session!r}")
        named, session = session, self.main_branch(session)
        exact = self._exact_or_refuse(session)
        started = self.clock()

        def on_device():
            self._ensure_loaded()  # an idle burst may have unloaded it since the wait
            s, behind, read = self._read_to_end(session, timeout_s, started)
            self._check_tail(s)
            probs = self.reader.ask(s, question, choice_ids).tolist()
            with self.state_lock:
                self.store.settle(keep=session)
            return s, behind, read, probs

        s, behind, read, probs = self.device.run(on_device, "ask")
        best = max(range(len(probs)), key=probs.__getitem__)
        answer = {
            "session": named, "read": session, "choices": list(labels), "probs": probs, "label": labels[best],
            "behind": behind, "read_chunks": read, "pending_after": len(s.ids) - s.committed,
            "latency_ms": round((self.clock() - started) * 1000, 3), "weights": self.weights,
            "weights_hash": self.weights_hash, "grid": self.reader.grid, "arithmetic": self.store.identity.arithmetic,
            "insertion": len(s.ids),
            "prefix_crc": ids_crc(s.ids),
            "question_tokens": len(question), "question_ids": list(question), "reference": reference,
            "fresh": fresh, "time": time.time(), **exact,
        }
        with self.state_lock:
            self.counters.asks += 1
            self.counters.chunks_ask += read
            self._record(answer)
        return answer

    def summarize(self, session: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 10.0) -> dict:
        """Read the session to its end (within timeout_s), then decode greedily from a fork over the
        pending tail and `prompt` (a summary of the session); the session is left as it was."""
        self._wait_ready(timeout_s)
        prompt = self.reader.check_ids(prompt)
        if not self.known(session):
            raise ShadowInputError(f"unknown session {session!r}")
        named, session = session, self.main_branch(session)
        exact = self._exact_or_refuse(session)
        started = self.clock()

        def on_device():
            self._ensure_loaded()
            s, behind, _ = self._read_to_end(session, timeout_s, started)
            self._check_tail(s)
            decode_start = self.clock()
            out = self.reader.decode(s, prompt, max_tokens, stop=[self.reader.model.config.eos_token_id])
            return out, behind, self.clock() - decode_start

        out, behind, decode_s = self.device.run(on_device, "ask")
        return {"session": named, "read": session, "ids": out, "behind": behind, "weights": self.weights,
                "latency_ms": round((self.clock() - started) * 1000, 3),
                "decode_ms_per_token": round(decode_s * 1000 / max(1, len(out)), 3), **exact}

    def status(self) -> dict:
        with self.state_lock:
            c = self.counters
            ready = self.ready.is_set()
            return {
                "ready": ready, "load_error": self.load_error, "engine": self.engine,
                "grid": self.reader.grid if ready else None, "weights": self.weights, "enabled": self.enabled, "voice": self.voice_enabled,
                "sessions": [vars(r) | {"rollbacks": self._rollbacks(r.name), "id_checks": self.checks.get(
                                 r.name, SessionChecks()).as_dict(r.committed + r.pending)}
                             for r in self.store.status()] if ready else [],
                "branches": {k: list(v) for k, v in self._branches.items() if v},
                "store": self.store.totals() if ready else None,
                "turns_in_flight": len(self.turns), "waiting": self.waiting,
                "counters": {
                    "requests": c.requests, "chunks_idle": c.chunks_idle, "chunks_share": c.chunks_share,
                    "share_s": round(c.share_s, 6),
                    "chunks_ask": c.chunks_ask, "asks": c.asks, "last_chunk_ms": round(c.last_chunk_ms, 3),
                    "standing_answered": c.standing_answered, "standing_replaced": c.standing_replaced,
                    "standing_pending": len(self.pending), "unloads": c.unloads,
                    "max_wait_on_reader_ms": round(c.max_wait_on_reader_ms, 3),
                },
                "idle_reader": {"alive": self._idle.is_alive(), "errors": c.idle_errors,
                                "last_error": c.idle_last_error},
                "last_answers": list(c.last_answers),
            }
