"""Reading the next prompt before it comes: a turn's output is held out of reading, and at the
turn's end the session takes the next prompt's start as the big model's template will render it.
A confirmed prediction reads nothing twice; a missed one rolls back like any prompt; every state
stays bit-equal to a fresh prefill of its ids."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from conftest import shared_file
from engines import qwen_template
from serving import assert_exact, running, serving, settled, wait_until_read
from shadow.core.reader import Reader
from shadow.offline.verify import compare_states, verify
from shadow.text.rendering import TemplateRendering
from shadow.text.chat_template import ChatRenderer, default_hf_tokenizer, read_template
from shadow.text.conversations import load_conversation

GRID = 64


@pytest.fixture(scope="module")
def qwen() -> ChatRenderer:
    return ChatRenderer(read_template(qwen_template()), default_hf_tokenizer())


@pytest.fixture()
def reader(tiny) -> Reader:
    return Reader(tiny.model, GRID)


def exact(reader: Reader, session) -> bool:
    fresh = reader.prefill(session.ids[: session.committed])
    compared, mismatched, _ = compare_states(session.state, fresh)
    return compared > 0 and not mismatched


def test_a_held_output_waits_and_a_confirmed_prediction_reads_nothing_again(reader):
    s = reader.new_session("s")
    prompt = list(range(100, 100 + 3 * GRID + 10))
    reader.feed_prompt(s, prompt, hold_output=True)
    reader.advance(s)
    reader.feed_output(s, list(range(5000, 5000 + 2 * GRID)))  # an output the next prompt re-renders
    assert reader.advance(s) == 0 and s.committed == 3 * GRID and s.readable == len(prompt)
    predicted = prompt + list(range(7000, 7000 + GRID + 20))  # the reply as the template writes it back
    reader.predict(s, predicted)
    assert s.hold is None and s.rollbacks == 0
    reader.advance(s)
    assert s.committed == 4 * GRID and exact(reader, s)
    fed = reader.feed_prompt(s, predicted + list(range(9000, 9000 + GRID)))  # the next prompt: as predicted
    assert fed.rolled_back_to is None and s.rollbacks == 0 and s.ids_reread == 0
    reader.advance(s)
    assert exact(reader, s)


def test_a_missed_prediction_rolls_back_and_stays_exact(reader):
    s = reader.new_session("s")
    prompt = list(range(100, 100 + 2 * GRID + 3))
    reader.feed_prompt(s, prompt, hold_output=True)
    reader.feed_output(s, list(range(5000, 5000 + GRID)))
    reader.advance(s)
    reader.predict(s, prompt + list(range(7000, 7000 + 2 * GRID)))
    reader.advance(s)
    fed = reader.feed_prompt(s, prompt + list(range(8000, 8000 + 2 * GRID)))  # the template was not the engine's
    assert fed.rolled_back_to == 2 * GRID and s.rollbacks == 1
    reader.advance(s)
    assert exact(reader, s)


def test_batches_never_read_past_a_hold(reader):
    a, b = reader.new_session("a"), reader.new_session("b")
    reader.feed_prompt(a, list(range(10, 10 + GRID + 5)), hold_output=True)
    reader.feed_output(a, list(range(600, 600 + 3 * GRID)))
    reader.feed_prompt(b, list(range(20, 20 + 2 * GRID)))
    assert reader.run_limit(a) == 1
    with pytest.raises(ValueError, match="1 chunk"):
        reader.advance_batch([a, a, b])
    reader.advance_batch([a, b])
    assert a.committed == GRID and exact(reader, a) and exact(reader, b)


def test_the_next_prompt_predicted_is_the_start_of_the_prompt_the_template_renders(qwen):
    history = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "List the files."}]
    plain = {"role": "assistant", "content": "```bash\nls\n```", "reasoning_content": "I list them."}
    ids = qwen.next_prompt_ids(history, plain)
    after_user = qwen.prompt_ids([*history, plain, {"role": "user", "content": "a.py b.py"}])
    assert after_user[: len(ids)] == ids and len(ids) < len(after_user)
    assert "I list them" not in qwen.tokenizer.decode(ids)  # reasoning dropped before a new user message
    call = {"role": "assistant", "content": "", "reasoning_content": "I call ls.",
            "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]}
    ids = qwen.next_prompt_ids(history, call)
    after_tool = qwen.prompt_ids([*history, call, {"role": "tool", "content": "a.py", "tool_call_id": "0"}])
    assert after_tool[: len(ids)] == ids and "I call ls." in qwen.tokenizer.decode(ids)  # kept before a tool result


def test_verify_with_the_template_reads_no_id_twice_where_it_predicts(tiny, qwen, tokenizer):
    path = shared_file("trajectories", "mini-swe-agent", "django__django-11095.traj.json")
    conversation = load_conversation(path)
    runs = {}
    for predict in (False, True):
        verdict, = verify(Reader(tiny.model, 512), tokenizer, [conversation], rendering=TemplateRendering(qwen),
                          predict=predict)
        runs[predict] = verdict
        assert verdict.same_grid_bit_equal
    assert runs[False].ids_reread > 0 and runs[True].ids_reread <= runs[False].ids_reread / 2
    assert runs[True].predictions == runs[True].turns - 1 and runs[False].predictions == 0
    assert runs[True].tokens == runs[False].tokens  # the same ids in the end: the served ones


WORDS = " ".join(f"word{i}" for i in range(300))


def reasoning_replies(n: int, system: str = "You help. " + WORDS) -> tuple[list[dict], list[dict]]:
    """n replies whose long reasoning the next prompt drops (a new user message follows each), and
    the history of the first request."""
    replies = [{"role": "assistant", "content": f"Done {k}.", "reasoning_content": f"Thinking {k}: {WORDS}"}
               for k in range(n)]
    return replies, [{"role": "system", "content": system}, {"role": "user", "content": "Start."}]


def token_engine(renderer: ChatRenderer, replies: list[dict], seen: list[dict], pause_s: float = 0.0,
                 release=None) -> FastAPI:
    """A vLLM-shaped engine: the prompt rendered by `renderer`, its ids in the first event; each
    reply streamed with its ids, as the template writes it after the prompt (its reasoning in one
    event, then `pause_s`, or empty deltas until the threading.Event `release` is set, before the rest)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(body)
        messages = body["messages"]
        reply = replies[len(seen) - 1]
        prompt = renderer.prompt_ids(messages, body.get("tools"))
        ids = renderer.encode(renderer.reply_text(messages, reply, end="<|im_end|>"))

        def event(choice: dict, **more) -> str:
            return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [choice], **more}) + "\n\n"

        async def events():
            yield event({"index": 0, "delta": {"role": "assistant", "content": ""}}, prompt_token_ids=prompt)
            yield event({"index": 0, "delta": {"reasoning": reply.get("reasoning_content", "")}, "token_ids": ids[:-2]})
            deadline = time.monotonic() + 60
            while release is not None and not release.is_set() and time.monotonic() < deadline:
                yield event({"index": 0, "delta": {"reasoning": ""}, "token_ids": []})  # an empty delta now and
                await asyncio.to_thread(release.wait, 0.1)  # then, as a stream that waits on its decode
            await asyncio.sleep(pause_s)
            yield event({"index": 0, "delta": {"content": reply["content"]}, "token_ids": ids[-2:-1]})
            yield event({"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": ids[-1:]})
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_proxy_reads_what_the_next_prompt_keeps_and_nothing_twice(tiny, qwen, tmp_path, read_ahead):
    """Three turns in front of a vLLM-shaped engine whose replies the next prompt re-renders (the
    reasoning dropped). By default the session keeps the ids it was served (an ask between turns is
    exact) and reads only what the next prompt keeps; with --read-ahead it takes the next prompt's
    start as predicted and reads it before that prompt comes (an ask between turns says so). Either
    way the next prompts confirm the predictions, nothing is read twice, every state is bit-equal."""
    replies, history = reasoning_replies(3)
    seen: list[dict] = []
    with serving(token_engine(qwen, replies, seen)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        journal = tmp_path / "journal.jsonl"
        with running(upstream=url, dialect="vllm", renderer=qwen, journal=journal,
                     read_ahead=read_ahead) as (proxy, service):
            for k in range(3):
                r = proxy.post("/v1/chat/completions", json={"messages": history, "stream": True},
                               headers={"x-session-id": "p"})
                assert r.status_code == 200
                settled(service)
                wait_until_read(service, ["p"])
                status = service.status()
                assert status["sessions"][0]["committed"] > 0
                served = qwen.prompt_ids(history) + qwen.encode(qwen.reply_text(history, replies[k], end="<|im_end|>"))
                with service.state_lock:
                    held = list(service.store.get("p").ids)
                ask = proxy.post("/v1/shadow/ask", json={"session": "p", "question": "A or B?", "choices": ["A", "B"]})
                assert ask.status_code == 200
                if read_ahead:
                    assert "read ahead" in ask.json()["why_not"] and held != served
                else:
                    assert ask.json()["exact"] is True and held == served  # the ids served, each once, exact
                history = [*history, {"role": "assistant", "content": replies[k]["content"]},
                           {"role": "user", "content": f"Next {k}."}]
                assert_exact(service, "p")
            turns = [json.loads(x) for x in journal.read_text().splitlines()]
            found = [t["prediction"] for t in turns if t.get("kind") == "turn"]
            assert found[0] is None and [p["outcome"] for p in found[1:]] == ["confirmed", "confirmed"]
            assert sum(p["ids_not_read_twice"] for p in found[1:]) == status["counters"]["predictions"]["ids_not_read_twice"]
            counts = status["counters"]["predictions"]
            assert counts["made"] == 3 and counts["confirmed"] == 2 and counts["missed"] == 0
            assert counts["ids_not_read_twice"] > 0 and status["counters"]["rollbacks"] == 0
            metrics = proxy.get("/metrics").text
            assert 'shadow_predictions_total{' in metrics and 'outcome="confirmed"' in metrics


def test_without_predict_the_output_is_read_as_it_came_and_the_next_prompt_rolls_back(tiny, qwen):
    replies, history = reasoning_replies(2)
    seen: list[dict] = []
    with serving(token_engine(qwen, replies, seen)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="vllm", renderer=qwen, predict=False) as (proxy, service):
            for k in range(2):
                proxy.post("/v1/chat/completions", json={"messages": history, "stream": True},
                           headers={"x-session-id": "p"})
                settled(service)
                wait_until_read(service, ["p"])  # the output read as it came
                history = [*history, {"role": "assistant", "content": replies[k]["content"]},
                           {"role": "user", "content": f"Next {k}."}]
            status = service.status()
            assert status["counters"]["predictions"]["made"] == 0 and status["counters"]["rollbacks"] >= 1
            assert_exact(service, "p")


# the replay's model of it ---------------------------------------------------------------------

def test_the_replay_holds_the_output_and_reads_the_prediction_instead():
    """A turn's prompt of 1,100 ids and an output of 600 decoded from 3 to 5 s, its next prompt
    at 10 s keeping 1,098 of them and the reply re-rendered in 60 (as the template predicted at
    5 s). Read as it came, the chunk past the prompt's checkpoint (1,024) is read and rolled back;
    held (the prediction says the next prompt keeps 1,098), or read ahead, nothing is read twice."""
    from shadow.offline.ledger import Request
    from shadow.offline.limits import ReplayLimits
    from shadow.offline.replay import replay

    from test_replay_limits import COSTS

    reqs = [Request("s", 0.0, 3.0, 5.0, 1100, 1100, 600, predicted_tokens=1158, predicted_kept=1098,
                    predicted_confirmed=1158),
            Request("s", 10.0, 10.1, 11.0, 1258, 160, 10)]
    arms = {name: replay(reqs, costs=COSTS, limits=ReplayLimits(ids="engine", **limits), use_share=False)
            for name, limits in (("off", {"predict": False}), ("hold", {}), ("ahead", {"read_ahead": True}))}
    assert arms["off"].rollbacks == 1 and arms["off"].chunks_wasted == 1 and arms["off"].predictions == 0
    for name in ("hold", "ahead"):
        assert arms[name].rollbacks == 0 and arms[name].chunks_wasted == 0
        assert arms[name].predictions == 1 and arms[name].predictions_missed == 0
    # behind the ids held, as a turn-start ask reads them: the engine's prompt and output (read, or held),
    # or the prediction read ahead
    assert [t.behind for t in arms["off"].turns] == [1700 - 1536]
    assert [t.behind for t in arms["hold"].turns] == [1700 - 1024]
    assert [t.behind for t in arms["ahead"].turns] == [1158 - 1024]
    # to stand at the part of the new prompt known before it came (the same 1,158 ids in every arm): from the
    # checkpoint after the rollback, from the prompt's line, or from the prediction's last line
    assert [t.to_prompt for a in arms.values() for t in a.turns] == [1158 - 1024] * 3
    # a status line's phrase at 4.5 s finds more than 256 ids unread and lets the 600 go: read then in the
    # decode's share (half of it here), and sent back by the next prompt (no hold left for a prediction)
    from shadow.core.schedule import BandwidthRule

    bounded = replay(reqs, costs=COSTS, limits=ReplayLimits(ids="engine", hold_max=256, voice_share=0.5),
                     rule=BandwidthRule(share=0.5))
    assert bounded.rollbacks == 1 and bounded.chunks_wasted == 1 and bounded.predictions == 0
    assert [t.to_prompt for t in bounded.turns] == [1158 - 1024]


def test_a_ledger_keeps_its_predicted_counts_and_refuses_bad_ones(tmp_path):
    from shadow.errors import ShadowInputError
    from shadow.offline.ledger import Request, read_ledger, write_ledger

    reqs = [Request("s", 0.0, 1.0, 2.0, 100, 100, 10, 105, 98, 105), Request("s", 3.0, 3.5, 4.0, 120, 15, 5)]
    path = tmp_path / "l.jsonl"
    write_ledger(path, reqs)
    assert read_ledger(path) == reqs and "predicted" not in path.read_text().splitlines()[1]
    bad = dict(json.loads(path.read_text().splitlines()[0]), predicted_confirmed=106)
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ShadowInputError, match="predicted counts out of range"):
        read_ledger(path)
    path.write_text(json.dumps(dict(bad, predicted_confirmed="x")) + "\n")
    with pytest.raises(ShadowInputError, match="whole number"):
        read_ledger(path)


def test_a_trajectory_imported_with_the_template_records_what_the_proxy_predicts(qwen):
    from shadow.offline.ledger import ServiceModel, import_trajectory

    path = shared_file("trajectories", "mini-swe-agent", "django__django-11095.traj.json")
    reqs = import_trajectory(path, ServiceModel(), renderer=qwen)
    assert all(r.predicted_tokens > 0 for r in reqs[:-1]) and reqs[-1].predicted_tokens == 0
    assert all(r.predicted_confirmed == r.predicted_tokens for r in reqs[:-1])  # every one confirmed
    assert all(r.predicted_kept <= r.prompt_tokens + r.output_tokens for r in reqs)


def held_past_the_bound(service, name: str, bound: int, timeout: float = 20.0) -> None:
    """Wait until session `name` holds output and has more than `bound` ids unread."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with service.state_lock:
            s = service.store.peek(name)
            if s is not None and s.hold is not None and len(s.ids) - s.committed > bound:
                return
        time.sleep(0.02)
    raise AssertionError(f"session {name} never held more than {bound} unread ids")


def test_an_ask_mid_turn_past_what_a_fork_may_read_lets_the_hold_go(tiny, qwen):
    """An ask while a turn streams, its session holding more output unread than one fork may read
    (here an ask's bound of 256): the hold is let go, the output read as it came so that the ask
    can be answered, and the next prompt sends back what of it was read; every state stays
    bit-equal."""
    import threading

    from shadow.server.settings import Limits

    replies, history = reasoning_replies(2, "You help.")
    seen: list[dict] = []
    answered = threading.Event()  # the engine sends the rest of the turn once the ask is answered
    with serving(token_engine(qwen, replies, seen, release=answered)) as engine:
        url = str(engine.base_url).rstrip("/") + "/v1"
        with running(upstream=url, dialect="vllm", renderer=qwen, limits=Limits(max_ask_tail=256)) as (proxy, service):
            answers = []
            with proxy.stream("POST", "/v1/chat/completions", json={"messages": history, "stream": True},
                              headers={"x-session-id": "p"}) as r:
                lines = r.iter_lines()
                while "reasoning" not in next(lines):  # the reasoning's event has come: its ids are held
                    pass
                held_past_the_bound(service, "p", 256)  # the proxy hands them over beside the stream
                def ask() -> None:
                    try:
                        answers.append(proxy.post("/v1/shadow/ask", json={"session": "p", "question": "A or B?",
                                                                          "choices": ["A", "B"]}))
                    finally:
                        answered.set()

                asking = threading.Thread(target=ask)
                asking.start()
                for _ in lines:
                    pass
            asking.join()
            settled(service)
            wait_until_read(service, ["p"])
            assert answers[0].status_code == 200
            asked = {k: answers[0].json()[k] for k in ("behind", "read_chunks", "pending_after")}
            counts = service.status()["counters"]["predictions"]
            assert counts["holds_released"] == 1 and counts["made"] == 1
            with service.state_lock:
                s = service.store.get("p")
                read_then = (s.committed, s.hold, len(s.ids))
            assert read_then[0] > GRID, (asked, read_then)  # the ask read the output it let go
            assert_exact(service, "p")
            history = [*history, {"role": "assistant", "content": replies[0]["content"]}, {"role": "user", "content": "Next."}]
            proxy.post("/v1/chat/completions", json={"messages": history, "stream": True}, headers={"x-session-id": "p"})
            settled(service)
            wait_until_read(service, ["p"])
            status = service.status()["counters"]  # the output the ask had read went back: no hold was left to keep
            assert status["predictions"]["confirmed"] == status["predictions"]["missed"] == 0 and status["rollbacks"] == 1, \
                (status["predictions"], status["rollbacks"], asked, read_then)
            assert_exact(service, "p")


def test_verify_lets_a_hold_go_past_its_bound_and_stays_exact(tiny, qwen, tokenizer):
    path = shared_file("trajectories", "mini-swe-agent", "django__django-11095.traj.json")
    conversation = load_conversation(path)
    bounded, = verify(Reader(tiny.model, 512), tokenizer, [conversation], rendering=TemplateRendering(qwen),
                      predict=True, hold_max=64)
    free, = verify(Reader(tiny.model, 512), tokenizer, [conversation], rendering=TemplateRendering(qwen),
                   predict=True)
    assert bounded.same_grid_bit_equal and bounded.ids_reread > free.ids_reread == 0


@pytest.mark.parametrize("args, says", [
    (["--tokenizer", "."], "only with --chat-template"),
    (["--hold-max", "0"], "--hold-max must be >= 1"),
    (["--chat-template", "no-such-template.jinja"], "no such file"),
])
def test_verify_exact_refuses_bad_prediction_options_before_any_work(args, says):
    from typer.testing import CliRunner

    from shadow.cli.main import app

    r = CliRunner().invoke(app, ["verify-exact", *args])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output


def test_a_hold_past_a_prediction_reads_what_the_next_prompt_keeps_and_no_further(reader):
    s = reader.new_session("s")
    prompt = list(range(100, 100 + 2 * GRID + 10))
    reader.feed_prompt(s, prompt, hold_output=True)
    reader.feed_output(s, list(range(5000, 5000 + 3 * GRID)))
    reader.advance(s)
    assert s.committed == 2 * GRID
    kept = len(prompt) + GRID + 5  # the next prompt keeps the output's first GRID + 5 ids
    assert reader.hold_past(s, s.ids[:kept] + [7] * 40) == kept
    reader.advance(s)
    assert s.committed == 3 * GRID and s.ids[: len(prompt)] == prompt and exact(reader, s)
    fed = reader.feed_prompt(s, s.ids[:kept] + [7] * 40)  # as predicted: nothing read goes back
    assert fed.rolled_back_to is None and s.rollbacks == 0
