"""The embedded generator's requests on the device: each `Generation` takes a slot among the
engine's (`EmbeddedEngine.slots`), then slices on the device thread until it is over, the shadow
reading between its rounds; its events (tokens, its end, an error) go to its stream's
`StreamEvents`. A generation runs at most `AHEAD` events ahead of what its relay has taken: a
client that reads nothing holds its stream's writes, and so its generation, until the write
times out and the stream's close cancels it (its slot is free again)."""

from __future__ import annotations

import threading
import time

from shadow.engines.idcheck import TurnIds, check_turn
from shadow.server import gcpauses
from shadow.server.events import Events
from shadow.server.gaps import RoundClock
from shadow.server.generator import Generator
from shadow.server.service import ShadowService
from shadow.server.turn import ServedTurn

END = object()  # the generator's steps are over
SLICE_S = 0.1  # how long a generation holds the device while another job waits, before it gives way
AHEAD = 64  # events a generation may run ahead of its relay


class StreamEvents(Events):
    """A stream's events, counting those its relay has taken (`ahead`: put and not taken yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.put_n = 0  # written on the generation's thread
        self.taken_n = 0  # written on the event loop

    def put(self, event: tuple) -> None:
        self.put_n += 1
        super().put(event)

    async def get(self, timeout_s: float) -> tuple | None:
        event = await super().get(timeout_s)
        self.taken_n += event is not None
        return event

    def get_nowait(self) -> tuple | None:
        event = super().get_nowait()
        self.taken_n += event is not None
        return event

    @property
    def ahead(self) -> int:
        return self.put_n - self.taken_n


class EmbeddedEngine:
    """The embedded generator beside the service: at most `max_generating` generations hold their
    state at once (the rest wait for a slot, in arrival order), each stopping at `eos_id` unless
    asked to ignore it."""

    def __init__(self, service: ShadowService, generator: Generator, max_generating: int):
        self.service, self.generator = service, generator
        self.eos = [generator.model.config.eos_token_id]
        self.slots = threading.Semaphore(max_generating)

    def start(self, turn: ServedTurn, prompt: list[int], max_tokens: int, events: Events, *,
              ignore_eos: bool = False) -> "Generation":
        """One request's generation, begun on a thread of its own; its events go to `events`."""
        run = Generation(self, turn, prompt, max_tokens, [] if ignore_eos else self.eos, events)
        threading.Thread(target=run.serve, name="shadow-turn", daemon=True).start()
        return run


class Generation:
    """One request's generation: a slot among the engine's `slots`, then slices on the device
    thread until it is over; its turn is recorded and ended whatever happens (`serve`'s
    `finally`). Per round it adds two attribute reads to what the round did (and a clock read
    while another job waits)."""

    def __init__(self, engine: EmbeddedEngine, turn: ServedTurn, prompt: list[int], max_tokens: int,
                 stop_ids: list[int], events: Events):
        self.engine, self.service, self.turn = engine, engine.service, turn
        self.prompt, self.max_tokens, self.stop_ids, self.events = prompt, max_tokens, stop_ids, events
        self.steps = None
        self.out: list[int] = []
        self.over = False  # its last event is out
        self.clock = RoundClock(self.service.counters.gaps, gcpauses.collected_s)  # its long gaps, taken apart

    def serve(self) -> None:
        """On its own thread: wait for a slot (giving up if the client goes away), then hand the
        device one slice after another; the turn ends in the `finally`."""
        turn, slots = self.turn, self.engine.slots
        held = False
        try:
            while not turn.client_gone and not held:
                held = slots.acquire(timeout=0.25)
            if not held:  # its client went away while it waited: nothing was read
                self._record()
                return
            while not self.service.run_request(self._slice):
                self._wait_for_relay()
        except Exception as e:  # noqa: BLE001 - the device has stopped, or the generator failed: the client is told
            self.events.put(("error", f"{type(e).__name__}: {e}"))
        finally:
            self.over = True
            if held:
                slots.release()
            if self.steps is not None:
                self.steps.close()
            self.service.voicing.drop_waiting(self.turn)
            self.service.end_turn(self.turn)

    def _wait_for_relay(self) -> None:
        """Off the device: while the generation is `AHEAD` events ahead of its relay (a client that
        does not read), until the relay takes them or the client is gone."""
        ahead = getattr(self.events, "ahead", 0)
        while ahead >= AHEAD and not self.turn.client_gone:
            time.sleep(0.01)
            ahead = self.events.ahead

    def _slice(self) -> bool:
        """On the device thread: steps until the generation is over (True) or it has held the
        device `SLICE_S` while another job waits (False: it gives way, and goes on in its next
        slice). Its prompt is fed to the shadow once the generator has read it (at the first
        token: a request cancelled in its prefill leaves the shadow as it was)."""
        turn, service, device = self.turn, self.service, self.service.device
        if self.steps is None:
            self.steps = self.engine.generator.steps(self.prompt, self.max_tokens, self.stop_ids)
        clock, perf = self.clock, time.perf_counter
        start = perf()
        clock.back()
        try:
            while not turn.client_gone:
                stepped = perf()
                token = next(self.steps, END)
                if token is END:
                    break
                if token is not None:
                    if not self.out:
                        service.set_prompt(turn, self.prompt)
                        service.first_token(turn)
                    self.out.append(token)
                    self.events.put(("token", token))
                    clock.token(perf() - stepped)
                    # between two rounds: the output so far readable in the share, the share's slice, a
                    # step of the voice's phrase (its rounds hold the device: the voice is served between them)
                    begun, read, spoken = perf(), turn.share_used, turn.voice.used_s
                    service.between_rounds(turn, (token,))
                    clock.after(perf() - begun, turn.share_used - read, turn.voice.used_s - spoken)
                if (device.queued() and perf() - start >= SLICE_S) or getattr(self.events, "ahead", 0) >= AHEAD:
                    clock.away()
                    return False
        finally:  # the device goes to another job, or the turn ends: no phrase's fork is left open
            service.voicing.finish_phrases(turn)
        self._record()
        return True

    def _record(self) -> None:
        """Its last event and its check: its own engine, so its ids are the ones read (as far as the
        shadow took them: a cancelled request's prompt before its first token, not at all)."""
        out, eos = self.out, self.engine.eos
        self.service.voicing.drop_waiting(self.turn)  # its rounds are over: no phrase begins now
        if self.turn.client_gone:
            self.events.put(("error", "the request was cancelled: its client went away"))
        else:
            self.events.put(("done", "stop" if out and out[-1] in eos else "length"))
        self.over = True
        ids = TurnIds(list(self.prompt), "engine", list(out), "engine", prompt_tokens=len(self.prompt),
                      completion_tokens=len(out))
        if self.turn.client_gone:
            ids.notes.append(f"cancelled after {len(out)} token(s): its client went away")
            if not out:
                ids.output_source = None
                ids.output_skipped = "output not read: the request was cancelled before its first token"
        self.service.record_turn(self.turn, check_turn(ids), ids)
