"""The shadow beside a real engine: Hugging Face `transformers serve` on loopback, serving a
random-weight Qwen3.5 big-model folder with the real vocabulary and the real Qwen3.5 chat template.

Ground truth for the engine's prompt ids is the engine's own code path, outside the shadow: its
message conversion (`transformers.cli.serving`) and `apply_chat_template` with the folder's
tokenizer and template; and its `usage`. Output ids: greedy `generate` on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from engines import transformers_serve_missing
from serving import assert_exact, running, settled, wait_until_read
from shadow.engines.enginecheck import play_sessions, session_script

pytestmark = pytest.mark.skipif(transformers_serve_missing() is not None,
                                reason=transformers_serve_missing() or "")


@pytest.fixture()
def engine(transformers_engine):
    return transformers_engine


@pytest.fixture(scope="module")
def truth(big_model):
    """The engine's prompt ids for a request body, computed with the engine's own code."""
    from transformers import AutoTokenizer
    from transformers.cli.serving.utils import BaseHandler, Modality

    tok = AutoTokenizer.from_pretrained(str(big_model))

    def prompt_ids(body: dict) -> list[int]:
        messages = BaseHandler.get_processor_inputs_from_messages(body["messages"], Modality.LLM)
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"), tokenize=True,
                                      return_dict=True, **body.get("chat_template_kwargs", {}))
        return list(out["input_ids"])

    return prompt_ids


def renderer_of(folder: Path):
    from shadow.text.chat_template import ChatRenderer, load_hf_tokenizer, read_template

    return ChatRenderer(read_template(folder), load_hf_tokenizer(folder))


def test_thirty_one_turns_through_the_proxy_read_the_engines_prompt_ids(engine, big_model, truth, tmp_path):
    """5 sessions, 31 turns (plain, reasoning, tools and tool results, content parts, template
    kwargs; streamed and not) through `shadow serve` in front of `transformers serve`: the dialect
    is found by probing; every turn's prompt ids equal the engine's and its usage count; a turn is
    verified only where its ids are the engine's (none silently wrong); each final state is
    bit-equal to a fresh prefill of its ids, and those ids are the engine's."""
    journal = tmp_path / "journal.jsonl"
    equal, turns = 0, 0
    last_body: dict[str, dict] = {}
    with running(upstream=engine, journal=journal, renderer=renderer_of(big_model)) as (proxy, service):
        for name, body, reply, status_code in play_sessions(proxy, session_script()):
            assert status_code == 200 and reply.usage is not None and reply.malformed == 0
            settled(service)
            turns += 1
            want = truth(body)
            assert reply.usage["prompt_tokens"] == len(want)  # the ground truth is the engine's
            with service.state_lock:
                got = service.store.get(name).ids[: len(want)]
            equal += got == want
            last_body[name] = body
        histories = last_body
        status = proxy.get("/v1/shadow/status").json()
        assert status["engine"]["dialect"] == "transformers", status["engine"]
        wait_until_read(service, list(histories))
        for name in histories:
            assert_exact(service, name)
        final_ids = {}
        with service.state_lock:
            for name in histories:
                final_ids[name] = list(service.store.get(name).ids)
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    turn_records = [r for r in records if r.get("kind") == "turn"]
    assert turns >= 30 and len(turn_records) == turns
    assert equal == turns  # every prompt read is the engine's
    assert all(r["prompt_verified"] for r in turn_records)
    assert all(r["verified"] is True for r in turn_records), [r for r in turn_records if not r["verified"]]
    sessions = {r["name"]: r for r in status["sessions"]}
    for name, ids in final_ids.items():
        want = truth(last_body[name])
        assert ids[: len(want)] == want
        assert sessions[name]["id_checks"]["exact"] is True
        if len(ids) > len(want):  # its output was read: the ids the engine generated, greedy on the same weights
            assert ids[len(want):] == generate(big_model, want, len(ids) - len(want))


def generate(folder: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_check_engine_against_transformers_serve(engine, big_model):
    from typer.testing import CliRunner

    from cli.main import app

    r = CliRunner().invoke(app, ["check-engine", engine, "--chat-template", str(big_model), "--max-tokens", "4",
                                 "--long-words", "600", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["dialect"] == "transformers" and doc["summary"]["answered"] == doc["summary"]["requests"] >= 12
    rows = doc["requests"]
    assert all(row["prompt_ids"] == row["usage_prompt"] for row in rows)  # every prompt counted as the engine did
    assert all(row["prompt_source"] == "template" and row["output_source"] == "retokenised" for row in rows)
    assert doc["summary"]["mismatched"] == 0


def test_without_a_template_the_proxy_passes_everything_and_reads_nothing(engine, tmp_path):
    """No chat template: requests still pass through unchanged; the turns are unverified and the
    session is not exact, and asks say why."""
    with running(upstream=engine) as (proxy, service):
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        direct = httpx.post(engine + "/chat/completions", json=body, timeout=120).json()
        r = proxy.post("/v1/chat/completions", headers={"x-session-id": "bare"}, json=body)
        assert r.status_code == 200 and r.json()["usage"] == direct["usage"]
        assert r.json()["choices"][0]["message"] == direct["choices"][0]["message"]  # greedy: the same answer
        settled(service)
        status = proxy.get("/v1/shadow/status").json()
        assert status["engine"]["template"] is None
        assert all(s["name"] != "bare" or s["committed"] + s["pending"] == 0 for s in status["sessions"])
