"""A real client: Open WebUI in headless Chromium shows the status lines `shadow serve` streams
before the first token (experiments/openwebui_run.py drives it): a real `shadow serve` in front of a
real `transformers serve`, and experiments/status_stub.py for the event shapes Open WebUI renders
(with and without the last done:true event). Skipped where Open WebUI (a separate venv:
SHADOW_OPENWEBUI_PYTHON names its python; .ci/run installs it under ~/.cache/shadow) or Chromium
(/usr/bin/chromium, or SHADOW_CHROMIUM) is not installed. SHADOW_OPENWEBUI_UPSTREAM=URL also runs
it against a given server."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from serving import running, serving, settled

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "experiments" / "openwebui_run.py"
CHROMIUM = os.environ.get("SHADOW_CHROMIUM", "/usr/bin/chromium")


def openwebui_python() -> str | None:
    """The python of a venv with open-webui and playwright, or None."""
    for candidate in (os.environ.get("SHADOW_OPENWEBUI_PYTHON"), str(ROOT / ".owui-venv/bin/python"),
                      str(Path.home() / ".cache/shadow/openwebui-0.12.4/bin/python")):
        if candidate and Path(candidate).exists():
            found = subprocess.run([candidate, "-c", "import importlib.util as u, sys; sys.exit(not ("
                                    "u.find_spec('open_webui') and u.find_spec('playwright')))"], capture_output=True)
            if found.returncode == 0:
                return candidate
    return None


PYTHON = openwebui_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PYTHON is None, reason="Open WebUI not installed (a venv with open-webui and playwright; "
                                              "set SHADOW_OPENWEBUI_PYTHON to its python)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Chromium not found at {CHROMIUM} (apt-get install chromium)"),
]


def load_stub():
    spec = importlib.util.spec_from_file_location("status_stub", ROOT / "experiments" / "status_stub.py")
    stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stub)
    return stub


def drive(upstream: str, out: Path, *args: str) -> dict:
    """openwebui_run.py (Open WebUI + Chromium) against `upstream`; its report."""
    run = subprocess.run([PYTHON, str(HARNESS), "--upstream", upstream, "--out", str(out), "--chromium", CHROMIUM,
                          "--timeout", "420", *args], capture_output=True, text=True, timeout=480)
    report = json.loads((out / "report.json").read_text())
    assert run.returncode == 0 and report["error"] is None, (report.get("error"), run.stdout[-3000:],
                                                             run.stderr[-3000:])
    return report


def test_open_webui_shows_status_lines_before_the_answer_and_the_final_line_after(tmp_path):
    stub = load_stub()
    app = stub.create_app(model="stub-test", statuses=3, status_delay=1.0, token_delay=0.05)
    with serving(app) as client:
        report = drive(str(client.base_url), tmp_path, "--prompt", "What is in the context?",
                       "--prompt", "variant=nofinal What is in the context?", "--long-prompt", "500",
                       "--follow-up", "And then?")
    assert report["model"] == "stub-test"
    said, unsaid, again = report["turns"]
    chats = [r for r in app.state.requests if r["path"] == "/v1/chat/completions"]
    assert len(chats) == 3  # one upstream request per message: no title, tag or follow-up requests

    # while pending: every line, in order, shimmering, before the first answer text
    texts = [s["text"] for s in said["statuses"]]
    assert texts[:3] == stub.status_lines(3, chats[0]["prompt_tokens"])
    assert all(s["pending"] and s["before_answer"] for s in said["statuses"][:3])
    assert said["first_answer_ms"] is not None and said["statuses"][2]["ms"] < said["first_answer_ms"]
    assert said["screenshots"]["pending"] and (tmp_path / said["screenshots"]["pending"]).stat().st_size > 0

    # after: the done:true line stays under the model's name (saved with the chat), no longer pending;
    # the history holds every line; the reasoning is its own collapsible block; the answer in full
    final = said["statuses"][-1]
    assert final["text"].startswith("Read ") and not final["pending"]
    assert said["status_after"] == final["text"] == said["status_after_reload"]
    assert said["status_history"][1:] == texts
    assert said["thought"].startswith("Thought for")
    assert said["answer"] == stub.ANSWER and said["done"]

    # without a done:true event the last line keeps shimmering after the answer
    assert unsaid["done"] and unsaid["answer"] == stub.ANSWER
    assert unsaid["statuses"][-1]["pending"] and unsaid["status_after"] == unsaid["statuses"][-1]["text"]

    # Open WebUI forwards the chat id upstream (ENABLE_FORWARD_USER_INFO_HEADERS)
    ids = [c["headers"].get("x-openwebui-chat-id") for c in chats]
    assert ids == [said["chat_id"], unsaid["chat_id"], unsaid["chat_id"]] and ids[0] != ids[1]

    # the next turn of a chat sends back the answer alone: status lines and reasoning never go upstream
    assert again["statuses"][0]["text"] == stub.status_lines(3, chats[2]["prompt_tokens"])[0]
    assert again["status_after"].startswith("Read ") and again["answer"] == stub.ANSWER
    assert [m["role"] for m in chats[2]["messages"]] == ["user", "assistant", "user"]
    assert chats[2]["messages"][1] == {"role": "assistant", "content": stub.ANSWER[:120]}
    assert chats[0]["prompt_tokens"] > 500 * 3 // 4  # the long prompt went upstream


def test_open_webui_shows_the_lines_of_shadow_serve_in_front_of_transformers_serve(tmp_path, big_model,
                                                                                 transformers_engine):
    """Open WebUI -> `shadow serve` (proxy, its client recognised by X-OpenWebUI-Chat-Id) -> a real
    `transformers serve`: while the engine reads the long prompt the browser shows the reading
    line under the model's name, then the last line saying what the wait was; they are the lines the
    server journaled, with the engine's own prompt count; the shadow's session is verified."""
    from shadow.text.chat_template import ChatRenderer, load_hf_tokenizer, read_template

    big = ChatRenderer(read_template(big_model), load_hf_tokenizer(big_model))
    journal = tmp_path / "journal.jsonl"
    timing = {"quiet_s": 0.2, "progress_every_s": 0.5}  # the CPU engine reads 12k ids in about 2 s
    with running(upstream=transformers_engine, renderer=big, journal=journal, status_timing=timing,
                 prefix_match=False) as (proxy, service):
        report = drive(str(proxy.base_url), tmp_path / "run", "--prompt", "Say hello.", "--long-prompt", "3000")
        settled(service)
        status = proxy.get("/v1/shadow/status").json()
    turn = report["turns"][0]
    assert turn["done"], turn
    shown = [s["text"] for s in turn["statuses"]]
    assert shown and all(s["pending"] and s["before_answer"] for s in turn["statuses"][:-1]), turn["statuses"]
    assert all(x.startswith("reading ") for x in shown[:-1]), shown  # "reading the prompt" until it is counted
    final = turn["statuses"][-1]
    assert final["text"].startswith("Read ") and not final["pending"] and turn["status_after"] == final["text"]

    records = [r for r in map(json.loads, journal.read_text().splitlines()) if r.get("kind") == "turn"]
    chat = [r for r in records if r.get("status_lines")]
    assert len(chat) == 1, records  # the chat turn; Open WebUI's side requests (titles, tags) carry no lines
    record = chat[0]
    said = [x["text"] for x in record["status_lines"]]
    kinds = [x["kind"] for x in record["status_lines"]]
    waited = kinds.index("waited")  # the last status event; the lines after it went into the reasoning
    assert set(kinds[:waited]) <= {"waiting", "reading"} and not {"waiting", "reading"} & set(kinds[waited + 1:])
    # what the browser showed under the model's name is what was said, in order, to the last line (a
    # line the next one replaced within a frame may never be drawn)
    rest = iter(said[: waited + 1])
    assert all(any(x == y for y in rest) for x in shown) and shown[-1] == said[waited], (said, shown)
    count = f"{record['prompt_ids']:,}"
    assert any(x.startswith(f"reading {count} tokens") for x in shown), shown
    assert final["text"].startswith(f"Read {count} tokens in ")
    # the prompt verified against the engine's count; the output not read (this engine shows no output
    # ids: the next prompt brings the reply), so the turn as a whole is not called verified
    assert record["prompt_check"] == "verified" and record["ids_source"]["prompt"] == "template"
    assert record["output_check"] == "not_read" and record["verified"] is None
    session = next(s for s in status["sessions"] if s["name"] == record["session"])
    assert session["id_checks"]["exact"], session


@pytest.mark.skipif(not os.environ.get("SHADOW_OPENWEBUI_UPSTREAM"), reason="SHADOW_OPENWEBUI_UPSTREAM not set")
def test_open_webui_against_a_given_server(tmp_path):
    """E.g. `shadow serve --model tiny --port 8000` and SHADOW_OPENWEBUI_UPSTREAM=http://127.0.0.1:8000."""
    report = drive(os.environ["SHADOW_OPENWEBUI_UPSTREAM"], tmp_path, "--prompt", "Say hello.",
                   "--long-prompt", os.environ.get("SHADOW_OPENWEBUI_LONG_PROMPT", "2000"))
    turn = report["turns"][0]
    assert turn["done"] and turn["answer"]
    assert turn["statuses"] and turn["statuses"][0]["pending"] and turn["statuses"][0]["before_answer"]
    assert not turn["statuses"][-1]["pending"] and turn["status_after"] == turn["statuses"][-1]["text"]
