"""The journal `shadow serve` keeps (JSONL, one record a line: each turn's check against the
engine, each question asked with its answer, the status lines a client was shown), and what its
records share with offline readers of it (`routereval`): the CRC of a session's ids, so a later
reader can tell whether the prefix it rebuilt is the one the answer was given over.
"""

from __future__ import annotations

import json
import os
import zlib
from collections import deque
from collections.abc import Sequence
from pathlib import Path


def ids_crc(ids: Sequence[int]) -> int:
    """CRC-32 of a list of ids, so a journal can tell later whether a session's prefix changed."""
    return zlib.crc32(",".join(map(str, ids)).encode())


class Journal:
    """The service's JSONL journal (mode 0600: it holds what was asked; None: none is kept) and
    the last answers (`answers`, shown in status)."""

    def __init__(self, path: Path | None, answers: deque):
        self.path, self.answers = path, answers

    def answer(self, record: dict) -> None:
        self.answers.append(record)
        self.write(record)

    def write(self, record: dict) -> None:
        if self.path:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(record) + "\n")
