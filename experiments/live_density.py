"""Live density: N agent sessions at once through `shadow serve --upstream` beside a real batching
llama-server, at their recorded pacing, measured against the ledger replay of the same run.

    python experiments/live_density.py --out /tmp/density --sessions 3 --duration 90 \
        --trajectories DATA/trajectories/mini-swe-agent/django__django-14559.traj.json ...

DATA is the shared data folder ($SHADOW_SHARED_DATA, else `shared/data` beside the repository),
where `--trajectories` and `--template` default to.

Each of the N session slots replays a mini-swe-agent trajectory (the next one in the list when its
last ends, so N stay active): each request when its turn comes (the recorded time since the
session's first request, `--pace` times it, or the previous response's end if later), its messages
the recorded history (llama-server renders them with the GGUF's chat template, the real Qwen3.5
one), `max_tokens` the recorded output's length in Qwen3.5 ids (`render_output`, as the ledger
importer counts it; at most `--max-output`) with `ignore_eos`, streamed, with logprobs (their ids
are the output's ids). A slot's first trajectory starts at a seeded random turn of its first half
(`--start random`), so the sessions are at different depths from the start. Asks
(`/v1/shadow/ask`) go out at each turn start of a session with earlier turns (just before the
request) and at seeded random times (`--asks-per-hour` per active session, Poisson). The
service's status is polled every `--poll-s` (time to fresh, share charged, the store's moves).

The engine is llama-server (`--llama-server`, default the CPU build of
`experiments/build_llama_server.sh`) with `--parallel N` (continuous batching is its default) and a
context of N x the longest session (prompt and output in Qwen3.5 ids), serving a random-weight GGUF
of `shadow/engines/gguf.py` (`--hidden`, `--layers`).

The engine's cost comes after the density phase (or alone, with `--duration 0`): no request or ask
of the density phase starts after `--duration` s; each slot, once its last response is over, carries
the cost phase's load in sessions of its own (`steady.sK`, from a trajectory's prompt nearest
`--steady-prompt` ids, made unique by a line of its own). Under `--cost-load turns` (the default) a
slot sends turn after turn, each as the last ends: the last prompt, its output's text and a user
message of about `--cost-grow` ids, decoding 1/2 to 3/2 of `--cost-output` tokens (seeded) with
`ignore_eos`, so the engine reads and decodes as at density and the shadow has new ids to read in its share all along (a session
that would outgrow the slot is followed by a new one). Under `--cost-load streams` a slot streams one
long response (`max_tokens` as many as the slot holds), whose prompt the shadow reads before the
windows. `--cost-backlog` IDS first has each slot send about IDS / N ids of trajectories' prompts
with one token out each (`backlog.sK.J`): the engine reads them before the windows, the shadow in
its share through them, so the windows hold the engine's decode and the shadow's reads. Once every slot's first request of the load has its first token (at most `--settle` s), `--pairs` K pairs of windows of
`--window` s switch the shadow off and on (`/v1/shadow/switch`), in the order off, on, off, ..., on,
off (`--order alternate`, 2K + 1 windows) or off-on, on-off, ... (`--order abba`); then the load is
cut. The engine's speed drifts as its sessions deepen: `live_figures.drift_fit` takes the drift out.
Each window's decode tokens/s and inter-token gaps (the load's streams'), the share charged in it,
and llama-server's own counters (`--metrics`) at its ends (`live_figures.engine_cost`); each pair's
change with the shadow on. `--finish-by` shortens the density phase, or with none the pairs, to fit.

The replay charges what the run measured: the chunk costs the service learned, its moves to and
from host memory and its asks' cost a chunk against the share's (`live_figures.live_rates`, from
`/metrics` at the density phase's end), and a ledger that marks the outputs the engine never gave
as ids (`output_seen`, from the journal: `live_figures.outputs_unseen`).

Writes in `--out`: `live-density.json` (its last line too on stdout: settings, live figures,
replay, side by side, engine cost), `ledger.jsonl` (the density phase's requests), `costs.json`
(the chunk costs the live service learned, charged by the replay), `charge.json` (what it charged a
share read at most under `--share-charge alone`, charged so by the replay), `ask-forwards.json` (the
asks' forwards, ms, each replayed ask drawing one), `host-rates.json` (the speed, GiB/s, of each move back from
the host tier an ask made, each replayed move drawing one), `sent.jsonl` and `asks.jsonl`
(every request and ask as the driver saw it), `journal.jsonl`, `status.json` (the last status),
`metrics-density.txt` and `metrics.txt` (`/metrics` at the density phase's end and at the run's),
`steady.jsonl` (the cost phase's requests), `replay.txt`, `engine.log`, `serve.log`, `table.txt`.
`backlog.jsonl` (the backlog's requests, where there were any). A run of the cost phase alone writes
`live-density.json` (settings, engine cost), `steady.jsonl`, `backlog.jsonl`, `costs.json`,
`status.json`, `metrics.txt`, `journal.jsonl`, the logs and `table.txt`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]

import live_figures as fig  # noqa: E402
from shadow.errors import ShadowInputError  # noqa: E402

QUESTION = {"question": "Is the agent about to finish the task? A: yes, B: no.", "choices": ["A", "B"]}
STEADY_LINE = "(steady stream {k}: a load for the engine's cost, not a recorded turn)"
BACKLOG_LINE = "(backlog {k}: ids for the shadow to read in the engine's cost phase, not a recorded turn)"
# every request the driver sends: streamed with its usage, greedy, each output id beside its logprob (after sampling)
STREAMED = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "logprobs": True, "top_logprobs": 1, "post_sampling_probs": True}
AFTER_RUN_S = 60.0  # --finish-by keeps this for the last responses, the engine's tokenization, the replay and the files
MIN_DURATION_S = 20.0
SENT_FIELDS = ("session", "turn", "start", "first_token", "end", "prompt_tokens", "output_tokens", "status", "error")
DATA = Path(os.environ.get("SHADOW_SHARED_DATA") or ROOT.parent / "shared" / "data")
CPU_BINARY = Path.home() / ".cache/shadow/engines/llama-server-0.3.36/bin/llama-server"


@dataclass(frozen=True)
class Turn:
    offset_s: float  # since the trajectory's first request
    messages: list[dict]
    output_tokens: int


@dataclass(frozen=True)
class Trajectory:
    name: str
    turns: list[Turn]
    longest: int  # the last prompt and its output, Qwen3.5 ids
    prompt_ids: Callable[[int], int]  # turn index -> its prompt's length in Qwen3.5 ids (tokenized when asked)

    def turn_near(self, ids: int) -> int:
        """The index of the turn whose prompt is nearest `ids` long (prompts grow turn by turn)."""
        lo, hi = 0, len(self.turns) - 1
        while lo < hi:  # the first turn at least `ids` long
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.prompt_ids(mid) < ids else (lo, mid)
        return min((k for k in (lo - 1, lo) if k >= 0), key=lambda k: abs(self.prompt_ids(k) - ids))


def load_trajectory(path: Path, tokenizer) -> Trajectory:
    """A mini-swe-agent trajectory's requests: recorded times, messages, output lengths."""
    from shadow.text.chat import render_output, render_prompt
    from shadow.text.conversations import load_conversation

    try:
        doc = json.loads(path.read_text())
        times = [m["extra"]["response"]["created"] for m in doc["messages"] if m.get("role") == "assistant"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ShadowInputError(f"{path}: not a mini-swe-agent trajectory ({type(e).__name__}: {e})") from None
    conv = load_conversation(path)
    turns, histories = [], []
    for t, (history, out) in zip(times, conv.requests()):
        msgs = [{"role": m.role, "content": m.content,
                 **({"reasoning_content": m.reasoning} if m.role == "assistant" and m.reasoning else {})} for m in history]
        turns.append(Turn(float(t - times[0]), msgs, len(tokenizer.encode(render_output(out)))))
        histories.append(history)

    @functools.cache
    def prompt_ids(k: int) -> int:
        return len(tokenizer.encode(render_prompt(histories[k])))

    return Trajectory(conv.name, turns, prompt_ids(len(turns) - 1) + turns[-1].output_tokens, prompt_ids)


def cost_blocks(trajectory: Trajectory, tokenizer, ids: int, count: int = 64) -> list[str]:
    """Up to `count` user messages of about `ids` Qwen3.5 ids each for `--cost-load turns`: the
    trajectory's last prompt's messages, read in order and cut at every `ids` ids."""
    text = "\n".join(str(m.get("content") or "") for m in trajectory.turns[-1].messages)
    tokens = tokenizer.encode(text)
    blocks = [tokenizer.decode(tokens[i:i + ids]) for i in range(0, len(tokens) - ids + 1, ids)][:count]
    return blocks or [tokenizer.decode(tokens)]


def cost_room(trajectories: list[Trajectory]) -> int:
    """The ids a session of the cost phase may hold: a slot's context (the longest trajectory's) less
    a margin for the template."""
    return max(t.longest for t in trajectories) - 256


def cost_fits(held: int, a: argparse.Namespace, room: int) -> bool:
    """Whether a session of the cost phase holding `held` ids takes another turn (`--cost-load turns`):
    two turns' growth (`--cost-grow` and `--cost-output`) must still fit in `room`."""
    return held + 2 * (a.cost_grow + a.cost_output) < room


def cost_fits_every_slot(a: argparse.Namespace, trajectories: list[Trajectory]) -> str | None:
    """Why the cost phase's turns cannot run (a slot's first prompt leaves no room for a turn in its
    context), or None."""
    if not a.pairs or a.cost_load != "turns":
        return None
    room = cost_room(trajectories)
    for t in trajectories[:a.sessions]:
        held = t.prompt_ids(t.turn_near(a.steady_prompt))
        if not cost_fits(held, a, room):
            return (f"{t.name}: a first prompt of {held:,} ids and two turns of --cost-grow {a.cost_grow} and "
                    f"--cost-output {a.cost_output} do not fit a slot's {room:,} ids: lower --steady-prompt or --cost-grow")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float, ready=lambda r: r.status_code == 200) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if ready(httpx.get(url, timeout=2.0)):
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout:.0f} s")


class Run:
    """One run: the engine and the service already up at `url`; drives the sessions and records."""

    def __init__(self, args, url: str, trajectories: list[Trajectory], engine_url: str,
                 blocks: list[list[str]] = ()):
        self.args, self.url, self.trajectories, self.engine_url = args, url, trajectories, engine_url
        self.blocks = blocks  # a trajectory's user messages of about --cost-grow ids (`cost_blocks`), by its index
        self.first_load: dict[int, fig.Sent] = {}  # each slot's first request of the cost phase
        self.rng = random.Random(args.seed)
        self.sent: list[fig.Sent] = []
        self.asks: list[fig.Asked] = []
        self.polls: list[fig.Poll] = []
        self.windows: list[tuple[str, float, float]] = []
        self.held: dict[str, int] = {}  # ids a session held after its last response (prompt + output)
        self.active: set[str] = set()
        self.next_traj = 0
        self.t0 = 0.0
        self.status: dict = {}
        self.metrics = ""  # the last /metrics scrape (Prometheus text)
        self.metrics_density = ""  # the scrape at the density phase's end
        self.tasks: set[asyncio.Task] = set()
        self.switch_error: str | None = None
        self.engine_windows: list[tuple[dict, dict]] = []  # the engine's counters at each window's ends
        self.steady: list[fig.Sent] = []  # the cost phase's streams
        self.steady_over = asyncio.Event()  # set when the windows are over: the steady streams are cut
        self.gpu: list[tuple[float, float]] = []  # (seconds, the GPU's busy %), where nvidia-smi is
        self.settled: dict = {}  # how the cost phase began: the wait for the steady streams, strays in flight
        self.backlog: list[fig.Sent] = []  # the cost phase's backlog: prompts read by the engine before its load

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def main(self) -> None:
        a = self.args
        self.stop_at = a.duration  # no request or ask of the density phase starts after it
        limits = httpx.Limits(max_connections=4 * a.sessions + 16, max_keepalive_connections=4 * a.sessions + 16)
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(a.request_timeout), limits=limits) as c:
            self.client = c
            self.t0 = time.monotonic()
            background = [asyncio.create_task(self.poll()), asyncio.create_task(self.random_asks()),
                          asyncio.create_task(self.gpu_samples())]
            switching = asyncio.create_task(self.switches())
            await asyncio.gather(*(self.slot(k) for k in range(a.sessions)))
            await switching  # the slots' steady streams were cut when its last window ended
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=a.request_timeout)
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.poll_once()
            with contextlib.suppress(httpx.HTTPError):
                self.metrics = (await c.get("/metrics")).text

    # the sessions -------------------------------------------------------------------------------

    async def slot(self, k: int) -> None:
        """Slot k: its trajectories' turns until the density phase ends, then its load of the cost phase."""
        if self.args.duration > 0:
            await self.density_turns(k)
        if self.args.pairs:
            if self.args.cost_backlog:
                await self.backlog_prompts(k)
            await (self.cost_turns(k) if self.args.cost_load == "turns" else self.steady_stream(k))

    async def backlog_prompts(self, k: int) -> None:
        """Slot k's share of `--cost-backlog` before its load: trajectories' prompts (`backlog.sK.J`,
        each made unique by a line of its own, at most a slot's context), one token out each, one
        after another, until the slot has sent about `--cost-backlog` / N ids. The engine reads them
        before the windows; the shadow has them to read in its share through the on windows."""
        a = self.args
        quota, sent, j = a.cost_backlog // a.sessions, 0, 0
        room = cost_room(self.trajectories)
        while sent < quota and not self.steady_over.is_set():
            traj = self.trajectories[(k + j) % len(self.trajectories)]
            at = traj.turn_near(min(quota - sent, room))
            first, *rest = traj.turns[at].messages
            name = f"backlog.s{k}.{j + 1}"
            messages = [{**first, "content": BACKLOG_LINE.format(k=name[len("backlog.s"):]) + "\n" + first["content"]}, *rest]
            rec = fig.Sent(name, 0, self.now(), messages)
            self.backlog.append(rec)
            await self.stream(rec, {**STREAMED, "messages": messages, "max_tokens": 1})
            if rec.error is not None:
                return  # the slot goes on to its load; the record says why
            sent, j = sent + (rec.prompt_tokens or traj.prompt_ids(at)), j + 1

    async def density_turns(self, k: int) -> None:
        first, copy = True, 0
        while self.now() < self.stop_at:
            traj = self.trajectories[self.next_traj % len(self.trajectories)]
            copy = self.next_traj // len(self.trajectories)
            self.next_traj += 1
            name = f"{traj.name}.s{k}" + (f".c{copy + 1}" if copy else "")
            begin = self.rng.randrange(len(traj.turns) // 2 + 1) if first and self.args.start == "random" else 0
            first = False
            base = self.now() - traj.turns[begin].offset_s * self.args.pace
            for i in range(begin, len(traj.turns)):
                due = base + traj.turns[i].offset_s * self.args.pace
                await asyncio.sleep(max(0.0, min(due, self.stop_at) - self.now()))
                if self.now() >= self.stop_at:
                    return
                if i > begin and self.rng.random() < self.args.turn_asks:
                    self.spawn(self.ask("turn", name, self.held.get(name)))
                    await asyncio.sleep(0)  # the ask leaves before the request
                ok = await self.request(name, i, traj.turns[i])
                if not ok:
                    break
            self.active.discard(name)

    async def request(self, name: str, i: int, turn: Turn) -> bool:
        a = self.args
        body = {**STREAMED, "messages": turn.messages, "max_tokens": max(1, min(turn.output_tokens, a.max_output)),
                "ignore_eos": True}
        rec = fig.Sent(name, i, self.now(), turn.messages)
        self.sent.append(rec)
        self.active.add(name)
        await self.stream(rec, body)
        self.held[name] = rec.prompt_tokens + rec.output_tokens
        return rec.error is None

    async def stream(self, rec: fig.Sent, body: dict, cut: bool = False) -> str:
        """POST `body` as `rec`'s session and read its stream into `rec` (statuses, ids, times, usage,
        errors); the output's text. `cut`: stop reading once the cost phase's windows are over (the
        response closes, the proxy ends the engine's request)."""
        text = []
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body,
                                          headers={"x-session-id": rec.session}) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    rec.error = (await r.aread()).decode("utf-8", "replace")[:300]
                else:
                    async for line in r.aiter_lines():
                        if cut and self.steady_over.is_set():
                            break
                        if line.startswith("data: {"):
                            text.append(self.event(rec, json.loads(line[len("data: "):])))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # the connection, or an event not as expected
            rec.error = f"{type(e).__name__}: {e}"
        rec.end = self.now()
        return "".join(text)

    async def steady_stream(self, k: int) -> None:
        """Slot k's stream of the cost phase: a prompt of its own, decoding until the windows are over."""
        if self.steady_over.is_set():
            return
        traj = self.trajectories[k % len(self.trajectories)]
        at = traj.turn_near(self.args.steady_prompt)
        first, *rest = traj.turns[at].messages
        messages = [{**first, "content": STEADY_LINE.format(k=k) + "\n" + first["content"]}, *rest]
        room = max(t.longest for t in self.trajectories) - traj.prompt_ids(at) - 256  # a slot's context holds it
        body = {**STREAMED, "messages": messages, "max_tokens": max(256, room), "ignore_eos": True}  # as long as the windows go on
        rec = fig.Sent(f"steady.s{k}", -1, self.now(), messages)
        self.steady.append(rec)
        self.first_load[k] = rec
        await self.stream(rec, body, cut=True)

    async def cost_turns(self, k: int) -> None:
        """Slot k's load of the cost phase under `--cost-load turns`: turn after turn, each sent as
        the last ends, so the shadow has new ids to read in its share all along. A session starts
        from a trajectory's prompt nearest `--steady-prompt` ids (made unique by a line of its own);
        each next turn is the last prompt, its output's text and a user message of about
        `--cost-grow` ids, decoding 1/2 to 3/2 of `--cost-output` tokens (`ignore_eos`; seeded, so
        that the slots' turns fall out of step and the engine decodes all along). A session that would
        outgrow the slot's context is followed by a new one (`steady.sK`, `steady.sK.2`, ...)."""
        a = self.args
        traj = self.trajectories[k % len(self.trajectories)]
        at = traj.turn_near(a.steady_prompt)
        first, *rest = traj.turns[at].messages
        room = cost_room(self.trajectories)
        blocks = self.blocks[k % len(self.blocks)]
        body = {**STREAMED, "ignore_eos": True}
        rng = random.Random(f"{a.seed} cost {k}")  # outputs of 1/2 to 3/2 --cost-output: the slots' turns fall out of step
        n, b = 0, k  # sessions of this slot; its next user block
        while not self.steady_over.is_set():
            n, turn = n + 1, 0
            name = f"steady.s{k}" + (f".{n}" if n > 1 else "")
            messages = [{**first, "content": STEADY_LINE.format(k=name[len("steady.s"):]) + "\n" + first["content"]}, *rest]
            held = traj.prompt_ids(at)
            if not cost_fits(held, a, room):  # refused before the run (`cost_fits_every_slot`): never spin here
                return
            while not self.steady_over.is_set() and cost_fits(held, a, room):
                rec = fig.Sent(name, turn, self.now(), list(messages))
                self.steady.append(rec)
                self.first_load.setdefault(k, rec)
                tokens = rng.randint(max(1, a.cost_output // 2), a.cost_output + a.cost_output // 2)
                text = await self.stream(rec, {**body, "messages": messages, "max_tokens": tokens}, cut=True)
                if rec.error is not None and not self.steady_over.is_set():
                    return  # a failed turn ends the slot's load (its record says why)
                messages = [*messages, {"role": "assistant", "content": text},
                            {"role": "user", "content": blocks[b % len(blocks)]}]
                b, turn = b + 1, turn + 1
                # what the slot holds: the usage's counts, else (a response cut before its usage) the last
                # count and the ids streamed
                held = (rec.prompt_tokens or held) + (rec.output_tokens or len(rec.output_ids)) + a.cost_grow

    def event(self, rec: fig.Sent, event: dict) -> str:
        """One streamed event into `rec`: its output ids (beside the logprobs) and their time, the
        usage, an error; its text."""
        text = ""
        for choice in event.get("choices") or ():
            text += (choice.get("delta") or {}).get("content") or ""
            ids = [t["id"] for t in ((choice.get("logprobs") or {}).get("content") or ()) if "id" in t]
            if ids:
                t = self.now()
                rec.first_token = rec.first_token if rec.first_token is not None else t
                rec.output_ids += ids
                rec.token_times += [t] * len(ids)
        if event.get("usage"):
            rec.prompt_tokens = event["usage"].get("prompt_tokens", 0)
            rec.output_tokens = event["usage"].get("completion_tokens", 0)
        if event.get("error"):
            rec.error = json.dumps(event["error"])[:300]
        return text

    # asks, polls, switches ----------------------------------------------------------------------

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def ask(self, kind: str, session: str, held: int | None) -> None:
        t = self.now()
        try:
            r = await self.client.post("/v1/shadow/ask", json={"session": session, **QUESTION, "timeout_s": 60})
            d = r.json() if r.status_code == 200 else {}
            self.asks.append(fig.Asked(kind, session, t, r.status_code, d.get("latency_ms"), d.get("behind"),
                                       d.get("read_chunks"), d.get("insertion"), held, d.get("device_wait_ms"),
                                       d.get("device_busy_with"), d.get("parts_ms"), d.get("brought_back")))
        except (httpx.HTTPError, ValueError):
            self.asks.append(fig.Asked(kind, session, t, 0, held=held))

    async def random_asks(self) -> None:
        rate = self.args.asks_per_hour * self.args.sessions / 3600
        if rate <= 0:
            return
        rng = random.Random(self.args.seed + 1)
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= self.stop_at:
                return
            await asyncio.sleep(max(0.0, t - self.now()))
            known = sorted(s for s in self.active if s in self.held)
            if known:
                self.spawn(self.ask("random", rng.choice(known), None))

    async def poll_once(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await self.client.get("/v1/shadow/status")
            s = r.json()
            self.status = s
            self.polls.append(fig.Poll(self.now(), {x["name"]: x["committed"] for x in s["sessions"]},
                                       s["counters"], s["store"]))

    async def poll(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.args.poll_s)

    async def switches(self) -> None:
        a = self.args
        await asyncio.sleep(max(0.0, a.duration - self.now()))
        with contextlib.suppress(httpx.HTTPError):
            self.metrics_density = (await self.client.get("/metrics")).text
        if not a.pairs:
            return
        try:
            began = self.now()
            while self.now() < began + a.settle and self.slots_begun() < a.sessions:  # every slot's load decoding
                await asyncio.sleep(0.25)
            self.settled = {"waited_s": round(self.now() - began, 3),
                            "steady_decoding": sum(r.first_token is not None and r.end is None for r in self.steady),
                            "slots_begun": self.slots_begun(),
                            "density_in_flight": sum(r.end is None for r in self.sent)}
            for on in window_order(a.pairs, a.order):
                try:
                    (await self.client.post("/v1/shadow/switch", json={"on": on})).raise_for_status()
                except httpx.HTTPError as e:  # no window then: the pairs stop, the density figures stay
                    self.switch_error = f"{type(e).__name__}: {e}"
                    return
                start = self.now()  # the window begins once the service has switched
                before = await self.engine_counters()
                await asyncio.sleep(max(0.0, start + a.window - self.now()))
                self.windows.append(("on" if on else "off", start, self.now()))
                self.engine_windows.append((before, await self.engine_counters()))
        finally:
            self.steady_over.set()
            with contextlib.suppress(httpx.HTTPError):  # the shadow left on, as it ran
                await self.client.post("/v1/shadow/switch", json={"on": True})

    def slots_begun(self) -> int:
        """The slots whose load of the cost phase has decoded its first token."""
        return sum(r.first_token is not None for r in self.first_load.values())

    async def gpu_samples(self) -> None:
        """The GPU's busy %, every 250 ms where `nvidia-smi` is (`utilization.gpu`: the share of its
        last sample period in which a kernel ran), into `self.gpu` as (seconds, %)."""
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        proc = await asyncio.create_subprocess_exec(
            exe, "-i", "0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "250",
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            async for line in proc.stdout:
                with contextlib.suppress(ValueError):
                    self.gpu.append((self.now(), float(line.strip())))
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def engine_counters(self) -> dict[str, float]:
        """llama-server's own counters (`--metrics`), on a connection of their own."""
        try:
            async with httpx.AsyncClient(timeout=10.0) as c:
                text = (await c.get(f"{self.engine_url}/metrics")).text
        except httpx.HTTPError:
            return {}
        return {k: float(v) for k, v in (line.split()[:2] for line in text.splitlines()
                                         if line.startswith("llamacpp:") and len(line.split()) >= 2)}


def window_order(pairs: int, order: str) -> list[bool]:
    """Whether the shadow is on in each window of the engine's cost: `abba`, off-on then on-off, ...
    (2 x pairs windows); `alternate`, off, on, off, ..., on, off (2 x pairs + 1, so that each on
    window lies between two off windows)."""
    if order == "abba":
        return [on for p in range(pairs) for on in ((False, True) if p % 2 == 0 else (True, False))]
    return [i % 2 == 1 for i in range(2 * pairs + 1)] if pairs else []


def tokenize_prompts(engine: str, sent: list[fig.Sent], workers: int = 8) -> None:
    """Each request's prompt ids as the engine reads them (`/apply-template`, then `/tokenize`
    with special tokens), after the run, `workers` requests at a time (llama-server answers these
    on its HTTP threads); a fresh connection each (llama-server closes idle ones)."""

    def one(r: fig.Sent) -> None:
        text = httpx.post(f"{engine}/apply-template", json={"messages": r.messages}, timeout=120).json()["prompt"]
        r.prompt_ids = httpx.post(f"{engine}/tokenize", json={"content": text, "add_special": True,
                                                              "parse_special": True}, timeout=120).json()["tokens"]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, [r for r in sent if r.first_token is not None]))


def trajectory_paths(items: list[str]) -> list[Path]:
    """The files named, and each folder's `*.traj.json`, in that order."""
    out = []
    for item in items:
        p = Path(item)
        if not p.exists():
            raise ShadowInputError(f"no trajectory file or folder {p}")
        out += sorted(p.glob("*.traj.json")) if p.is_dir() else [p]
    if not out:
        raise ShadowInputError(f"no *.traj.json in {', '.join(items)}")
    return out


def replay_again(out: Path) -> dict:
    """The replay of a finished run in `out` again (nothing driven): its ledger, costs and journal
    with this build's replay settings (`live_figures.replay_ids`, the voice as live), the side by
    side and the table recomputed against the run's own live figures; the ledger's outputs the
    engine never gave as ids marked from the journal (`ledger-again.jsonl`). Writes `replay-again.json`
    and `table-again.txt` beside the run's files (which stay as they were) and returns the first.
    Of the live figures, only the turn starts at arrival are counted again (from `sent.jsonl` and the
    journal, where the run wrote them)."""
    from shadow.offline.ledger import read_ledger

    doc = json.loads((out / "live-density.json").read_text())
    if not doc["settings"]["duration"]:
        print(f"live_density.py: error: {out} holds a run of the cost phase alone: no density phase to replay", file=sys.stderr)
        raise SystemExit(2)
    status = json.loads((out / "status.json").read_text())
    settings = {**doc["settings"]["replay"], "ids": fig.replay_ids(out / "journal.jsonl"), "disk": fig.service_disk(status),
                "voice_share": 0.0 if not status.get("counters", {}).get("voice_s") else None, "asks_at": None}
    asks = [fig.Asked(**json.loads(line)) for line in (out / "asks.jsonl").read_text().splitlines() if line.strip()]
    # the outputs the engine never gave as ids, marked from the journal (a run's ledger written before the mark)
    ledger, settings["outputs_unseen"] = fig.outputs_unseen(read_ledger(out / "ledger.jsonl"), out / "journal.jsonl")
    if (out / "metrics-density.txt").exists():  # the host tier's and the asks' live rates, charged as live
        settings.update(fig.live_rates((out / "metrics-density.txt").read_text()))
    settings["charge_json"] = write_charge(out, status)
    settings["ask_forwards_json"] = write_samples(out, "ask-forwards.json", fig.ask_forwards(asks, doc["settings"]["duration"]))
    settings["host_rates_json"] = write_samples(out, "host-rates.json", fig.host_rates(asks, doc["settings"]["duration"]))
    fig.write_ledger(out / "ledger-again.jsonl", ledger)
    doc["live"].setdefault("density", {})["active_in_phase"] = round(fig.active_until(ledger, doc["settings"]["duration"]), 3)
    if fig.asks_at(asks, {r.session for r in ledger}, doc["settings"]["duration"], out / "asks-at.jsonl"):
        settings["asks_at"] = str(out / "asks-at.jsonl")
    mine = None
    if (out / "sent.jsonl").exists():  # the service's own turn starts at arrival, counted by this build's figures
        sent = [fig.Sent(messages=[], **{k: v for k, v in json.loads(line).items() if k in SENT_FIELDS})
                for line in (out / "sent.jsonl").read_text().splitlines() if line.strip()]
        mine = [r for r in sent if r.start < doc["settings"]["duration"]]
        doc["live"]["turn_starts"]["at_arrival"] = fig.service_turn_starts(mine, out / "journal.jsonl", settings["grid"])
    replayed = fig.replay(out / "ledger-again.jsonl", out / "costs.json", settings, out, name="replay-again.txt")
    turns = replayed.pop("turns")
    again = {**doc, "replay": replayed, "settings": {**doc["settings"], "replay": settings},
             "side_by_side": fig.side_by_side(doc["live"], replayed, ledger),
             "turn_by_turn": fig.turn_by_turn(mine, out / "journal.jsonl", turns, settings["grid"]) if mine else None}
    (out / "replay-again.json").write_text(json.dumps(again, indent=1))
    (out / "table-again.txt").write_text(fig.table(again) + "\n")
    return again


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    if a.replay_again:
        return replay_again(Path(a.out))
    began = time.monotonic()
    from shadow.engines.gguf import write_gguf
    from shadow.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    try:
        trajectories = [load_trajectory(p, tokenizer) for p in trajectory_paths(a.trajectories)]
        template = Path(a.template).read_text()
        unfit = cost_fits_every_slot(a, trajectories)
        if unfit is not None:
            raise ShadowInputError(unfit)
    except (ShadowInputError, OSError) as e:  # before anything is written
        print(f"live_density.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = a.sessions * max(t.longest for t in trajectories) + a.sessions * 64
    gguf = write_gguf(out / "engine.gguf", template, hidden=a.hidden, layers=a.layers, heads=a.heads,
                      kv_heads=a.kv_heads, intermediate=4 * a.hidden, context=max(ctx, 262_144))
    engine_port, port = free_port(), free_port()
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    journal = out / "journal.jsonl"
    journal.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    with contextlib.ExitStack() as stack:
        engine_cmd = [a.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(engine_port), "--jinja",
                      "-c", str(ctx), "-np", str(a.sessions), "-cb", "--reasoning-format", "none", "--no-webui", "--metrics",
                      *(["-t", str(a.threads)] if a.threads else []), *a.engine_arg]
        engine = start(stack, engine_cmd, out / "engine.log", env)
        wait_up(f"{engine_url}/health", engine, 300)
        serve_cmd = [sys.executable, "-c", "from shadow.cli.main import main; main()", "serve", "--upstream",
                     f"{engine_url}/v1", "--model", a.model, "--device", a.device, "--port", str(port),
                     "--journal", str(journal), "--share", str(a.share), "--grid", str(a.grid),
                     "--max-concurrent", str(8 * a.sessions + 32), *(["--cap-gib", str(a.cap_gib)] if a.cap_gib else []),
                     *(["--batch", str(a.batch)] if a.batch > 1 else []), *(["--disk", a.disk] if a.disk else []),
                     *a.serve_arg]
        serve = start(stack, serve_cmd, out / "serve.log", env)
        wait_up(f"{url}/v1/shadow/status", serve, 900, ready=lambda r: r.status_code == 200 and r.json()["ready"])
        if a.finish_by:
            fit_to(a, a.finish_by - (time.monotonic() - began))
        blocks = [cost_blocks(t, tokenizer, a.cost_grow) for t in trajectories] if a.pairs and a.cost_load == "turns" else []
        run = Run(a, url, trajectories, engine_url, blocks)
        started = time.time()
        asyncio.run(run.main())
        wall = time.time() - started
        tokenize_prompts(engine_url, [r for r in run.sent if r.start < a.duration])
    (out / "status.json").write_text(json.dumps(run.status, indent=1))
    if a.duration == 0:
        return report_cost(a, run, out, ctx, wall)
    return report(a, run, out, journal, ctx, wall)


def fit_to(a: argparse.Namespace, left: float) -> None:
    """Shorten the run to end within `left` s, the work after it (`AFTER_RUN_S`) kept: the density
    phase (to `MIN_DURATION_S` at least), or with none (`--duration 0`) the pairs of windows (to one
    at least). What was asked stays as `asked_duration` or `asked_pairs`."""
    cost = (a.settle + len(window_order(a.pairs, a.order)) * a.window) if a.pairs else 0.0
    if a.duration > 0 and left - cost - AFTER_RUN_S < a.duration:
        a.asked_duration, a.duration = a.duration, max(MIN_DURATION_S, round(left - cost - AFTER_RUN_S, 1))
    elif a.duration == 0 and left - cost - AFTER_RUN_S < 0:
        pairs = next((p for p in range(a.pairs, 0, -1)
                      if a.settle + len(window_order(p, a.order)) * a.window + AFTER_RUN_S <= left), 1)
        a.asked_pairs, a.pairs = a.pairs, pairs


def start(stack: contextlib.ExitStack, cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    f = stack.enter_context(open(log, "w"))
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def stop():
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)
    return proc


def write_charge(out: Path, status: dict) -> str | None:
    """`charge.json` in `out`, what the service charged a share read at most (`live_figures.charge_document`);
    its path, or None (and no file) where it charged its reads' own seconds."""
    doc = fig.charge_document(status)
    if doc is None:
        return None
    (out / "charge.json").write_text(json.dumps(doc))
    return str(out / "charge.json")


def write_samples(out: Path, name: str, samples: list[float]) -> str | None:
    """`samples` as a JSON list in `out / name` (what the replay draws from: `ask-forwards.json`,
    `live_figures.ask_forwards`; `host-rates.json`, `live_figures.host_rates`); its path, or None
    (and no file) where there are none."""
    if not samples:
        return None
    (out / name).write_text(json.dumps(samples))
    return str(out / name)


def report(a, run: Run, out: Path, journal: Path, ctx: int, wall: float) -> dict:
    """Figures, ledger, replay, side by side and engine cost into `out`; the document."""
    requests, unseen = fig.outputs_unseen(fig.ledger([r for r in run.sent if r.start < a.duration]), journal)
    fig.write_ledger(out / "ledger.jsonl", requests)
    (out / "costs.json").write_text(json.dumps(fig.costs_document(run.status)))
    charge = write_charge(out, run.status)
    forwards_json = write_samples(out, "ask-forwards.json", fig.ask_forwards(run.asks, a.duration))
    rates_json = write_samples(out, "host-rates.json", fig.host_rates(run.asks, a.duration))
    (out / "metrics.txt").write_text(run.metrics)
    (out / "metrics-density.txt").write_text(run.metrics_density)
    live = fig.live(run.sent, run.asks, run.polls, journal, a.grid, a.duration)
    live["service"] = fig.scraped(run.metrics_density)
    dens = fig.density(requests)
    live["density"] = {"active": round(dens.active, 3), "new_tok_s": round(dens.new_tok_s, 1), "span_s": round(dens.span_s, 3),
                       "active_in_phase": round(fig.active_until(requests, a.duration), 3)}
    hours = sum(max(0.0, min(a.duration, r.end) - r.start) for r in requests) / 3600  # session-hours in a request
    span_hours = dens.active * dens.span_s / 3600
    asked = sum(1 for x in run.asks if x.time < a.duration)
    forwards = sorted(x.latency_ms for x in run.asks if x.status == 200 and x.read_chunks == 0 and x.latency_ms)
    settings = {"share": a.share, "grid": a.grid, "cap_gib": a.cap_gib, "batch": a.batch, "model": a.model,
                "disk": fig.service_disk(run.status),
                "seed": a.seed, "asks_per_hour": round(asked / span_hours, 3) if span_hours else 0.0,
                "ask_ms": forwards[len(forwards) // 2] if forwards else None, "ids": fig.replay_ids(journal),
                # the driver's streams open no status-line channel: a service that said no phrase is replayed without
                "voice_share": 0.0 if not run.status.get("counters", {}).get("voice_s") else None,
                "outputs_unseen": unseen, "charge_json": charge, "ask_forwards_json": forwards_json,
                "host_rates_json": rates_json,
                **fig.live_rates(run.metrics_density)}
    if fig.asks_at(run.asks, {r.session for r in requests}, a.duration, out / "asks-at.jsonl"):
        settings["asks_at"] = str(out / "asks-at.jsonl")  # the run's asks at their times, not a rate
    replayed = fig.replay(out / "ledger.jsonl", out / "costs.json", settings, out)
    turns = replayed.pop("turns")  # (session, behind) of each turn start replayed: set beside live's below
    doc = {"experiment": "live-density", "settings": {**{k: v for k, v in vars(a).items() if k != "trajectories"},
                                                      "trajectories": [t.name for t in run.trajectories],
                                                      "context": ctx, "wall_s": round(wall, 1), "replay": settings,
                                                      "request_hours": round(hours, 4)},
           "live": live, "replay": replayed, "side_by_side": fig.side_by_side(live, replayed, requests),
           "turn_by_turn": fig.turn_by_turn([r for r in run.sent if r.start < a.duration], journal, turns, a.grid),
           "engine": engine_document(run),
           "sent": {"requests": len(run.sent), "asks": len(run.asks), "steady": len(run.steady),
                    "sessions": sorted({r.session for r in [*run.sent, *run.steady]})}}
    (out / "table.txt").write_text(fig.table(doc) + "\n")
    (out / "live-density.json").write_text(json.dumps(doc, indent=1))
    (out / "asks.jsonl").write_text("".join(json.dumps(asdict(x)) + "\n" for x in run.asks))
    records(out, "sent.jsonl", run.sent)
    records(out, "steady.jsonl", run.steady)
    if run.backlog:
        records(out, "backlog.jsonl", run.backlog)
    return doc


def engine_document(run: Run) -> dict:
    """The engine's cost (`live_figures.engine_cost`) of the cost phase's load, with how it began."""
    return {**fig.engine_cost(run.steady, run.windows, run.polls, run.engine_windows, others=[*run.sent, *run.backlog],
                              gpu=run.gpu),
            "gpu_busy_pct_density": fig.gpu_busy(run.gpu, 0.0, run.args.duration) if run.args.duration else None,
            "settled": run.settled, "switch_error": run.switch_error,
            "charge": (run.status.get("reading") or {}).get("charge"),  # the service's --share-charge in force
            # a failed request of the load ends its slot's load for the rest of the windows
            "load_failed": sum(r.error is not None for r in run.steady),
            "backlog": {"requests": len(run.backlog), "failed": sum(r.error is not None for r in run.backlog),
                        "prompt_ids": sum(r.prompt_tokens for r in run.backlog)}}


def records(out: Path, name: str, sent: list[fig.Sent]) -> None:
    """`sent` into `out / name`, a JSON line each, without messages, ids and token times."""
    (out / name).write_text("".join(json.dumps({k: v for k, v in asdict(r).items()
                                                if k not in ("messages", "output_ids", "prompt_ids", "token_times")})
                                    + "\n" for r in sent))


def report_cost(a, run: Run, out: Path, ctx: int, wall: float) -> dict:
    """A run of the cost phase alone (`--duration 0`): the engine's cost and the requests into `out`; the document."""
    (out / "costs.json").write_text(json.dumps(fig.costs_document(run.status)))
    (out / "metrics.txt").write_text(run.metrics)
    doc = {"experiment": "live-density", "settings": {**{k: v for k, v in vars(a).items() if k != "trajectories"},
                                                      "trajectories": [t.name for t in run.trajectories],
                                                      "context": ctx, "wall_s": round(wall, 1)},
           "live": {"service": fig.scraped(run.metrics)}, "side_by_side": {}, "engine": engine_document(run),
           "sent": {"requests": 0, "asks": 0, "steady": len(run.steady),
                    "sessions": sorted({r.session for r in run.steady})}}
    (out / "table.txt").write_text(fig.table(doc) + "\n")
    (out / "live-density.json").write_text(json.dumps(doc, indent=1))
    records(out, "steady.jsonl", run.steady)
    if run.backlog:
        records(out, "backlog.jsonl", run.backlog)
    return doc


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--trajectories", nargs="+", default=[str(DATA / "trajectories" / "mini-swe-agent")],
                   help="trajectory files or folders (used in this order, cycled)")
    p.add_argument("--template", default=str(DATA / "templates" / "qwen3.5.jinja"), help="the engine's chat template")
    p.add_argument("--sessions", type=int, default=3, help="N: sessions active at once (the engine's slots)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of the density phase")
    p.add_argument("--pairs", type=int, default=0, help="then this many off/on pairs of windows at a steady load (engine cost)")
    p.add_argument("--window", type=float, default=30.0, help="seconds of each off or on window")
    p.add_argument("--order", choices=("alternate", "abba"), default="alternate",
                   help="the windows' order: off, on, off, ..., off (2 x pairs + 1 windows), or off-on, on-off, ...")
    p.add_argument("--cost-load", choices=("turns", "streams"), default="turns",
                   help="the cost phase's load a slot: turn after turn, each a few seconds (the shadow reads all along), "
                        "or one long stream (the shadow reads its prompt before the windows)")
    p.add_argument("--cost-backlog", type=int, default=0,
                   help="ids of prompts the engine reads before the cost phase's load (one token out each), for the "
                        "shadow to read through the windows (0: none)")
    p.add_argument("--cost-grow", type=int, default=1024, help="turns: each turn's new user message, about this many ids")
    p.add_argument("--cost-output", type=int, default=128, help="turns: each turn's output tokens, on average (1/2 to 3/2 of it)")
    p.add_argument("--steady-prompt", type=int, default=8192, help="the cost phase's first prompts, about this many ids")
    p.add_argument("--settle", type=float, default=60.0, help="the longest wait for every steady stream to decode")
    p.add_argument("--pace", type=float, default=1.0, help="recorded gaps between a session's requests times this")
    p.add_argument("--start", choices=("random", "first"), default="random", help="a slot's first trajectory's first turn")
    p.add_argument("--max-output", type=int, default=100_000, help="cap on a request's max_tokens")
    p.add_argument("--turn-asks", type=float, default=1.0, help="fraction of turn starts with an ask")
    p.add_argument("--asks-per-hour", type=float, default=120.0, help="random asks per active session per hour")
    p.add_argument("--poll-s", type=float, default=0.5, help="status poll interval")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--finish-by", type=float, default=0.0,
                   help="seconds from the start by which to be done: the density phase is shortened to fit (0: no bound)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", default=os.environ.get("SHADOW_LLAMA_SERVER", str(CPU_BINARY)))
    p.add_argument("--threads", type=int, default=0, help="llama-server -t (0: its default)")
    p.add_argument("--engine-arg", action="append", default=[], help="one more llama-server argument (repeatable)")
    p.add_argument("--hidden", type=int, default=128, help="the random GGUF's width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--model", default="tiny", help="the shadow (serve --model; the replay's state sizes)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--share", type=float, default=0.02)
    p.add_argument("--grid", type=int, default=512)
    p.add_argument("--cap-gib", type=float, default=None, help="serve --cap-gib and the replay's (default: serve's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--disk", default=None, help="serve --disk (sessions past the cap spill and are restored; the replay's --disk)")
    p.add_argument("--serve-arg", action="append", default=[], help="one more serve argument (repeatable)")
    p.add_argument("--replay-again", action="store_true",
                   help="drive nothing: replay the finished run in --out again with this build's replay settings")
    a = p.parse_args(argv)
    if not all(math.isfinite(v) for v in (a.duration, a.window, a.pace)):
        p.error("--duration, --window and --pace are finite numbers of seconds")
    if a.sessions < 1 or a.duration < 0 or a.pairs < 0 or a.window <= 0 or a.pace <= 0:
        p.error("--sessions, --window and --pace are positive, --duration and --pairs at least 0")
    if a.duration == 0 and not a.pairs:
        p.error("--duration 0 (the cost phase alone) needs --pairs")
    if a.cost_grow < 1 or a.cost_output < 1 or a.cost_backlog < 0:
        p.error("--cost-grow and --cost-output are positive numbers of ids, --cost-backlog at least 0")
    if a.steady_prompt < 1 or not 0 <= a.settle < float("inf"):
        p.error("--steady-prompt is a positive number of ids, --settle a finite number of seconds, at least 0")
    return a


if __name__ == "__main__":
    doc = main()
    print(fig.table(doc), file=sys.stderr)
    print(json.dumps(doc, separators=(",", ":")))
