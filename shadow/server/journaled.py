"""Counts the service keeps only in its journal, read from the records appended since it started:
each turn's prompt and output states apart, the status lines its clients were shown by kind, and
the voice's phrases on those lines, said or refused by reason.

`JournalCounts.update()` reads what was appended since the last call (the metrics call it at each
scrape), so a scrape costs the records written since the one before, never the whole file. A
line not yet ended (a record being written) waits for the next call; a file that shrank (rotated)
is read again from its start. Records from before the service started are not counted.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

RESULTS = {True: "verified", False: "mismatched", None: "unverified"}  # records without `prompt_check`
STATES = ("verified", "unverified", "mismatched", "not_read")


class JournalCounts:
    """Counts from the journal at `path` (None: none is kept, and nothing is counted)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.checks: Counter = Counter()  # (part, result): turns; part is prompt or output
        self.lines: Counter = Counter()  # kind: status lines shown
        self.phrases: Counter = Counter()  # (result, reason): phrases said, or refused and why
        self.lock = threading.Lock()
        self._offset = self._size()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size if self.path is not None else 0
        except OSError:
            return 0

    def update(self) -> None:
        """Count the records appended since the last call."""
        if self.path is None:
            return
        with self.lock:
            if self._size() < self._offset:
                self._offset = 0  # the file was replaced or cut
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except OSError:
                return
            end = data.rfind(b"\n") + 1
            self._offset += end
            for line in data[:end].splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    self._count(record)

    def _count(self, record: dict) -> None:
        if record.get("kind") == "turn":
            for part in ("prompt", "output"):
                state = record.get(f"{part}_check")
                if state not in STATES:  # a record of an earlier version: its booleans
                    state = RESULTS.get(record.get(f"{part}_verified"), "unverified")
                self.checks[part, state] += 1
        for line in record.get("status_lines") or ():
            if not isinstance(line, dict):
                continue
            self.lines[str(line.get("kind"))] += 1
            phrase = line.get("phrase")
            if isinstance(phrase, dict):
                said = bool(phrase.get("said"))
                self.phrases["said" if said else "refused", "" if said else str(phrase.get("reason") or "unknown")] += 1
