"""The voice: its checks on hand-written phrases (every rule), its fork leaving the session bit for
bit as it was, and, with random weights, nothing said (through a proxy whose engine thinks, and
between the embedded engine's own rounds); a voice that fails never breaks the stream."""

from __future__ import annotations

import json

import pytest
import torch

from serving import GRID, long_text, running, scripted_stream, serving, settled
from shadow.server.settings import VoiceSettings
from shadow.text.framing import MARK
from shadow.text.tokenizer import load_tokenizer
from shadow.voice.checks import REASONS, check, language
from shadow.voice.voice import PhraseCost, Voice, VoiceBudget

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

READ = ("The test in tests/test_grid.py fails: the chunk at row 3072 is read twice. Looking at reader.py, "
        "the advance loop checks the committed length before the marks. Fixing the loop order should help.")


@pytest.mark.parametrize("phrase, reason", [
    ("fixing the advance loop order in reader.py", None),
    ("", "empty"),
    ("checking why the chunk at row 3072 is read twice and what the loop does about the marks order", "too long"),
    ("fixing the **advance** loop", "markup"),
    ("see `reader.py`", "markup"),
    ("I am fixing the loop", "first person"),
    ("we fix the advance loop", "first person"),
    ("fixing the loop in writer.py", "unread name"),
    ("the chunk at row 4096", "unread number"),
    ("rewriting the tokenizer cache eviction", "unread words"),
    ("fixing the loop order should help", "example"),
    ("fixing the advance loop order", "repeat"),
    ("der advance loop und die marks", "language"),
])
def test_every_rule_of_the_checks(phrase, reason):
    examples = ["Fixing the loop order should help."]
    recent = ["reading 20,745 tokens", "thinking 25 s: fixing the advance loop order now"]
    said = check(phrase, READ, examples, recent, user_language="en")
    assert said == reason
    assert reason is None or reason in REASONS


def test_language_is_told_by_function_words():
    assert language("the loop of the reader is fixed") == "en"
    assert language("die Schleife des Lesers wird repariert und ist fertig") == "de"
    assert language("reader.py 3072") is None
    assert check("die Schleife im Leser prüfen", "die Schleife im Leser prüfen und das Gitter", user_language="de") is None


def test_the_budget_is_a_share_of_the_time_since_the_first_token_in_capped_slices():
    b = VoiceBudget(share=0.03, slice_s=0.15)
    assert not b.allows(None, 10.0, 0.05)  # no first token yet
    assert not b.allows(0.0, 4.0, None)  # unmeasured: a whole slice must be there (0.12 s is not)
    assert b.allows(0.0, 5.5, None)
    assert b.allows(0.0, 2.0, 0.05) and not b.allows(0.0, 1.0, 0.05)
    assert not b.allows(0.0, 100.0, 0.2)  # a phrase longer than a slice is never tried
    b.used_s = 0.05
    assert not b.allows(0.0, 2.0, 0.05)


def test_the_phrase_cost_is_a_line_by_the_ids_prefilled_measured_at_load_and_by_every_phrase(tiny, tokenizer):
    """Warmed at load (a phrase with nothing unread, one with the longest tail a phrase may take),
    the cost is a line by the ids the fork prefills; each phrase moves it toward what it took; an
    estimate over the slice keeps phrases from being tried until `retry_s` has passed since the
    last measure, then one is tried again."""
    from shadow.core.reader import open_reader

    now = [100.0]
    _, reader = open_reader("tiny", grid=GRID)
    voice = Voice(reader, tokenizer, retry_s=60.0, clock=lambda: now[0])
    short, longest = voice.prefill(reader.new_session("empty")), voice.prefill(None)
    assert voice.estimate(short) is None and longest == voice.max_tail + short
    cost = voice.warm()
    assert voice.measured_at == 100.0 and cost.base_s >= 0 and cost.per_id_s >= 0
    assert voice.estimate(short) == cost(short) <= voice.estimate(longest) == cost(longest)

    voice.cost = PhraseCost(0.1, 0.001)  # as if measured: 0.1 s with nothing unread, 1.1 s at 1,000 ids
    budget = VoiceBudget(share=0.5)
    assert budget.allows(0.0, 10.0, voice.estimate(20)) and not budget.allows(0.0, 10.0, voice.estimate(1000))
    now[0] = 161.0  # a minute since the last measure: over the slice, a whole slice is asked for once more
    assert voice.estimate(1000) is None and budget.allows(0.0, 10.0, voice.estimate(1000))
    assert voice.estimate(20) == pytest.approx(0.12)  # under the slice: kept however old

    session = reader.new_session("s")
    session.ids = tokenizer.encode(long_text(5, 60))
    n = voice.prefill(session)
    phrase = voice.phrase(session, "thinking")
    assert voice.measured_at == 161.0
    assert voice.cost.scale == pytest.approx(0.7 + 0.3 * phrase.seconds / (0.1 + 0.001 * n))


def test_a_phrase_leaves_the_session_bit_equal(tiny, tokenizer):
    from shadow.core.reader import open_reader

    _, reader = open_reader("tiny", grid=GRID)
    session = reader.new_session("v")
    reader.feed_prompt(session, tokenizer.encode(long_text(4, 300)))
    reader.advance(session, max_chunks=1)  # a pending tail stays unread
    before = {k: v.clone() for k, v in session.state.tensors().items()}
    ids, committed = list(session.ids), session.committed
    voice = Voice(reader, tokenizer)
    phrase = voice.phrase(session, "thinking", extra=tokenizer.encode(" the newest reasoning"))
    after = session.state.tensors()
    assert session.ids == ids and session.committed == committed
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert phrase.tokens >= 1 and phrase.seconds > 0 and voice.cost(voice.prefill(session)) == phrase.seconds
    assert phrase.text is None and phrase.reason in REASONS  # random weights: noise, and not said


def test_with_random_weights_the_lines_go_out_without_a_phrase(tiny, tmp_path):
    """A proxied turn that thinks for 3 s (thinking lines from 0.5 s): the voice tries a phrase
    after each thinking line, random weights write noise, the checks refuse it, the line goes
    out with its facts alone, and the journal keeps each attempt and its reason."""
    from test_status import MARK, renderer

    app_engine = thinking_engine(3.0)
    journal = tmp_path / "j.jsonl"
    with serving(app_engine) as engine, running(upstream=str(engine.base_url).rstrip("/") + "/v1", dialect="openai",
                                                renderer=renderer(), status_channel="reasoning", journal=journal,
                                                status_timing={"thinking_from_s": 0.5, "thinking_every_s": 0.8,
                                                               "quiet_s": 0.2},
                                                voice=VoiceSettings(share=0.9)) as (proxy, service):
        # the test's turn is short: a share large enough to try
        service.voicing.voice = Voice(service.reader, load_tokenizer(None))
        events = []
        with proxy.stream("POST", "/v1/chat/completions", headers={"x-session-id": "think"},
                          json={"messages": [{"role": "user", "content": long_text(2, 200)}], "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        settled(service)
    lines = [e["choices"][0]["delta"]["reasoning_content"] for e in events
             if e.get("choices") and MARK in (e["choices"][0]["delta"].get("reasoning_content") or "")]
    thinking = [x for x in lines if "thinking" in x]
    assert thinking and all(":" not in x.split("thinking", 1)[1] for x in thinking)  # no phrase after the facts
    records = [json.loads(x) for x in journal.read_text().splitlines()]
    (turn,) = [r for r in records if r.get("kind") == "turn"]
    tried = [x["phrase"] for x in turn["status_lines"] if x.get("phrase")]
    assert tried and all(not p["said"] and p["reason"] in REASONS for p in tried)


def embedded_thinking_turn(journal, voice: type[Voice] = Voice, seen: list | None = None
                           ) -> tuple[list[str], list[dict]]:
    """One streamed turn of the embedded `tiny` engine under the Qwen3.5 template (its prompt opens
    a think block, so the turn thinks; thinking lines from 0.5 s): the lines the client got and
    the lines the journal kept (`seen`: given every event of the stream, in order); the session is
    bit-equal to a fresh prefill after it."""
    from conftest import shared_file
    from serving import assert_exact, wait_until_read
    from shadow.text.chat_template import ChatRenderer, default_hf_tokenizer, read_template

    qwen = ChatRenderer(read_template(shared_file("templates", "qwen3.5.jinja")), default_hf_tokenizer())
    with running(journal=journal, renderer=qwen, status_channel="reasoning",
                 status_timing={"thinking_from_s": 0.5, "thinking_every_s": 0.8, "quiet_s": 0.2},
                 voice=VoiceSettings(share=0.9)) as (client, service):
        # the test's turn is short: a share large enough to try
        service.voicing.voice = voice(service.reader, load_tokenizer(None))
        events = []
        with client.stream("POST", "/v1/chat/completions", headers={"x-session-id": "own"},
                           json={"messages": [{"role": "user", "content": long_text(3, 200)}], "stream": True,
                                 "max_tokens": 400}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        settled(service)
        wait_until_read(service, ["own"])
        assert_exact(service, "own")
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    if seen is not None:
        seen += events
    shown = [e["choices"][0]["delta"]["reasoning_content"] for e in events
             if e.get("choices") and "thinking" in (e["choices"][0]["delta"].get("reasoning_content") or "")]
    kept = [x for r in map(json.loads, journal.read_text().splitlines()) for x in r.get("status_lines", [])]
    return shown, kept


def test_embedded_the_voice_writes_between_the_engines_rounds_and_random_weights_say_nothing(tmp_path):
    """The embedded engine's rounds hold the device; the voice's phrase is written between two of
    them. Its first phrase on this CPU may outlast the stream's wait: a phrase that started is
    still kept (its time is spent), so the journal records the attempt and why it was not said."""
    shown, kept = embedded_thinking_turn(tmp_path / "j.jsonl")
    assert shown and all(":" not in x.split("thinking", 1)[1] for x in shown)
    tried = [x["phrase"] for x in kept if x.get("phrase")]
    assert tried and all(not p["said"] and p["reason"] in REASONS and p["seconds"] > 0 for p in tried), kept


class SteppedVoice(Voice):
    """A phrase of six forwards, a step a round; the session's length at its first and last step."""

    lengths: list[int] = []

    def phrase_steps(self, session, *args, **kwargs):
        from shadow.voice.voice import Phrase

        SteppedVoice.lengths.append(len(session.ids))
        for _ in range(5):
            yield
        SteppedVoice.lengths.append(len(session.ids))
        return Phrase(None, "noise", "unread words", 0.01, 5)


def test_embedded_the_stream_goes_on_while_a_phrase_is_written_and_its_line_follows(tmp_path):
    """The tokens generated while the turn's rounds write a phrase reach the client before the
    phrase's line does: the stream never waits for the voice. The line follows, with its phrase."""
    SteppedVoice.lengths.clear()
    events: list = []
    shown, kept = embedded_thinking_turn(tmp_path / "j.jsonl", SteppedVoice, seen=events)
    assert len(SteppedVoice.lengths) >= 2 and shown
    (turn,) = [r for r in map(json.loads, (tmp_path / "j.jsonl").read_text().splitlines()) if r.get("kind") == "turn"]
    first_line = next(k for k, e in enumerate(events) if e.get("choices")
                      and "thinking" in (e["choices"][0]["delta"].get("reasoning_content") or ""))
    tokens_before = sum(1 for e in events[:first_line] if e.get("choices") and "content" in e["choices"][0]["delta"])
    start, end = SteppedVoice.lengths[:2]
    assert end > start  # tokens were generated while it was written (a token a round; fewer where a slice gave way)
    # every token of the rounds before its last step went out before the line (the last round's may follow it)
    lines_at = [sum(1 for e in events[:k] if e.get("choices") and "content" in e["choices"][0]["delta"])
                for k, e in enumerate(events) if e.get("choices") and MARK in (e["choices"][0]["delta"].get("reasoning_content") or "")]
    assert tokens_before >= end - turn["prompt_ids"] - 1, (SteppedVoice.lengths, turn["prompt_ids"], lines_at)
    tried = [x["phrase"] for x in kept if x.get("phrase")]
    assert tried and tried[0]["raw"] == "noise" and tried[0]["reason"] == "unread words"


def test_at_a_streams_end_a_line_whose_phrase_is_not_written_goes_out_without_it(tiny):
    """The last event waits a bounded time for a phrase being written, then sends every line held,
    in order: one whose phrase never came goes with its facts alone (none is lost behind it)."""
    import asyncio
    from concurrent.futures import Future

    from shadow.server.http.channels import Channel, LineWriter
    from shadow.server.events import Events
    from shadow.server.http.embedded import TokenLines
    from shadow.server.http.lines import Line, TurnStatus
    from shadow.server.load import EngineLoad

    tokenizer = load_tokenizer(None)
    with running() as (_, service):
        turn = service.begin_turn("late", embedded=True)
        never: Future = Future()  # a phrase the rounds never write
        service.voicing.voice = Voice(service.reader, tokenizer)
        service.voicing.request = lambda *args: never
        writer = LineWriter(Channel("reasoning", True), TurnStatus(started=0.0), EngineLoad(service.turns), turn)
        thinking, reading = Line("thinking", "thinking 15 s", 15.0, False), Line("reading", "reading", 16.0, False)

        async def end_of_stream():
            lines = TokenLines(writer, [], tokenizer, service, Events())
            lines.hold([thinking, reading])
            held = lines.ready()
            return held, await lines.rest(wait_s=0.05)

        held, rest = asyncio.run(end_of_stream())
        service.end_turn(turn)
    assert held == [] and rest == [thinking, reading] and thinking.phrase is None and never.cancelled()


def test_the_tokens_before_a_streams_end_go_out_before_the_end_waits_for_its_lines_phrases(tiny):
    """The last token and the end arrive together while a line's phrase is still being written:
    the tokens are written first, and only the end (its finish, the lines held) waits for the
    phrase. A user sees no stall in the tokens for a phrase at the end of a thought."""
    import asyncio
    from concurrent.futures import Future

    from shadow.server.http.channels import Channel, LineWriter
    from shadow.server.events import Events
    from shadow.server.http.embedded import TokenLines
    from shadow.server.http.shapes import Completion
    from shadow.server.http.lines import Line, TurnStatus
    from shadow.server.load import EngineLoad

    tokenizer = load_tokenizer(None)
    order: list = []
    with running() as (_, service):
        turn = service.begin_turn("end", embedded=True)
        never: Future = Future()  # a phrase still being written when the stream ends
        service.voicing.voice = Voice(service.reader, tokenizer)
        service.voicing.request = lambda *args: never
        writer = LineWriter(Channel("reasoning", True), TurnStatus(started=0.0), EngineLoad(service.turns), turn)
        completion = Completion(tokenizer, "tiny", [], "chatcmpl-end", 0, chat=True, want_ids=True, prompt=[1, 2])

        async def consume():
            events = Events()
            lines = TokenLines(writer, [], tokenizer, service, events)
            rest = lines.rest

            async def recorded_rest(wait_s: float = 1.0):
                order.append("rest")
                return await rest(wait_s=0.05)

            lines.rest = recorded_rest
            for event in (("token", 1000), ("token", 1001), ("done", "length")):  # one batch
                events.put(event)
            await asyncio.sleep(0)  # they arrive before the stream reads
            lines.hold([Line("thinking", "thinking 15 s", 15.0, False)])
            async for chunk in completion.sse(events, service.counters.gaps, lines):
                order.append(chunk)

        asyncio.run(consume())
        service.end_turn(turn)
    first, marker, last = order
    assert '"token_ids": [1000]' in first and '"token_ids": [1001]' in first and '"finish_reason": "length"' not in first
    assert marker == "rest" and '"finish_reason": "length"' in last and "thinking 15 s" in last and never.cancelled()


def test_a_phrase_asked_for_after_the_turns_rounds_are_over_is_never_queued_for_them(tiny):
    """Embedded: once its rounds are over nothing serves a turn's queue. A phrase asked for then
    (a thought's end, at the stream's last event) is written at once where the device is free,
    and else not tried: never a request left waiting for rounds that will not come."""
    import threading

    tokenizer = load_tokenizer(None)
    with running() as (_, service):
        service.voicing.voice = Voice(service.reader, tokenizer)
        service.voicing.voice.cost = PhraseCost(0.01, 0.0)
        turn = service.begin_turn("over", embedded=True)
        service.device.run(lambda: service.set_prompt(turn, tokenizer.encode(long_text(6, 50))))
        service.first_token(turn)
        turn.first_token -= 10.0  # 10 s into its decode: budget for a phrase
        service.voicing.drop_waiting(turn)  # its rounds are over
        release = threading.Event()
        busy = service.device.submit(release.wait)  # another job holds the device
        try:
            assert service.voicing.request(turn, "decided") is None and not turn.rounds.phrases
        finally:
            release.set()
            busy.result()
        done = service.voicing.request(turn, "decided")  # the device is free: written whole, at once
        service.end_turn(turn)
    assert done is not None and done.done() and not turn.rounds.phrases


def test_a_phrase_that_started_between_rounds_is_kept_when_it_outlasts_the_wait(tiny):
    """Embedded: the turn's rounds hold the device and serve phrases between them. A phrase that
    started there but runs past the stream's wait is waited for and returned, its time charged."""
    import time

    from shadow.voice.voice import Phrase

    class SlowVoice(Voice):
        def phrase_steps(self, *args, **kwargs):
            for _ in range(5):  # five forwards of 0.1 s, a step a round
                time.sleep(0.1)
                yield
            return Phrase(None, "noise", "unread words", 0.5, 3)

    tokenizer = load_tokenizer(None)
    with running() as (_, service):
        service.voicing.voice = SlowVoice(service.reader, tokenizer)
        service.voicing.voice.cost = PhraseCost(0.01, 0.0)  # expected to fit the slice
        turn = service.begin_turn("slow", embedded=True)
        service.device.run(lambda: service.set_prompt(turn, tokenizer.encode(long_text(6, 50))))
        service.first_token(turn)
        turn.first_token -= 10.0  # 10 s into its decode: budget for a phrase

        def rounds():  # the turn's own rounds, for 1.5 s, serving phrases between them
            for _ in range(150):
                service.voicing.serve_phrases(turn)
                time.sleep(0.01)

        held = service.device.submit(rounds)
        time.sleep(0.05)
        phrase = service.voicing.phrase(turn, "thinking", wait_s=0.05)
        held.result()
        used = turn.voice.used_s
        service.end_turn(turn)
    assert phrase is not None and phrase.raw == "noise" and phrase.seconds == 0.5
    assert used >= 0.5  # charged as its steps ran


def test_between_rounds_a_phrase_is_written_a_forward_a_round_and_nothing_is_read_meanwhile(tiny):
    """Embedded: a phrase's fork is open on the session from its prefill to its last token, one
    forward a round; no share read runs in those rounds (the fork would see the read's rows), and
    reading goes on once it is over. The session is bit-equal to a fresh prefill afterwards."""
    import threading
    import time

    from serving import assert_exact
    from shadow.core.schedule import BandwidthRule

    tokenizer = load_tokenizer(None)
    with running(rule=BandwidthRule(share=0.5)) as (_, service):
        service.voicing.voice = Voice(service.reader, tokenizer, max_tokens=6)
        service.voicing.voice.cost = PhraseCost(0.01, 0.0)
        turn = service.begin_turn("steps", embedded=True)
        prompt = tokenizer.encode(long_text(8, 600))
        service.name_turn(turn, prompt)
        service.device.run(lambda: service.set_prompt(turn, prompt))
        service.first_token(turn)
        turn.first_token -= 10.0  # 10 s into its decode: budget for a phrase
        rounds, asked = [], threading.Event()

        def decode():  # the turn's own rounds, 8 ids each; a phrase is asked for once the prompt is read
            k, last, give_up = 0, None, time.monotonic() + 60  # reading the prompt takes as long as the load allows
            while k < last if last is not None else time.monotonic() < give_up:
                open_before = turn.rounds.phrase is not None
                rounds.append((open_before, service.between_rounds(turn, [100 + k % 50] * 8)))
                time.sleep(0.003)
                s = service.store.get(turn.session)
                if not asked.is_set() and len(s.ids) - s.committed < GRID:
                    asked.set()
                    last = k + 120  # the phrase's rounds, and reading after it
                    deadline = time.monotonic() + 10
                    while not turn.rounds.phrases and turn.rounds.phrase is None and time.monotonic() < deadline:
                        time.sleep(0.001)  # until the stream's request has come
                k += 1

        held = service.device.submit(decode)
        assert asked.wait(60)
        phrase = service.voicing.phrase(turn, "thinking", wait_s=5.0)
        held.result()
        used = turn.voice.used_s
        service.end_turn(turn)
        assert_exact(service, turn.session)
    assert phrase is not None and phrase.tokens >= 1 and used > 0
    opened = [k for k, (open_before, _) in enumerate(rounds) if open_before]
    assert len(opened) >= phrase.tokens and opened == list(range(opened[0], opened[-1] + 1))  # a forward a round
    assert all(read == 0 for _, read in rounds[opened[0] : opened[-1] + 1])  # nothing read while its fork was open
    assert sum(read for _, read in rounds[opened[-1] + 1 :]) > 0  # reading went on after it


class FailingVoice(Voice):
    def phrase_steps(self, *args, **kwargs):
        yield  # its prefill, then it breaks
        raise RuntimeError("the voice broke")


def test_a_voice_that_fails_never_breaks_the_stream(tmp_path, caplog):
    shown, kept = embedded_thinking_turn(tmp_path / "j.jsonl", FailingVoice)
    assert shown and kept and not any(x.get("phrase") for x in kept)
    assert "the voice failed" in caplog.text


def thinking_engine(seconds: float):
    """An engine that streams reasoning for `seconds`, then an answer."""
    steps = [(0.1, {"reasoning_content": f" step {k} of the grid reader"}, None) for k in range(int(seconds / 0.1))]
    return scripted_stream([*steps, (0, {"content": "done"}, "stop")])


def test_a_phrase_request_that_arrives_after_its_stream_closed_is_cancelled(tiny):
    """The stream closes while its phrase request is still being made (the service's lock held
    elsewhere): the request, when it arrives, is cancelled, so no round writes a phrase for nobody."""
    import asyncio
    import threading
    from concurrent.futures import Future

    from shadow.server.http.channels import Channel, LineWriter
    from shadow.server.events import Events
    from shadow.server.http.embedded import TokenLines
    from shadow.server.http.lines import Line, TurnStatus
    from shadow.server.load import EngineLoad

    tokenizer = load_tokenizer(None)
    with running() as (_, service):
        turn = service.begin_turn("closed", embedded=True)
        made: list[Future] = []
        release = threading.Event()

        def slow_request(*args):  # the request is made while the stream closes
            release.wait(5)
            made.append(Future())
            return made[-1]

        service.voicing.voice = Voice(service.reader, tokenizer)
        service.voicing.request = slow_request
        writer = LineWriter(Channel("reasoning", True), TurnStatus(started=0.0), EngineLoad(service.turns), turn)
        thinking = Line("thinking", "thinking 15 s", 15.0, False)

        async def close_while_asking():
            lines = TokenLines(writer, [], tokenizer, service, Events())
            lines.hold([thinking])
            await asyncio.sleep(0.05)
            lines.close()  # the client went away
            (_, task), = lines.held
            await asyncio.sleep(0)
            release.set()
            for _ in range(100):  # the request arrives on its thread
                if made:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.05)
            return task

        task = asyncio.run(close_while_asking())
        service.end_turn(turn)
    assert task.done() and made and made[0].cancelled()
