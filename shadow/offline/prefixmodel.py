"""The prefix cache as the ledger replay models it: the live cache's trie (`core.prefixcache.PrefixTrie`:
the same lines stored, the same bytes, the same least-recently-used evictions) without tensors.

A ledger holds token counts, not ids, so what sessions share is stated: every session's first
prompt begins with the same `shared_tokens` ids (a system prompt and tool definitions), and the
rest of it is its own. A chunk below that many ids is keyed by its position alone, one above by
its session and position. A later prompt read from the start again (a rollback to the start, a
session dropped and read again) is taken to begin with its first prompt, as an agent's prompts
do (each appends to the one before). The rules are the live cache's: a session that reads from
the start starts at the deepest cached line its first prompt shares; lines within its first
prompt are offered as its reads pass them; a hit marks the deeper line that other sessions'
chunks reach without a state there.
"""

from __future__ import annotations

from shadow.core import driving
from shadow.core.prefixcache import PrefixTrie, fed_prompt
from shadow.core.residency import StateSize


class PrefixModel:
    """The modelled cache of one shadow: `cap` bytes, sessions' state sizes `size`, and the ids
    every first prompt shares (`shared_tokens`)."""

    def __init__(self, grid: int, cap: int, size: StateSize, shared_tokens: int = 0):
        if shared_tokens < 0:
            raise ValueError("shared prefix tokens are not negative")
        self.trie = PrefixTrie(grid, cap)
        self.size, self.shared_tokens = size, shared_tokens

    @property
    def grid(self) -> int:
        return self.trie.grid

    def status(self) -> dict:
        return self.trie.status()

    def key(self, name: str, a: int) -> tuple:
        """The key of the chunk of `name`'s first prompt at row `a`."""
        return ("shared", a) if a + self.grid <= self.shared_tokens else (name, a)

    def fed(self, keeper, h, feed: driving.Feed, new: bool) -> driving.Feed:
        """As live (`prefixcache.fed_prompt`)."""
        return fed_prompt(self, keeper, h, feed, new)

    def start(self, keeper, h) -> int:
        g = self.grid
        if h.ids < g:
            return 0  # nothing whole to start from: not a lookup
        top = min(h.ids, h.prefix.scope if h.prefix.scope else h.ids) // g * g
        path = self.trie.walk(self.key(h.name, a) for a in range(0, top, g))
        hit = next((n for n in reversed(path) if n.has_state), None)
        if path and (hit is None or path[-1].line > hit.line):
            driving.mark(keeper, h, path[-1].line)
        if hit is None:
            self.trie.counts.misses += 1
            return 0
        self.trie.touch(path[: path.index(hit) + 1], hit)
        h.committed = hit.line
        h.capacity = max(h.capacity, self.size.capacity(hit.line))
        h.checkpoints = []
        h.marks = [m for m in h.marks if m >= hit.line]
        h.prefix.line, h.prefix.node = hit.line, hit
        driving.chunks_read(keeper, h)
        self.trie.counts.hits += 1
        self.trie.counts.tokens_saved += hit.line
        return hit.line

    def start_bytes(self, line: int) -> int:
        """Bytes a hit at `line` copies: the path's KV rows and the line's state."""
        return self.size.kv_row * line + self.size.delta

    def offer(self, h) -> None:
        """As `PrefixCache.offer`, in bytes (`PrefixTrie.extend`)."""
        if h.prefix is None:
            return
        self.trie.extend(h.prefix, h.committed, lambda a: self.key(h.name, a),
                         lambda a: (None, self.size.kv_row * self.grid), lambda: (None, self.size.delta))
