"""Id parity of a shadow beside a real engine: play the conformance session script (5 sessions,
31 chat turns: plain, reasoning, tools and tool results, content parts, template kwargs;
streamed and not) through a running `shadow serve` proxy, then count from its journal and
status each turn's prompt and output apart by state (verified, unverified, mismatched, not read),
the turns verified (both parts), and whether every session is exact. The figures of docs/SERVE.md's engine table.

Usage: python experiments/engine_parity.py SHADOW_URL JOURNAL [--model NAME] [--max-tokens 8] [--out FILE.json]
(SHADOW_URL: the proxy's root, e.g. http://127.0.0.1:8000; JOURNAL: its --journal file)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from shadow.engines.enginecheck import play_sessions, session_script
from shadow.engines.idcheck import PART_STATES


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("journal", type=Path)
    p.add_argument("--model")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    start = a.journal.stat().st_size if a.journal.exists() else 0
    sent = 0
    with httpx.Client(base_url=a.url, timeout=600) as client:
        for name, body, reply, status in play_sessions(client, session_script(), a.max_tokens, a.model):
            assert status == 200, (name, status)
            sent += 1
        deadline = time.time() + 120
        while client.get("/v1/shadow/status").json()["turns_in_flight"] and time.time() < deadline:
            time.sleep(0.2)
        status = client.get("/v1/shadow/status").json()
    with open(a.journal) as f:
        f.seek(start)
        turns = [r for r in map(json.loads, f.read().splitlines()) if r.get("kind") == "turn"]
    names = set(session_script())
    sessions = [s for s in status["sessions"] if s["name"] in names]
    out = {
        "engine": status["engine"], "turns_sent": sent, "turns_checked": len(turns),
        "prompts": {state: sum(t["prompt_check"] == state for t in turns) for state in PART_STATES},
        "outputs": {state: sum(t["output_check"] == state for t in turns) for state in PART_STATES},
        "turns_verified": sum(t["verified"] is True for t in turns),
        "turns_mismatched": sum(t["verified"] is False for t in turns),
        "turns_unverified": sum(t["verified"] is None for t in turns),
        "sessions_exact": sum(s["id_checks"]["exact"] for s in sessions), "sessions": len(sessions),
        "ids_source": sorted({f"{t['ids_source']['prompt']}/{t['ids_source']['output']}" for t in turns}),
    }
    for k, v in out.items():
        print(f"{k:>18}: {v}")
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
