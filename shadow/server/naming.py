"""Which store name a request's prompt is read into: the session it names, its side branches
(`NAME~K`), `auto-N` for an unnamed one, or, with prefix matching, the resident session sharing
the longest prefix. Pure bookkeeping: the caller holds the service's lock and passes the store.
"""

from __future__ import annotations

from collections.abc import Sequence

from shadow.core.reader import common_prefix
from shadow.core.store import SessionStore


class SessionNames:
    def __init__(self, prefix_match: bool = False, max_branches: int = 8):
        self.prefix_match = prefix_match  # a request with no session name continues the longest matching session
        self.max_branches = max_branches
        self.recent: list[str] = []  # store names, least recently fed first
        self._heads: dict[str, list[int]] = {}  # store name -> its first grid of ids (to tell side requests)
        self.branches: dict[str, list[str]] = {}  # session name -> its side branches' store names
        self._auto = 0

    def touch(self, name: str) -> None:
        if name in self.recent:
            self.recent.remove(name)
        self.recent.append(name)

    def family(self, session: str) -> list[str]:
        """The session and its side branches' store names."""
        return [session, *self.branches.get(session, [])]

    def choose(self, requested: str | None, prompt: Sequence[int], store: SessionStore | None, grid: int) -> str:
        """The store name a prompt is read into: the named session (or, unnamed, the resident
        session sharing the longest prefix, with prefix matching on; else a new `auto-N`), or
        one of its side branches. A prompt that shares less than half of a session's first block
        of the grid (of its first ids, if it has fewer) is a side request (opencode's title
        request beside its conversation: another system prompt) and is read as a side branch
        (`NAME~K`) instead of rolling the session back; an ordinary new turn, even one that
        differs where the last prompt's generation prompt was, shares far more. Later prompts
        continue whichever branch they share most with."""
        name = requested
        if name is None and self.prefix_match:
            name = self.match(prompt, store)
        if name is None:
            self._auto += 1
            name = f"auto-{self._auto}"
        best, best_shared = None, -1
        for candidate in self.family(name):
            head = self._heads.get(candidate)
            if not head:
                if candidate == name and best is None:
                    best, best_shared = name, 0  # empty or new: anything continues it
                continue
            shared = common_prefix(head, prompt)
            if 2 * shared >= min(grid, len(head), len(prompt)) and shared > best_shared:
                best, best_shared = candidate, shared
        if best is None:
            branches = self.branches.setdefault(name, [])
            if len(branches) >= self.max_branches:  # the least recently used branch is reused
                best = min(branches, key=lambda b: self.recent.index(b) if b in self.recent else -1)
            else:
                best = f"{name}~{len(branches) + 1}"
                branches.append(best)
        self._heads[best] = list(prompt[:grid])
        return best

    def match(self, prompt: Sequence[int], store: SessionStore | None, minimum: int = 64) -> str | None:
        """The resident main session sharing the longest prefix (at least `minimum` ids)."""
        if store is None:
            return None
        best, best_len = None, minimum - 1
        side = {b for branches in self.branches.values() for b in branches}
        for name in self.recent:
            s = store.peek(name)
            if s is None or name in side:
                continue
            n = common_prefix(s.ids, prompt)
            if n > best_len:
                best, best_len = name, n
        return best
