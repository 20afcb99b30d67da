"""Asks and summaries over HTTP: a session read to its end (within the ask's time), then one fork.

An ask's session comes first in the read scheduler while the ask reads it (`Questions.asking`); its
chunks are reported like every other read. The fork prefills the unread tail and the question
above the read position and puts the state back: the session is left bit for bit as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from shadow.core.reader import Session
from shadow.errors import ShadowInputError, ShadowUnavailable
from shadow.offline.journal import ids_crc
from shadow.server.host import ModelHost
from shadow.server.reading import Questions, Reading
from shadow.server.shared import Shared
from shadow.server.timings import Histogram

log = logging.getLogger("shadow.serve")


class Asking:
    """`resolve(session, timeout_s)` waits for the shadow and returns the store name an ask about
    `session` reads and what its checks say of it (`ShadowService.resolve`), or raises. Each ask
    answered is timed into `latency` (its `latency_ms`, in seconds) and `wait` (of that, the wait
    for the device: its `device_wait_ms`, with `device_busy_with`, the kind of job the device ran
    when the ask was handed in, or None), under the lock. Its `parts_ms` split the latency whole:
    `device_wait`, `in_flight` (a batched read under way, read to its end first), `restore` (the
    lock, and the session brought back from the host tier or disk: `brought_back`, its tier and
    bytes, or None), `read` (reading the session to the insertion point), `forward` (the fork's)
    and `back` (the device thread's hand-back). The
    store settles back within its cap after the answer, as the device thread's next job
    (`settle_after`)."""

    def __init__(self, shared: Shared, host: ModelHost, reading: Reading, questions: Questions, vocab_size: int,
                 resolve: Callable[[str, float], tuple[str, dict]]):
        self.host, self.reading, self.questions, self.vocab_size, self.resolve = host, reading, questions, vocab_size, resolve
        self.device, self.lock, self.clock = shared.device, shared.lock, shared.clock
        self.counters, self.journal = shared.counters, shared.journal
        self.max_tail = shared.settings.limits.max_ask_tail  # unread ids an ask or summary may prefill in one fork
        self.latency, self.wait = Histogram(), Histogram()

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        bad = next((i for i in out if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ShadowInputError(f"token id {bad} is outside the vocabulary (0 .. {self.vocab_size - 1})")
        return out

    def _check_tail(self, s: Session) -> None:
        """An ask forwards the unread tail in one fork: refuse one longer than the limit (memory)."""
        tail = len(s.ids) - s.committed
        if self.max_tail is not None and tail > self.max_tail:
            raise ShadowUnavailable(f"session {s.name!r} is {tail:,} ids behind (more than {self.max_tail:,} "
                                    "to read in one fork); ask again with a longer timeout_s")

    def ask(self, session: str, question: Sequence[int], choices: Sequence[int], labels: Sequence[str],
            timeout_s: float = 10.0, reference: str | None = None, *, fresh: bool | None = None) -> dict:
        """Read the session up to the question's insertion point (its last id, within timeout_s),
        then one forward of the pending tail and the question in a fork: the letters' softmax."""
        question, choice_ids = self.check_ids(question), self.check_ids(choices)
        name, exact = self.resolve(session, timeout_s)
        started = self.clock()
        busy_with = self.device.running  # what a long wait waited behind (read without the device's lock)

        def on_device():
            on = self.clock()
            shadow = self.host.ensure()  # an idle burst may have unloaded it since the wait
            with self.questions.asking(name):
                self.reading.finish_in_flight()
                in_flight = self.clock()
                with self.lock:
                    before = _moves(shadow.store.counters)
                    self.reading.get(shadow, name)  # resident from here (read_to_end's own get finds it so)
                    brought = _brought_back(before, _moves(shadow.store.counters))
                restored = self.clock()
                s, behind, read = self.reading.read_to_end(shadow, name, timeout_s, started)
                self._check_tail(s)
                forward = self.clock()
                probs = shadow.reader.ask(s, question, choice_ids).tolist()
            marks = (on, in_flight, restored, forward, self.clock())
            return shadow, s, behind, read, probs, marks, brought

        shadow, s, behind, read, probs, marks, brought = self.device.run(on_device, "ask")
        self.settle_after(shadow, name)
        on, in_flight, restored, forward, done = marks
        latency, waited = self.clock() - started, on - started
        best = max(range(len(probs)), key=probs.__getitem__)
        answer = {
            "session": session, "read": name, "choices": list(labels), "probs": probs, "label": labels[best],
            "behind": behind, "read_chunks": read, "pending_after": len(s.ids) - s.committed,
            "latency_ms": round(latency * 1000, 3), "device_wait_ms": round(waited * 1000, 3),
            "device_busy_with": busy_with,
            "parts_ms": {k: round(v * 1000, 3) for k, v in (
                ("device_wait", waited), ("in_flight", in_flight - on), ("restore", restored - in_flight),
                ("read", forward - restored), ("forward", done - forward),
                ("back", started + latency - done))},
            "brought_back": brought,
            "weights": shadow.weights,
            "weights_hash": shadow.weights_hash, "grid": shadow.grid, "arithmetic": shadow.store.identity.arithmetic,
            "insertion": len(s.ids), "prefix_crc": ids_crc(s.ids),
            "question_tokens": len(question), "question_ids": list(question), "reference": reference,
            "fresh": fresh, "time": time.time(), **exact,
        }
        with self.lock:
            self.counters.asks += 1
            self.latency.observe(latency)
            self.wait.observe(waited)
            self.journal.answer(answer)
        return answer

    def settle_after(self, shadow, name: str) -> None:
        """The store back within its cap after an answer (`Reading.settle`, `name` kept), as the
        device thread's next job: the answer does not wait for it. A settle that fails is logged and
        counted with the idle reader's errors (status `idle_reader.errors`), never lost."""
        def settle() -> None:
            with self.lock:
                self.reading.settle(shadow, keep=name)

        def done(future) -> None:
            error = future.exception()
            if error is not None:
                with self.lock:
                    self.counters.idle_errors += 1
                    self.counters.idle_last_error = f"a settle after an ask: {type(error).__name__}: {error}"
                log.error("the settle after an ask about %r failed: %s", name, error, exc_info=error)

        try:
            self.device.submit(settle, "settle").add_done_callback(done)
        except RuntimeError:  # the device thread has stopped (the service is closing): nothing to keep within
            pass

    def summarize(self, session: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 10.0) -> dict:
        """Read the session to its end (within timeout_s), then decode greedily from a fork over the
        pending tail and `prompt` (a summary of the session); the session is left as it was."""
        prompt = self.check_ids(prompt)
        name, exact = self.resolve(session, timeout_s)
        started = self.clock()

        def on_device():
            shadow = self.host.ensure()
            with self.questions.asking(name):
                s, behind, _ = self.reading.read_to_end(shadow, name, timeout_s, started)
                self._check_tail(s)
                decode_start = self.clock()
                out = shadow.reader.decode(s, prompt, max_tokens, stop=[shadow.reader.model.config.eos_token_id])
            return shadow, out, behind, self.clock() - decode_start

        shadow, out, behind, decode_s = self.device.run(on_device, "ask")
        return {"session": session, "read": name, "ids": out, "behind": behind, "weights": shadow.weights,
                "latency_ms": round((self.clock() - started) * 1000, 3),
                "decode_ms_per_token": round(decode_s * 1000 / max(1, len(out)), 3), **exact}


def _moves(c) -> tuple[int, int, int, int, int]:
    """The store's counters of sessions brought back (`StoreCounters`): moves from the host tier,
    their bytes, those kept on the device (asked for while their copy out was in flight: no
    copy back), restores from disk, their bytes."""
    return c.from_host, c.bytes_from_host, c.moves_kept, c.restores, c.bytes_restored


def _brought_back(before: tuple, after: tuple) -> dict | None:
    """What one `get` brought back onto the device, from `_moves` before and after it under the
    lock: {"tier": "host" or "disk", "bytes": n}, or None (resident, new, or kept while leaving)."""
    from_host, host_bytes, kept, restores, disk_bytes = (b - a for a, b in zip(before, after))
    if from_host and not kept:
        return {"tier": "host", "bytes": host_bytes}
    if restores and not kept:
        return {"tier": "disk", "bytes": disk_bytes}
    return None
