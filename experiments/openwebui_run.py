"""Drive the real Open WebUI in headless Chromium against an OpenAI-compatible server; record what shows.

Run it with the Python of a venv that has `open-webui` and `playwright` (a separate venv: Open WebUI's
dependencies must not touch the project's), Debian's /usr/bin/chromium beside it:

    .owui-venv/bin/python experiments/openwebui_run.py --upstream http://127.0.0.1:8000 --out out/openwebui
    .owui-venv/bin/python experiments/openwebui_run.py --stub --prompt "hi" --prompt "variant=hidden hi" \\
        --follow-up "and then?" --long-prompt 20000

It starts Open WebUI on a free loopback port (its own data dir in a temp folder, fully offline: no
Ollama, no auth, no telemetry, no model downloads, no title/tag/follow-up requests; user and chat id
headers forwarded upstream), opens it in Chromium and picks the model. Each `--prompt` goes in a new
chat, then each `--follow-up` in the last one; for each it records every change of the status line
under the model's name (text, shimmering or not, ms after sending), the reasoning header ("Thought
for N seconds"), the answer, and the status line after a reload (what the chat keeps). Screenshots
per turn: `N-pending.png` (the first status line), `N-pending-last.png` (the last one still pending),
`N-after.png` (the answer done), `N-history.png` (the status history opened). `report.json` holds it
all, plus what the upstream can tell of the requests it got (`GET /stub/requests` on status_stub.py,
headers included; else `GET /v1/shadow/status`). The last stdout line is a JSON summary. Every process
it starts is stopped on exit; `--timeout` bounds the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

# The state of the newest assistant message, recorded in the page on every DOM change: one entry per
# change of (status text, its shimmer, the reasoning header, whether the answer started, done).
OBSERVER_JS = """() => {
  const scan = () => {
    const all = document.querySelectorAll('.chat-assistant');
    const m = all[all.length - 1];
    if (!m || all.length <= window.__owui.before) return null;  // the reply not there yet
    const status = m.querySelector('.status-description');
    const pending = status ? status.querySelector('.shimmer') !== null : false;
    const buttons = [...m.querySelectorAll('#response-content-container button')];
    const thought = buttons.map(b => b.innerText.trim()).find(t => /^(Thought|Thinking)/.test(t)) || null;
    const prose = [...m.querySelectorAll('.markdown-prose')].map(p => p.innerText.trim()).join('\\n').trim();
    const box = m.closest('[id^="message-"]') || m;
    const done = box.querySelector('button[aria-label="Regenerate"]') !== null;
    return {status: status ? status.innerText.trim() : null, pending, thought, answer: prose, done};
  };
  if (window.__owui) return;
  window.__owui = {t0: Date.now(), log: [], last: '', before: 0};
  const record = () => {
    const s = scan();
    if (!s) return;
    const key = JSON.stringify([s.status, s.pending, s.thought, s.answer.length > 0, s.done]);
    if (key === window.__owui.last) return;
    window.__owui.last = key;
    window.__owui.log.push({ms: Date.now() - window.__owui.t0, status: s.status, pending: s.pending,
                            thought: s.thought, answered: s.answer.length > 0, done: s.done});
  };
  new MutationObserver(record).observe(document.body, {subtree: true, childList: true, characterData: true,
                                                        attributes: true, attributeFilter: ['class']});
  window.__owui.scan = scan;
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_base(url: str) -> str:
    """`url` as an OpenAI base URL (ending in /v1)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def openwebui_env(upstream: str, data_dir: Path) -> dict:
    """Open WebUI's environment: offline, no auth, one OpenAI connection, chat id forwarded."""
    return os.environ | {
        "DATA_DIR": str(data_dir), "WEBUI_SECRET_KEY": secrets.token_hex(32), "WEBUI_AUTH": "False",
        "ENABLE_PERSISTENT_CONFIG": "False", "GLOBAL_LOG_LEVEL": "WARNING",
        # offline: no hub downloads, no local embedding model, no version check, no telemetry
        "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "USE_SLIM_DOCKER": "true",
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "True", "ENABLE_VERSION_UPDATE_CHECK": "False",
        "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "True", "SCARF_NO_ANALYTICS": "True", "ENABLE_OTEL": "False",
        # one OpenAI-compatible connection, nothing else
        "ENABLE_OLLAMA_API": "False", "ENABLE_OPENAI_API": "True", "OPENAI_API_BASE_URL": api_base(upstream),
        "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "sk-openwebui-run"),
        # X-OpenWebUI-Chat-Id (and X-OpenWebUI-User-*) on every upstream request
        "ENABLE_FORWARD_USER_INFO_HEADERS": "True",
        # no side requests to the model: one user message, one upstream chat request
        "ENABLE_TITLE_GENERATION": "False", "ENABLE_FOLLOW_UP_GENERATION": "False", "ENABLE_TAGS_GENERATION": "False",
        "ENABLE_AUTOCOMPLETE_GENERATION": "False", "ENABLE_RETRIEVAL_QUERY_GENERATION": "False",
        "ENABLE_SEARCH_QUERY_GENERATION": "False", "ENABLE_WEB_SEARCH": "False", "ENABLE_CODE_INTERPRETER": "False",
        "ENABLE_IMAGE_GENERATION": "False",
    }


def start(cmd: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    """`cmd` in its own process group (so stop() ends it and its children), output to `log`."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM to `proc`'s process group, SIGKILL after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, what: str) -> float:
    """Seconds until GET `url` answers 200; raises if `proc` exits or `timeout` passes."""
    start_t = time.monotonic()
    while time.monotonic() - start_t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start_t
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer {url} within {timeout:.0f} s")


def long_prompt(tokens: int) -> str:
    """About `tokens` tokens of distinct numbered sentences (about 12 tokens each), one paragraph: the
    rich-text chat input takes 100k characters of one paragraph in under a second, of 1,600 paragraphs
    in minutes."""
    return " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7919 % 10007}."
                    for i in range(max(tokens // 12, 1)))


def open_ui(page, base: str, model: str | None) -> None:
    """A new chat in Open WebUI with `model` selected (the release-notes dialog closed if shown)."""
    page.goto(base + "/", wait_until="domcontentloaded")
    page.locator("#chat-input").wait_for(timeout=60_000)
    page.wait_for_timeout(1000)
    notes = page.get_by_text("Okay, Let's Go!")
    if notes.count():
        notes.first.click()
    if model:
        page.locator("#model-selector-model-button").click()
        page.locator(f'button[role="option"][data-value="{model}"]').click(timeout=10_000)
        page.wait_for_timeout(300)


def run_turn(page, base: str, model: str | None, prompt: str, out: Path, n: int, timeout: float,
             new_chat: bool = True) -> dict:
    """Send `prompt` (in a new chat, or the open one); watch the reply until done or `timeout`;
    screenshots under `out`."""
    if new_chat:
        open_ui(page, base, model)
    page.evaluate(OBSERVER_JS)
    box = page.locator("#chat-input")
    box.click()
    page.keyboard.insert_text(prompt)
    page.evaluate("() => Object.assign(window.__owui, {t0: Date.now(), log: [], last: '',"
                  " before: document.querySelectorAll('.chat-assistant').length})")
    page.keyboard.press("Enter")
    shots, first_status, last_status_shot = {}, None, None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = page.evaluate("() => window.__owui.scan()")
        if state and state["status"] and state["pending"] and not state["answer"] and not state["done"]:
            if first_status is None:
                page.wait_for_timeout(300)
                first_status = state["status"]
                page.screenshot(path=out / f"{n}-pending.png")
                shots["pending"] = f"{n}-pending.png"
            elif state["status"] != last_status_shot:
                page.screenshot(path=out / f"{n}-pending-last.png")
                shots["pending_last"] = f"{n}-pending-last.png"
            last_status_shot = state["status"]
        if state and state["done"]:
            break
        page.wait_for_timeout(100)
    page.wait_for_timeout(1500)
    final = page.evaluate("() => window.__owui.scan()") or {}
    log = page.evaluate("() => window.__owui.log")
    page.screenshot(path=out / f"{n}-after.png")
    shots["after"] = f"{n}-after.png"
    history = []
    toggle = page.locator('.chat-assistant button[aria-label="Toggle status history"]').last
    if toggle.count():
        toggle.click()
        page.wait_for_timeout(500)
        history = [t.strip() for t in page.locator(".chat-assistant").last.locator(".status-description")
                   .all_inner_texts()]
        page.screenshot(path=out / f"{n}-history.png")
        shots["history"] = f"{n}-history.png"
    url = page.url
    page.reload(wait_until="domcontentloaded")  # what the chat keeps: the saved status history
    page.locator(".chat-assistant").last.wait_for(timeout=30_000)
    page.wait_for_timeout(1500)
    reloaded = page.evaluate("() => { const m = [...document.querySelectorAll('.chat-assistant')].at(-1);"
                             " const s = m && m.querySelector('.status-description'); return s ? s.innerText.trim() : null; }")
    first_answer = next((e["ms"] for e in log if e["answered"]), None)
    statuses, seen = [], None
    for e in log:
        if e["status"] and (e["status"], e["pending"]) != seen:
            seen = (e["status"], e["pending"])
            statuses.append({"ms": e["ms"], "text": e["status"], "pending": e["pending"],
                             "before_answer": first_answer is None or e["ms"] <= first_answer})
    return {
        "prompt_chars": len(prompt), "prompt_head": prompt[:80], "chat_id": url.rsplit("/c/", 1)[-1] if "/c/" in url
        else None, "done": bool(final.get("done")), "statuses": statuses, "status_after": final.get("status"),
        "status_history": history, "status_after_reload": reloaded, "first_answer_ms": first_answer,
        "done_ms": next((e["ms"] for e in log if e["done"]), None), "thought": final.get("thought"),
        "answer": final.get("answer"), "screenshots": shots, "dom_log": log,
    }


def upstream_requests(upstream: str):
    """What the upstream can tell of the requests it got: the stub's log, else shadow serve's status."""
    root = api_base(upstream)[: -len("/v1")]
    for path in ("/stub/requests", "/v1/shadow/status"):
        try:
            return {"source": path, "data": get_json(root + path)}
        except (OSError, ValueError):
            continue
    return None


def drive(args, out: Path, tmp: Path, report: dict) -> None:
    """Start what the run needs, drive every turn, fill `report`; stop everything it started."""
    from playwright.sync_api import sync_playwright

    procs = []
    upstream = args.upstream
    try:
        if args.stub:
            port = free_port()
            procs.append(start([sys.executable, str(HERE / "status_stub.py"), "--port", str(port),
                                *args.stub_args.split()], os.environ.copy(), tmp, out / "stub.log"))
            upstream = f"http://127.0.0.1:{port}"
            wait_ready(upstream + "/v1/models", procs[-1], 60, "status_stub.py")
        model = args.model or get_json(api_base(upstream) + "/models")["data"][0]["id"]
        report |= {"upstream": api_base(upstream), "model": model}
        port = args.port or free_port()
        base = f"http://127.0.0.1:{port}"
        data_dir = tmp / "data"
        data_dir.mkdir()
        procs.append(start([sys.executable, "-c", "from open_webui import app; app()", "serve", "--host",
                            "127.0.0.1", "--port", str(port)], openwebui_env(upstream, data_dir), tmp,
                           out / "openwebui.log"))
        report["openwebui_start_s"] = round(wait_ready(base + "/health", procs[-1], args.start_timeout,
                                                       "Open WebUI"), 1)
        report["openwebui_version"] = get_json(base + "/api/version").get("version")
        prompts = args.prompt or ["Say hello."]
        if args.long_prompt:
            prompts = [long_prompt(args.long_prompt) + "\n\n" + text for text in prompts]
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                str(tmp / "chromium"), executable_path=args.chromium, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1000, "height": 640}, device_scale_factor=1)
            try:
                page = ctx.new_page()
                turns = [(text, True) for text in prompts] + [(text, False) for text in args.follow_up or []]
                report["turns"] = []  # filled turn by turn: a run cut short keeps the turns it finished
                for i, (prompt, new_chat) in enumerate(turns):
                    report["turns"].append(run_turn(page, base, model if args.pick_model else None, prompt, out,
                                                    i + 1, args.turn_timeout, new_chat))
            finally:
                ctx.close()
        report["upstream_requests"] = upstream_requests(upstream)
    finally:
        for proc in reversed(procs):
            stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", help="base URL of an OpenAI-compatible server (with or without /v1)")
    parser.add_argument("--stub", action="store_true", help="start experiments/status_stub.py as the upstream")
    parser.add_argument("--stub-args", default="", help="extra arguments for status_stub.py")
    parser.add_argument("--model", help="model id (default: the upstream's first)")
    parser.add_argument("--no-pick-model", dest="pick_model", action="store_false",
                        help="keep Open WebUI's default model instead of picking it in the selector")
    parser.add_argument("--prompt", action="append", help="a message, each in a new chat (repeatable)")
    parser.add_argument("--follow-up", action="append", help="a message sent after the prompts, in the last chat")
    parser.add_argument("--long-prompt", type=int, default=0, help="prepend about N tokens of text to each prompt")
    parser.add_argument("--out", type=Path, default=Path("out/openwebui"))
    parser.add_argument("--port", type=int, help="Open WebUI's port (default: a free one)")
    parser.add_argument("--chromium", default=os.environ.get("SHADOW_CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--start-timeout", type=float, default=240.0, help="seconds for Open WebUI to start")
    parser.add_argument("--turn-timeout", type=float, default=180.0, help="seconds for one reply")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = parser.parse_args()
    if not args.upstream and not args.stub:
        parser.error("give --upstream URL or --stub")
    args.out.mkdir(parents=True, exist_ok=True)

    def expired(*_):
        raise TimeoutError(f"the run took more than {args.timeout:.0f} s")

    signal.signal(signal.SIGALRM, expired)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.alarm(int(args.timeout))
    started = time.monotonic()
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "error": None}
    with tempfile.TemporaryDirectory(prefix="openwebui-run-") as tmp:
        try:
            drive(args, args.out, Path(tmp), report)
        except Exception as e:  # the report says what failed; the exit code too
            report["error"] = f"{type(e).__name__}: {e}"[:2000]
        finally:
            signal.alarm(0)
    report["run_s"] = round(time.monotonic() - started, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    turns = report.get("turns", [])
    print(json.dumps({"report": str(args.out / "report.json"), "error": report["error"], "run_s": report["run_s"],
                      "version": report.get("openwebui_version"),
                      "statuses": [[s["text"] for s in t["statuses"]] for t in turns],
                      "thought": [t["thought"] for t in turns], "done": [t["done"] for t in turns]}))
    sys.exit(1 if report["error"] else 0)


if __name__ == "__main__":
    main()
