"""`experiments/live_density.py` on the CPU: a real llama-server (the CPU build of
`experiments/build_llama_server.sh`, skipped when absent) with three slots, `shadow serve --upstream`
in front of it, three shared trajectories driven at once at their recorded pacing for a short
while, then off, on and off windows of the engine's cost. Checks that the live figures, the ledger and its replay
come from the run's own records."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import shared_file
from llama_server import require_binary

pytestmark = pytest.mark.slow  # real servers, engines or clients: `pytest -m 'not slow'` leaves them out

ROOT = Path(__file__).resolve().parents[1]
SHORT = ("pydata__xarray-4629", "django__django-14559", "scikit-learn__scikit-learn-13135")  # the shortest contexts


def drive(tmp_path_factory, name: str, *args: str) -> tuple[dict, Path]:
    """`live_density.py` over the three shortest trajectories with three slots, beside the CPU
    llama-server (skipped where it is not built), and `args`; its document and its folder."""
    exe = require_binary()
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_density

    trajectories = [str(shared_file("trajectories", "mini-swe-agent", f"{t}.traj.json")) for t in SHORT]
    out = tmp_path_factory.mktemp(name)
    doc = live_density.main(["--out", str(out), "--llama-server", str(exe), "--sessions", "3", "--threads", "2",
                             "--steady-prompt", "1024", "--template", str(shared_file("templates", "qwen3.5.jinja")),
                             *(a.replace("{out}", str(out)) for a in args), "--trajectories", *trajectories])
    return doc, out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return drive(tmp_path_factory, "density", "--duration", "45", "--pairs", "1", "--window", "6", "--max-output", "16",
                 "--settle", "30", "--cap-gib", "0.008", "--disk", "{out}/disk", "--serve-arg=--share-charge=alone",
                 "--cost-load", "streams")


@pytest.fixture(scope="module")
def cost_run(tmp_path_factory):
    """The cost phase alone (`--duration 0`) under `--cost-load turns` after a backlog of 6,000 ids:
    three slots, turn after turn, a share of 20 % (a CPU chunk at 8k ids takes about 90 ms: 2 % would
    read one after 4.5 s of decode)."""
    return drive(tmp_path_factory, "cost", "--duration", "0", "--pairs", "1", "--window", "8", "--cost-grow", "600",
                 "--cost-output", "16", "--settle", "60", "--share", "0.2", "--cost-backlog", "6000")


def test_the_ledger_holds_the_driven_sessions_and_the_journal_every_request(run):
    from shadow.offline.ledger import read_ledger

    doc, out = run
    sent = [json.loads(line) for line in (out / "sent.jsonl").read_text().splitlines()]
    assert len(sent) == doc["sent"]["requests"] > 0 and not [s for s in sent if s["error"]]
    ledger = read_ledger(out / "ledger.jsonl")
    driven = {s["session"] for s in sent if s["start"] < 45}
    assert {r.session for r in ledger} == driven and len(driven) >= 3
    assert len(ledger) == sum(s["start"] < 45 for s in sent)
    # every request the driver sent is a turn in the service's journal, read and checked
    turns = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    turns = [t for t in turns if t.get("kind") == "turn"]
    steady = [json.loads(line) for line in (out / "steady.jsonl").read_text().splitlines()]
    assert len(turns) == len(sent) + len(steady) == doc["live"]["journal"]["turns"]
    assert {t["session"] for t in turns if t["session"].startswith("steady.")} == {s["session"] for s in steady}
    turns = [t for t in turns if not t["session"].startswith("steady.")]  # cut by the driver: no usage to hold to
    read = Counter(t["prompt_ids"] for t in turns if t["prompt_ids"] is not None)  # the shadow off: none
    assert read and not read - Counter(s["prompt_tokens"] for s in sent)
    assert doc["live"]["journal"]["prompt"]["verified"] > 0
    # the ledger's token counts are the engine's: new prompt ids never exceed the prompt, a
    # session's first request in the run is new whole, later ones share a prefix
    first = {}
    for r in sorted(ledger, key=lambda r: r.start):
        assert 0 < r.new_prompt_tokens <= r.prompt_tokens and r.output_tokens > 0
        assert r.start <= r.first_token <= r.end
        if r.session not in first:
            first[r.session] = r
            assert r.new_prompt_tokens == r.prompt_tokens
    assert any(r.new_prompt_tokens < r.prompt_tokens for r in ledger)


def test_live_figures_come_from_real_asks_polls_and_counters(run):
    doc, out = run
    live = doc["live"]
    assert live["requests"] > 0 and live["failed"] == 0
    starts = live["turn_starts"]
    assert starts["n"] > 0 and starts["fresh_pct"] is not None and starts["ask_ms"]["p50"] > 0
    # the service's own figure, at each request's arrival: every later turn of a driven session, from the journal
    arrival = starts["at_arrival"]
    assert arrival is not None and arrival["n"] == len(doc_later_turns(out)) and arrival["fresh_pct"] is not None
    status = json.loads((out / "status.json").read_text())
    counted = status["counters"]["turn_starts"]
    assert counted["fresh"] + counted["behind"] >= arrival["n"] and counted["new"] >= 3
    assert live["to_fresh_s"]["n"] == live["requests"] and live["to_fresh_s"]["poll_s"] > 0
    assert live["share"]["decode_s"] > 0
    assert live["chunks"]["chunks_idle"] + live["chunks"]["chunks_share"] + live["chunks"]["chunks_ask"] > 0
    assert live["service"]["to_fresh_s"]["n"] > 0
    assert live["service"]["store"]["spills"] > 0  # a cap of 8 MiB: sessions went to disk
    status = json.loads((out / "status.json").read_text())
    assert {s["name"] for s in status["sessions"]} <= set(doc["sent"]["sessions"])
    costs = json.loads((out / "costs.json").read_text())
    assert [r["context"] for r in costs["rows"]] == sorted(int(d) for d in status["reading"]["chunk_ms_by_depth"])


def doc_later_turns(out: Path) -> list[dict]:
    """The driver's requests in the density phase that are not their session's first."""
    sent = sorted((json.loads(line) for line in (out / "sent.jsonl").read_text().splitlines()), key=lambda s: s["start"])
    seen, later = set(), []
    for s in sent:
        if s["session"] in seen and s["start"] < 45:
            later.append(s)
        seen.add(s["session"])
    return later


def test_the_replay_runs_on_the_same_ledger_and_costs(run):
    doc, out = run
    replay = doc["replay"]
    assert "--read-rate-json" in replay["command"] and str(out / "ledger.jsonl") in replay["command"]
    assert "--disk" in replay["command"].split() and "--cap-gib 0.008" in replay["command"]
    summary = replay["summary"]
    # the replay looks at the same turn starts the driver asked at (a raced ask is left out live)
    assert summary["turn_starts"]["n"] == doc["live"]["turn_starts"]["n"] + doc["live"]["turn_starts"]["raced"]
    assert summary["to_fresh_s"]["n"] == doc["live"]["to_fresh_s"]["n"]
    assert replay["density"]["span_s"] == doc["live"]["density"]["span_s"] > 0
    rows = doc["side_by_side"]
    assert rows["turn starts fresh %"]["live"] == doc["live"]["turn_starts"]["fresh_pct"]
    assert rows["turn starts fresh %"]["replay"] == summary["turn_starts"]["fresh_pct"]
    table = (out / "table.txt").read_text()
    assert "turn starts fresh %" in table and "pair 1" in table
    # llama-server shows its output ids beside the logprobs, which the proxy feeds once the response is
    # over: the replay feeds them then too; the driver's streams open no status-line channel: no voice
    turns = [r for r in map(json.loads, (out / "journal.jsonl").read_text().splitlines()) if r.get("kind") == "turn"]
    assert Counter((r.get("ids_source") or {}).get("output") for r in turns).most_common(1)[0][0] == "logprobs"
    assert "--ids end" in replay["command"] and "--voice-share 0.0" in replay["command"]
    # the run's own asks at their times, answered on the replay's device, queue included, by kind
    assert f"--asks-at {out / 'asks-at.jsonl'}" in replay["command"] and "--asks-per-hour" not in replay["command"]
    given = [json.loads(line) for line in (out / "asks-at.jsonl").read_text().splitlines()]
    sent = [a for a in map(json.loads, (out / "asks.jsonl").read_text().splitlines())
            if a["time"] < doc["settings"]["duration"]]
    assert len(given) == len(sent) > 0 and {g["kind"] for g in given} <= {"turn", "turn raced", "random"}
    by_kind = summary["asks"]["by_kind"]
    assert sum(v["n"] for v in by_kind.values()) == len(given)
    assert rows["ask at turn starts p99 ms"]["replay"] == by_kind["turn"]["wait_ms"]["p99"]
    assert rows["ask's device wait at random times p99 ms"] == {
        "live": doc["live"]["random"]["device_wait_ms"]["p99"], "replay": by_kind["random"]["queued_ms"]["p99"]}


def test_a_finished_run_is_replayed_again_against_its_own_live_figures(run):
    doc, out = run
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_density

    again = live_density.main(["--out", str(out), "--replay-again"])
    assert json.loads((out / "replay-again.json").read_text()) == again
    first = json.loads((out / "live-density.json").read_text())  # the run's document as written
    assert again["live"] == first["live"] and again["engine"] == first["engine"]
    # the same command but the ledger (marked again from the journal) and the file its turn starts go to
    command = again["replay"]["command"].replace("replay-again-turns", "replay-turns").replace("ledger-again", "ledger")
    assert command == first["replay"]["command"]
    assert (out / "ledger-again.jsonl").read_text() == (out / "ledger.jsonl").read_text()
    assert again["side_by_side"] == first["side_by_side"]  # the same ledger, costs and settings: the same replay
    assert again["turn_by_turn"] == first["turn_by_turn"] and sum(first["turn_by_turn"].values()) > 0
    assert (out / "table-again.txt").read_text() == (out / "table.txt").read_text()


def test_the_replay_is_charged_as_the_live_service_charged_and_draws_its_asks_forwards(run):
    doc, out = run
    replay = doc["settings"]["replay"]
    assert replay["charge_json"] == str(out / "charge.json") and replay["ask_forwards_json"] == str(out / "ask-forwards.json")
    charge = json.loads((out / "charge.json").read_text())
    assert len(charge["rows"]) >= 2 and all(r["ms_per_chunk"] > 0 for r in charge["rows"])
    forwards = json.loads((out / "ask-forwards.json").read_text())
    assert forwards and all(ms > 0 for ms in forwards)
    command = doc["replay"]["command"]
    assert f"--charge-json {out / 'charge.json'}" in command and f"--ask-forwards-json {out / 'ask-forwards.json'}" in command
    assert "a share read charged at most charge.json's costs" in (out / "replay.txt").read_text()
    # a CPU serves no host tier: no move back to draw from, and the replay moves at its one speed
    assert replay["host_rates_json"] is None and not (out / "host-rates.json").exists()
    assert "--host-rates-json" not in command


def test_engine_cost_pairs_an_off_window_with_an_on_window_at_a_steady_load(run):
    doc, out = run
    windows = doc["engine"]["windows"]
    assert [w["shadow"] for w in windows] == ["off", "on", "off"]  # --order alternate: each on between two offs
    assert all(a["end"] <= b["start"] + 1e-6 for a, b in zip(windows, windows[1:]))
    for w in windows:
        assert w["tokens"] > 0 and w["tok_s"] > 0 and w["gaps"] > 0
        assert w["engine"]["decodes"] > 0 and w["engine"]["decodes_per_s"] > 0  # llama-server's own counters
    assert windows[0]["share_charged_pct"] == 0.0  # the shadow read nothing inside the engine's decode while off
    # each window with the next: off-on, then on-off, so a steady drift counts once each way
    assert [p["order"] for p in doc["engine"]["pairs"]] == ["off-on", "on-off"] and doc["engine"]["summary"]["n"] == 2
    assert doc["engine"]["drift"] is None  # three windows are too few to fit the drift
    # the windows measured the steady streams, one a slot, each decoding in both windows, then cut
    assert doc["engine"]["settled"]["steady_decoding"] == doc["sent"]["steady"] == 3
    steady = [json.loads(line) for line in (out / "steady.jsonl").read_text().splitlines()]
    assert {s["session"] for s in steady} == {"steady.s0", "steady.s1", "steady.s2"}
    assert all(s["first_token"] < windows[0]["start"] and s["end"] >= windows[-1]["end"] for s in steady)


def test_the_cost_phase_alone_loads_the_engine_turn_after_turn_and_the_shadow_reads_in_its_share(cost_run):
    doc, out = cost_run
    assert doc["settings"]["duration"] == 0 and doc["sent"]["requests"] == 0 and doc["side_by_side"] == {}
    assert not (out / "ledger.jsonl").exists()  # no density phase: nothing to replay
    steady = [json.loads(line) for line in (out / "steady.jsonl").read_text().splitlines()]
    assert doc["sent"]["steady"] == len(steady) and not [s for s in steady if s["error"]]
    by_session = {}
    for s in steady:
        by_session.setdefault(s["session"], []).append(s)
    assert {"steady.s0", "steady.s1", "steady.s2"} <= set(by_session)
    for turns in by_session.values():
        assert [t["turn"] for t in turns] == list(range(len(turns)))
        # each turn was sent once the last ended, its prompt the last's with its output and about 600 ids more
        for last, t in zip(turns, turns[1:]):
            assert t["start"] >= last["end"]
            if t["prompt_tokens"]:  # not cut before its usage came
                assert 500 <= t["prompt_tokens"] - last["prompt_tokens"] - last["output_tokens"] <= 700
        assert all(8 <= t["output_tokens"] <= 24 for t in turns if t["prompt_tokens"])
    assert max(len(turns) for turns in by_session.values()) >= 3
    windows = doc["engine"]["windows"]
    assert [w["shadow"] for w in windows] == ["off", "on", "off"] and doc["engine"]["settled"]["slots_begun"] == 3
    assert doc["engine"]["charge"] == "alone"  # no --share-charge given: the service's default, as its status said
    for w in windows:
        assert w["tokens"] > 0 and w["tok_s"] > 0
        assert w["engine"]["prompt_tokens"] > 0  # the engine read new prompts in every window
    # the share read in the on window (a backlog to read: every turn brings 600 ids and more), and while off
    # less (only a read under way at the switch ends: a CPU chunk holds two cores for 0.1 to 0.3 s)
    assert windows[1]["share_read_pct"] > max(windows[0]["share_read_pct"], windows[2]["share_read_pct"])
    # the backlog: about 2,000 ids of prompts a slot, one token out each, all read by the engine before the windows
    backlog = [json.loads(line) for line in (out / "backlog.jsonl").read_text().splitlines()]
    assert doc["engine"]["backlog"]["requests"] == len(backlog) and doc["engine"]["backlog"]["failed"] == 0
    assert {b["session"].split(".")[1] for b in backlog} == {"s0", "s1", "s2"} and len({b["session"] for b in backlog}) == len(backlog)
    assert all(b["output_tokens"] == 1 and b["end"] < windows[0]["start"] for b in backlog)
    assert doc["engine"]["backlog"]["prompt_ids"] == sum(b["prompt_tokens"] for b in backlog) >= 3 * 1500
    # every request is a turn in the service's journal
    turns = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    assert sum(t.get("kind") == "turn" for t in turns) == len(steady) + len(backlog)
    assert "pair 1 (off-on)" in (out / "table.txt").read_text()


def test_a_run_of_the_cost_phase_alone_is_not_replayed_again(cost_run, capsys):
    _, out = cost_run
    with pytest.raises(SystemExit) as e:
        driver().main(["--out", str(out), "--replay-again"])
    assert e.value.code == 2 and "cost phase alone" in capsys.readouterr().err


# the figures' own rules, on records made by hand (no servers)


def figures():
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_figures

    return live_figures


def driver():
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_density

    return live_density


def test_new_prompt_ids_are_past_the_prefix_shared_with_the_previous_prompt_and_output():
    f = figures()
    a = f.Sent("s", 0, 0.0, [], prompt_ids=[1, 2, 3], output_ids=[4, 5])
    b = f.Sent("s", 1, 5.0, [], prompt_ids=[1, 2, 3, 4, 9, 9, 9])  # the answer re-rendered from its second id on
    c = f.Sent("t", 0, 6.0, [], prompt_ids=[7, 7])
    new = f.new_prompt_tokens([b, c, a])
    assert (new[id(a)], new[id(b)], new[id(c)]) == (3, 3, 2)


def test_time_to_fresh_is_the_first_poll_at_the_prompts_last_grid_line_or_censored():
    f = figures()
    first = f.Sent("s", 0, 1.0, [], prompt_tokens=1100)  # its last grid line (512): 1024
    second = f.Sent("s", 1, 4.0, [], prompt_tokens=2000)  # 1536
    polls = [f.Poll(t, {"s": c}, {}, {}) for t, c in ((0.5, 0), (1.5, 512), (2.5, 1024), (4.5, 1024), (6.0, 1536))]
    assert f.to_fresh([first, second], polls, 512, until=5.0) == [(1.5, False), (1.0, True)]
    assert f.to_fresh([first, second], polls, 512, until=7.0)[1] == (2.0, False)


def test_decode_time_counts_overlapping_streams_once():
    from shadow.offline.ledger import Request

    f = figures()
    rs = [Request("a", 0, 1.0, 3.0, 1, 1, 1), Request("b", 0, 2.0, 4.0, 1, 1, 1), Request("c", 0, 6.0, 7.0, 1, 1, 1)]
    assert f.decode_union_s(rs) == 4.0


def test_the_replays_ids_follow_where_the_live_output_ids_came_from(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_figures as f

    def journal(*outputs):
        path = tmp_path / f"journal-{len(outputs)}-{outputs[0]}.jsonl"
        path.write_text("".join(json.dumps({"kind": "turn", "ids_source": {"prompt": "engine-tokenize", "output": o}}) + "\n"
                                for o in outputs) + json.dumps({"session": "s", "behind": 0}) + "\n")
        return path

    assert f.replay_ids(journal("logprobs", "logprobs", "engine")) == "end"
    assert f.replay_ids(journal("engine", "engine", "logprobs")) == "tokenizer"


def test_the_replays_disk_follows_the_live_store():
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_figures as f

    assert f.service_disk({"store": {"disk_cap_bytes": 64 * 2**30}}) is True
    assert f.service_disk({"store": {"disk_cap_bytes": None}}) is False


def test_turn_starts_at_arrival_come_from_the_journal_and_refuse_a_field_the_service_never_writes(tmp_path):
    f = figures()
    sent = [f.Sent("s", k, float(k), []) for k in range(3)] + [f.Sent("t", 0, 0.5, [])]
    journal = tmp_path / "journal.jsonl"

    def write(values: dict) -> None:
        journal.write_text("".join(json.dumps({"kind": "turn", "session": name, "unread_at_start": u}) + "\n"
                                   for name, us in values.items() for u in us))

    write({"s": [None, 100, 900], "t": [None]})  # a session's first turn is new: left out
    assert f.service_turn_starts(sent, journal, 512) == {"n": 2, "fresh_pct": 50.0,
                                                         "behind": f.spread([100, 900], digits=0), "read_past_ids": 0}
    write({"s": [None, -13, 900], "t": [None]})  # an open fork's rows counted as read: apart, out of the figure
    assert f.service_turn_starts(sent, journal, 512) == {"n": 1, "fresh_pct": 0.0,
                                                         "behind": f.spread([900], digits=0), "read_past_ids": 1}
    for bad in ("12", 1.5, True):  # not the service's field as it writes it: no figure
        write({"s": [None, bad, 900], "t": [None]})
        assert f.service_turn_starts(sent, journal, 512) is None
    journal.write_text(json.dumps({"kind": "turn", "session": "s", "prediction": None}) + "\n")  # an earlier build
    assert f.service_turn_starts(sent, journal, 512) is None


def test_turn_starts_are_set_side_by_side_turn_by_turn(tmp_path):
    f = figures()
    sent = [f.Sent("s", k, float(k), [], output_tokens=500) for k in range(5)] + [f.Sent("t", k, 0.5 + k, []) for k in range(3)]
    journal = tmp_path / "journal.jsonl"
    live = {"s": [None, 100, 600, 700, -13], "t": [None, 10, 2000]}  # each session's first turn is new: left out
    journal.write_text("".join(json.dumps({"kind": "turn", "session": name, "unread_at_start": u}) + "\n"
                               for name, us in live.items() for u in us))
    replayed = [("s", 600), ("s", 100), ("s", 1500), ("s", 0), ("t", 50), ("t", 3000)]  # in start order
    assert f.turn_by_turn(sent, journal, replayed, 512) == {
        "both": 1, "live_only": 1, "live_only_replay_within_a_chunk": 1, "live_only_by_last_output": 1,
        "replay_only": 1, "neither": 2}
    # s: 100/600 live only (within a chunk, by the last output's 500), 600/100 replayed only, 700/1500 neither,
    # -13 left out; t: both, neither
    for bad in ("12", 1.5, True):  # not the service's field: no figure, as at arrival
        journal.write_text("".join(json.dumps({"kind": "turn", "session": name, "unread_at_start": u}) + "\n"
                                   for name, us in {**live, "t": [None, bad, 2000]}.items() for u in us))
        assert f.turn_by_turn(sent, journal, replayed, 512) is None
    journal.write_text(json.dumps({"kind": "turn", "session": "s"}) + "\n")  # an earlier build: no figure
    assert f.turn_by_turn(sent, journal, replayed, 512) is None


def test_an_asks_wait_for_the_device_is_told_apart_with_what_it_waited_behind():
    f = figures()
    asks = [f.Asked("turn", "s", 1.0, 200, 300.0, 0, 0, device_wait_ms=280.0, device_busy_with="end turn"),
            f.Asked("turn", "s", 2.0, 200, 90.0, 0, 0, device_wait_ms=60.0, device_busy_with="reader"),
            f.Asked("turn", "s", 3.0, 200, 70.0, 0, 0, device_wait_ms=55.0, device_busy_with="end turn"),
            f.Asked("turn", "s", 4.0, 200, 20.0, 0, 0, device_wait_ms=1.0, device_busy_with=None)]
    waits = f.device_waits(asks)
    assert waits["device_wait_ms"]["max"] == 280.0
    assert waits["waited_50ms_behind"] == {"end turn": 2, "reader": 1}
    assert "over_100ms" not in waits  # answers without parts: no split
    assert f.device_waits([f.Asked("turn", "s", 1.0, 200, 20.0)]) == {}  # a service without the field: nothing
    parted = [f.Asked("random", "s", 1.0, 200, 300.0, device_wait_ms=10.0,
                      parts_ms={"device_wait": 10.0, "read": 20.0, "forward": 30.0, "settle": 200.0, "back": 40.0}),
              f.Asked("random", "s", 2.0, 200, 100.0, device_wait_ms=0.0,
                      parts_ms={"device_wait": 0.0, "read": 0.0, "forward": 30.0, "settle": 50.0, "back": 20.0}),
              f.Asked("random", "s", 3.0, 200, 40.0, device_wait_ms=0.0,
                      parts_ms={"device_wait": 0.0, "read": 0.0, "forward": 30.0, "settle": 5.0, "back": 5.0})]
    assert f.device_waits(parted)["over_100ms"] == {"n": 2, "mean_parts_ms": {
        "device_wait": 5.0, "read": 10.0, "forward": 30.0, "settle": 125.0, "back": 30.0}}
    doc = {"side_by_side": {}, "live": {"random": f.device_waits(parted)}}
    assert ("asks over 100 ms (random): 2, mean ms device_wait 5.0, read 10.0, forward 30.0, settle 125.0, "
            "back 30.0") in f.table(doc)


def test_engine_cost_pairs_windows_in_either_order_and_sums_the_pairs_up():
    f = figures()
    stream = f.Sent("steady.s0", -1, 0.0, [], first_token=0.5)
    # 100 tokens a second, 98 while the shadow is on: windows off-on, then on-off
    stream.token_times = [k / 100 for k in range(100, 200)] + [2 + k / 98 for k in range(98)] \
        + [3 + k / 98 for k in range(98)] + [4 + k / 100 for k in range(100)]
    stream.end = 5.0
    polls = [f.Poll(t, {}, {"share_s": s, "decode_s": t}, {}) for t, s in ((1.0, 0.0), (2.0, 0.0), (3.0, 0.02),
                                                                           (4.0, 0.04), (5.0, 0.04))]
    stray = f.Sent("d.s1", 3, 0.0, [], first_token=0.1, end=2.5)
    gpu = [(t / 4, 30.0 if int(t / 4) % 2 == 0 else 40.0) for t in range(4, 20)]  # 4 samples a second
    cost = f.engine_cost([stream], [("off", 1.0, 2.0), ("on", 2.0, 3.0), ("on", 3.0, 4.0), ("off", 4.0, 5.0)],
                         polls, others=[stray], gpu=gpu)
    assert [p["order"] for p in cost["pairs"]] == ["off-on", "on-off"]
    assert [w["others_in_flight"] for w in cost["windows"]] == [1, 1, 0, 0]
    assert [w["gpu_busy_pct"] for w in cost["windows"]] == [40.0, 30.0, 40.0, 30.0]
    assert [p["gpu_busy_pct"] for p in cost["pairs"]] == [(40.0, 30.0), (30.0, 40.0)]
    assert f.gpu_busy(gpu, 1.0, 1.5) == 40.0 and f.gpu_busy(gpu, 9.0, 10.0) is None
    assert "GPU busy 40.00 -> 30.00 %" in f.table({"side_by_side": {}, "engine": cost})
    s = cost["summary"]
    assert s["n"] == 2 and abs(s["change_median_pct"] + 2.0) < 0.01 and abs(s["share_charged_pct"] - 2.0) < 0.01
    assert abs(s["beyond_share_pts"]) < 0.01  # 2 % lost for 2 % charged: nothing beyond
    assert s["share_read_pct"] is None and cost["windows"][1]["share_read_pct"] is None  # not reported apart
    # a service that charges its share reads less than their own seconds (`--share-charge alone`)
    apart = [f.Poll(p.time, {}, {**p.counters, "share_read_s": 3 * p.counters["share_s"]}, {}) for p in polls]
    s = f.engine_cost([stream], [("off", 1.0, 2.0), ("on", 2.0, 3.0), ("on", 3.0, 4.0), ("off", 4.0, 5.0)],
                      apart)["summary"]
    assert abs(s["share_charged_pct"] - 2.0) < 0.01 and abs(s["share_read_pct"] - 6.0) < 0.01
    assert "its reads' own seconds 6.00 %" in f.table({"side_by_side": {}, "engine": {"pairs": [], "summary": s}})


def test_the_replay_is_charged_what_the_live_service_charged_a_share_read_at_most():
    f = figures()
    reading = {"charge": "alone", "charge_ms_by_depth": {"8192": 4.5, "0": 3.0},
               "charge_batch_ms_by_depth": {"4": {"0": 8.0, "8192": 12.0}}, "chunk_ms_by_depth": {"0": 9.0}}
    doc = f.charge_document({"reading": reading})
    assert doc["rows"] == [{"context": 0, "ms_per_chunk": 3.0}, {"context": 8192, "ms_per_chunk": 4.5}]
    assert doc["batch_rows"] == [{"batch": 4, "context": 0, "ms_per_read": 8.0}, {"batch": 4, "context": 8192, "ms_per_read": 12.0}]
    from shadow.offline.costs import known_costs

    known = known_costs(doc, 512, "charge.json")  # as `replay-ledger --charge-json` reads it
    assert known.chunks == ((0, 0.003), (8192, 0.0045)) and known.batches == ((4, 0, 0.008), (4, 8192, 0.012))
    # a service that charged its reads' own seconds, or one from before the option: no charge file
    assert f.charge_document({"reading": {**reading, "charge": "wall"}}) is None
    assert f.charge_document({"reading": {"chunk_ms_by_depth": {"0": 9.0}}}) is None
    assert f.charge_document({"reading": {**reading, "charge_ms_by_depth": None}}) is None


def test_the_replay_draws_an_asks_forward_from_the_live_asks_forwards():
    f = figures()
    asks = [f.Asked("random", "s", 1.0, 200, parts_ms={"forward": 12.5}),
            f.Asked("turn", "s", 2.0, 200, parts_ms={"forward": 80.0}),
            f.Asked("random", "s", 3.0, 503, parts_ms={"forward": 5.0}),  # not answered
            f.Asked("random", "s", 4.0, 200),  # no split
            f.Asked("random", "s", 5.0, 200, parts_ms={"forward": 0.0}),
            f.Asked("random", "s", 99.0, 200, parts_ms={"forward": 7.0})]  # after the density phase
    assert f.ask_forwards(asks, 10.0) == [12.5, 80.0]


def test_the_replay_draws_a_move_back_from_the_live_asks_moves_back_from_the_host():
    f = figures()
    gib = 2**30
    asks = [f.Asked("random", "s", 1.0, 200, parts_ms={"restore": 50.0}, brought_back={"tier": "host", "bytes": gib}),
            f.Asked("turn", "s", 2.0, 200, parts_ms={"restore": 250.0}, brought_back={"tier": "host", "bytes": gib // 2}),
            f.Asked("random", "s", 3.0, 200, parts_ms={"restore": 80.0}, brought_back={"tier": "disk", "bytes": gib}),
            f.Asked("random", "s", 4.0, 200, parts_ms={"restore": 0.03}),  # resident: nothing brought back
            f.Asked("random", "s", 5.0, 503, parts_ms={"restore": 9.0}, brought_back={"tier": "host", "bytes": gib}),
            f.Asked("random", "s", 6.0, 200, parts_ms={"restore": 0.0}, brought_back={"tier": "host", "bytes": gib}),
            f.Asked("random", "s", 99.0, 200, parts_ms={"restore": 9.0}, brought_back={"tier": "host", "bytes": gib})]
    assert f.host_rates(asks, 10.0) == [20.0, 2.0]  # GiB/s: host moves answered in the phase only
    assert f.host_rates([f.Asked("random", "s", 1.0, 200)], 10.0) == []  # an older run's asks say nothing of it


def test_finish_by_shortens_the_density_phase_or_with_none_the_pairs():
    d = driver()
    a = d.parse(["--out", "x", "--duration", "300", "--pairs", "2", "--window", "15", "--settle", "30"])
    d.fit_to(a, 300)  # 300 s left: 30 of settle, 5 windows of 15 and the 60 after the run leave 135 of density
    assert (a.duration, a.asked_duration, a.pairs) == (135.0, 300.0, 2)
    a = d.parse(["--out", "x", "--duration", "0", "--pairs", "20", "--window", "15", "--settle", "30"])
    d.fit_to(a, 500)  # 410 s for windows: 27 of them, 13 pairs
    assert (a.duration, a.pairs, a.asked_pairs) == (0.0, 13, 20)
    d.fit_to(a, 10)  # never fewer than one pair
    assert a.pairs == 1
    a = d.parse(["--out", "x", "--duration", "0", "--pairs", "3", "--window", "15"])
    d.fit_to(a, 1000)  # room enough: nothing changes
    assert (a.pairs, hasattr(a, "asked_pairs")) == (3, False)


def test_the_windows_alternate_with_each_on_window_between_two_off_windows():
    d = driver()
    assert d.window_order(3, "alternate") == [False, True, False, True, False, True, False]
    assert d.window_order(2, "abba") == [False, True, True, False]
    assert d.window_order(0, "alternate") == [] == d.window_order(0, "abba")


def test_the_drift_fit_takes_a_deepening_engines_slowdown_out_of_the_shadows_cost():
    f = figures()
    # a rate that falls as a quadratic in time, 14 tokens/s less in each on window; windows of 5 s
    def rate(t, on):
        return 720 - 1.2 * t - 0.004 * t * t - (14 if on else 0)
    windows = [("on" if i % 2 else "off", 5.0 * i, 5.0 * i + 5) for i in range(21)]
    rows = [{"shadow": k, "start": a, "end": b, "tok_s": rate((a + b) / 2, k == "on"),
             "share_charged_pct": 1.5 if k == "on" else 0.0, "share_read_pct": 4.0 if k == "on" else 0.0}
            for k, a, b in windows]
    d = f.drift_fit(rows)
    mids = [(a + b) / 2 for _, a, b in windows]
    mean = sum(mids) / len(mids)
    base = 720 - 1.2 * mean - 0.004 * sum(m * m for m in mids) / len(mids)  # the off rate's mean over the windows
    assert d["windows"] == 21 and d["dof"] == 17 and abs(d["lost_pct"] - 100 * 14 / base) < 1e-3 and d["lost_se_pts"] < 1e-6
    assert d["neighbours"] == 19 and abs(d["neighbours_median_pct"] - 100 * 14 / base) < 0.1
    assert abs(d["share_charged_pct"] - 1.5) < 1e-9 and abs(d["share_read_pct"] - 4.0) < 1e-9
    assert abs(d["beyond_share_pts"] - (d["lost_pct"] - 1.5)) < 1e-9
    # the plain pairs of the same windows read the drift as cost; the fit does not
    pairs = [100 * (1 - rate(m + 5, True) / rate(m, False)) for m in mids[0:-1:2]]
    assert min(pairs) > d["lost_pct"] + 0.5
    # noise: the fit's error grows with it and stays honest about it
    noisy = [{**r, "tok_s": r["tok_s"] * (1 + (0.01 if i % 3 == 0 else -0.005))} for i, r in enumerate(rows)]
    assert f.drift_fit(noisy)["lost_se_pts"] > 0.1
    # too few windows, or none of one kind: no fit
    assert f.drift_fit(rows[:5]) is None
    assert f.drift_fit([r for r in rows if r["shadow"] == "off"]) is None
    assert "drift fit over 21 windows" in f.table({"side_by_side": {}, "engine": {"pairs": [], "drift": d}})


@pytest.mark.parametrize("bad", [["--steady-prompt", "0"], ["--settle", "-1"], ["--settle", "nan"], ["--pairs", "-1"],
                                 ["--duration", "0"], ["--duration", "-1"], ["--cost-grow", "0"], ["--cost-output", "0"],
                                 ["--cost-backlog", "-1"], ["--duration", "nan"], ["--window", "inf"], ["--pace", "nan"]])
def test_a_bad_option_is_refused_with_one_line_before_anything_is_written(bad, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "experiments"))
    import live_density

    with pytest.raises(SystemExit) as e:
        live_density.main(["--out", str(tmp_path / "out"), *bad])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_cost_phase_whose_first_prompt_leaves_no_room_for_a_turn_is_refused_before_anything_is_written(tmp_path, capsys):
    trajectory = str(shared_file("trajectories", "mini-swe-agent", f"{SHORT[0]}.traj.json"))
    with pytest.raises(SystemExit) as e:
        driver().main(["--out", str(tmp_path / "out"), "--pairs", "1", "--cost-grow", "100000", "--trajectories", trajectory])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "do not fit a slot's" in err and "--cost-grow" in err
    assert not (tmp_path / "out").exists()


def test_outputs_the_engine_gave_no_ids_for_are_marked_from_the_journal(tmp_path):
    f = figures()
    from shadow.offline.ledger import Request

    requests = [Request("s", float(k), k + 0.1, k + 0.5, 100 * (k + 1), 100, 10) for k in range(3)]
    requests.append(Request("t", 0.5, 0.6, 0.9, 50, 50, 5))
    journal = tmp_path / "journal.jsonl"

    def write(turns: dict) -> None:
        journal.write_text("".join(json.dumps({"kind": "turn", "session": name, "prompt_ids": n, "output_check": c}) + "\n"
                                   for name, ts in turns.items() for n, c in ts))

    # s's turn of 150 ids never got a first token: journaled, left out of the ledger, passed over
    write({"s": [(100, "verified"), (150, "not_read"), (200, "not_read"), (300, "unverified")], "t": [(50, "not_read")]})
    marked, unseen = f.outputs_unseen(requests, journal)
    assert unseen == 2
    assert [(r.session, r.start, r.output_seen) for r in marked] == [
        ("s", 0.0, True), ("t", 0.5, False), ("s", 1.0, False), ("s", 2.0, True)]
    write({"s": [(100, "verified"), (200, "verified")], "t": [(50, "verified")]})  # s's third turn not journaled
    assert f.outputs_unseen(requests, journal) == (requests, None)


def test_the_live_rates_the_replay_charges_come_from_the_services_counters():
    f = figures()
    metrics = "\n".join([
        '# HELP shadow_bytes_to_host_total Bytes moved to the host tier',
        'shadow_bytes_to_host_total{engine="llamacpp",model="m"} 3221225472.0',
        'shadow_bytes_from_host_total{engine="llamacpp",model="m"} 1073741824.0',
        'shadow_to_host_seconds_total{engine="llamacpp",model="m"} 0.25',
        'shadow_from_host_seconds_total{engine="llamacpp",model="m"} 0.25',
        'shadow_chunks_read_total{engine="llamacpp",model="m",window="share"} 100.0',
        'shadow_read_seconds_total{engine="llamacpp",model="m",window="share"} 2.0',
        'shadow_chunks_read_total{engine="llamacpp",model="m",window="ask"} 50.0',
        'shadow_read_seconds_total{engine="llamacpp",model="m",window="ask"} 0.5',
        '# TYPE shadow_chunk_read_seconds histogram',
        'shadow_chunk_read_seconds_bucket{engine="llamacpp",le="0.01",model="m",window="ask"} 40.0',
        'shadow_chunk_read_seconds_bucket{engine="llamacpp",le="+Inf",model="m",window="ask"} 50.0',
        'shadow_chunk_read_seconds_count{engine="llamacpp",model="m",window="ask"} 50.0',
        'shadow_chunk_read_seconds_sum{engine="llamacpp",model="m",window="ask"} 0.5', ""])
    assert f.live_rates(metrics) == {"host_gib_s": 8.0, "ask_chunk_scale": 0.5}  # 4 GiB in 0.5 s; 10 ms over 20 ms
    none = {"host_gib_s": None, "ask_chunk_scale": None}
    assert f.live_rates('shadow_chunks_read_total{window="ask"} 0.0\n') == none
    for bad in ("NaN", "+Inf"):  # not a rate replay-ledger takes: none rather than a refused replay
        assert f.live_rates(f'shadow_bytes_to_host_total 5.0\nshadow_to_host_seconds_total {bad}\n'
                            f'shadow_chunks_read_total{{window="share"}} 1.0\nshadow_read_seconds_total{{window="share"}} {bad}\n'
                            'shadow_chunks_read_total{window="ask"} 1.0\nshadow_read_seconds_total{window="ask"} 1.0\n') == none


def test_sessions_active_over_the_density_phase_leave_out_the_last_responses_tail():
    f = figures()
    from shadow.offline.ledger import Request

    requests = [Request("a", 0.0, 1.0, 10.0, 10, 10, 1), Request("a", 20.0, 21.0, 100.0, 10, 10, 1),
                Request("b", 50.0, 51.0, 60.0, 10, 10, 1)]
    # a: 0 .. 100 s, b: 50 .. 60 s; over 0 .. 60 s: (60 + 10) / 60; over the whole span: 110 / 100
    assert f.active_until(requests, 60.0) == pytest.approx(70 / 60)
    assert f.density(requests).active == pytest.approx(1.1)
    assert f.active_until([], 60.0) == 0.0
