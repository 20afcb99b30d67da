"""`shadow ab` where the engine does not take vLLM's fields, and when its verdict is not significant.

The engine is a real HTTP server on loopback that refuses `ignore_eos`, `min_tokens` and
`return_token_ids` as `transformers serve` refuses fields it does not know (422, FastAPI's
`detail` naming them) and otherwise streams text deltas with no ids; a real `shadow serve` proxy
stands in front of it. The verdict's rule is checked on `summarize` itself.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from scripted import renderer
from serving import running, serving
from shadow.cli.main import app
from shadow.offline.bench.ab import FIELDS, MIN_PAIRS, Run, run_ab, summarize
from shadow.text.tokenizer import load_tokenizer


def strict_engine(seen: list[dict]) -> FastAPI:
    """Refuses FIELDS with 422 naming those sent; else streams 6 deltas (2 of reasoning, 4 of
    content) 5 ms apart, whatever max_tokens says. `seen`: each chat body's keys and status."""
    engine = FastAPI()

    @engine.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @engine.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        unexpected = {f for f in FIELDS if f in body}
        seen.append({"keys": set(body), "status": 422 if unexpected else 200})
        if unexpected:
            return JSONResponse({"detail": f"Unexpected fields in the request: {unexpected}"}, status_code=422)

        def chunk(delta: dict, finish=None) -> str:
            return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            for k in range(6):
                await asyncio.sleep(0.005)
                yield chunk({"reasoning_content": f"r{k}"} if k < 2 else {"content": f" c{k}"})
            yield chunk({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return engine


@contextmanager
def proxy_in_front(seen: list[dict]):
    with serving(strict_engine(seen)) as engine:
        with running(upstream=f"{engine.base_url}/v1", renderer=renderer()) as (client, service):
            yield str(client.base_url).rstrip("/") + "/v1", client


@pytest.mark.slow
def test_ab_in_front_of_an_engine_that_refuses_the_vllm_fields_drops_them_and_says_so():
    """Without --allow-insignificant, 2 pairs exit 1 with the verdict "not significant"; with it,
    0. Either way no answered request carried a refused field, the JSON and the output name the
    fields dropped and what that does, each run counted its 6 deltas (reasoning ones too), and the
    switch is back on."""
    seen: list[dict] = []
    args = ["--prompt-tokens", "200", "--output-tokens", "6", "--runs", "2", "--pause", "0", "--gate-pct", "1000",
            "--json"]
    with proxy_in_front(seen) as (url, client):
        refused = CliRunner().invoke(app, ["ab", "--url", url, *args])
        allowed = CliRunner().invoke(app, ["ab", "--url", url, *args, "--allow-insignificant"])
        assert client.get("/v1/shadow/status").json()["enabled"] is True
    assert refused.exit_code == 1, refused.output
    assert "the verdict is not significant: 2 pairs, fewer than 5" in " ".join(refused.output.split())
    assert allowed.exit_code == 0, allowed.output
    for result in (refused, allowed):
        doc = json.loads(result.output.strip().splitlines()[-1])
        assert doc["verdict"] == "not significant" and doc["passed"] is True
        assert doc["fields"]["sent"] == [] and doc["fields"]["dropped"] == list(FIELDS)
        assert set(doc["fields"]["effects"]) == set(FIELDS) and "differ in length" in doc["fields"]["effects"]["min_tokens"]
        assert all(r["tokens"] == 6 and r["fields"] == [] for r in doc["per_run"])
        words = " ".join(result.output.split())
        assert all(f"the engine does not take {f}:" in words for f in FIELDS)
    answered = [s for s in seen if s["status"] == 200]
    assert len(answered) == 8 and not any(s["keys"] & set(FIELDS) for s in answered)


@pytest.mark.slow
def test_run_ab_asked_for_the_fields_sends_each_run_again_without_those_the_engine_named():
    """Given all of FIELDS (a server whose dialect is not known yet), the first run is refused,
    sent again without the three fields the refusal names, and every later run goes without them
    at the first try."""
    seen: list[dict] = []
    with proxy_in_front(seen) as (url, _):
        runs = run_ab(url, load_tokenizer(None), 200, 6, 2, 0.0, fields=FIELDS)
    assert [r.fields for r in runs] == [()] * 4 and all(r.tokens == 6 for r in runs)
    # the refusals (the proxy's own try with its fields, then the client's body as sent) come first
    statuses = [s["status"] for s in seen]
    first = statuses.index(200)
    assert 1 <= first <= 2 and statuses[first:] == [200] * 4
    assert all(s["keys"] >= set(FIELDS) for s in seen[:first])


def run(pair: int, arm: str, rate: float, fields: tuple = FIELDS) -> Run:
    return Run(arm, pair, 0.1, rate, 10, fields=fields)


def pairs(deltas_pct: list[float]) -> list[Run]:
    """One pair per delta: off at 100 tok/s, on at 100 * (1 + delta/100)."""
    return [r for p, d in enumerate(deltas_pct) for r in (run(p, "off", 100.0), run(p, "on", 100.0 + d))]


def test_a_verdict_needs_min_pairs_within_the_gate():
    tight = summarize(pairs([-1.0, 0.5, -0.5, 1.0, 0.0]), 3.0)
    assert tight["significant"] is True and tight["verdict"] == "passed" and tight["spread_pct"] == pytest.approx(1.0)
    few = summarize(pairs([-1.0, 0.5, -0.5, 1.0]), 3.0)
    assert few["verdict"] == "not significant" and few["not_significant_because"] == [f"4 pairs, fewer than {MIN_PAIRS}"]
    wide = summarize(pairs([-20.0, 20.0, -20.0, 20.0, 0.0]), 3.0)
    assert wide["verdict"] == "not significant" and wide["passed"] is True
    assert wide["spread_pct"] == pytest.approx(20.0) and "wider than the gate's 3 %" in wide["not_significant_because"][0]
    slow = summarize(pairs([-10.0, -9.0, -11.0, -10.0, -10.5]), 3.0)
    assert slow["significant"] is True and slow["verdict"] == "failed"


def test_the_summary_names_a_field_dropped_in_any_run():
    runs = pairs([0.0] * MIN_PAIRS)
    runs[0] = run(0, "off", 100.0, fields=("return_token_ids",))
    fields = summarize(runs, 3.0)["fields"]
    assert fields["sent"] == ["return_token_ids"] and fields["dropped"] == ["ignore_eos", "min_tokens"]
    assert list(fields["effects"]) == ["ignore_eos", "min_tokens"]
