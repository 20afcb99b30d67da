"""One prefix, many sessions: a bounded cache of grid-line states shared by every session.

On the grid the state at line k·G depends only on the ids below it, so every session whose first
k·G ids are equal has the same state there, bit for bit. The cache is a trie of grid lines: a node
is one chunk of G ids (its key: the ids themselves, compared exactly; the dict's hash is only the
index), the KV rows of that chunk for each attention layer, and, where a session's reads stopped
at its line, the GDN conv and recurrent state there. A session that would read from the start (a
new session's first prompt, a rollback to the start, a session read again after it was dropped)
starts at the deepest line whose chunks all equal its ids' and that holds a state: the path's KV
rows and the line's GDN state are copied into a fresh state (`PrefixCache.start`), which is the
state a fresh prefill of those ids gives, by the grid's own argument.

Lines are offered as a session's reads pass them (`PrefixCache.offer`, from `driving.chunks_read`:
after each chunk read alone, at the end of each run of a batched read) while they lie within the
session's first prompt (its `scope`): the ids sessions share are their first prompts' (system
prompt, tool definitions); later turns are their own. One session adds at most half the cap, so
a long prompt read from its start never pushes every other line out. Bounded in bytes: when over
its cap, the states of inner lines where no sessions diverged go first, then leaf lines (their KV
rows and state) and the states of lines where sessions diverged, each kind least recently used
first (an inner line's KV rows stay while a deeper line needs them). A lookup touches the path it
uses. Held on the reader's device (restoring is device-to-device copies).

`PrefixTrie` is the trie, its bytes and its eviction order without tensors: the ledger
replay models the cache with the same class (`offline.prefixmodel`), so both evict alike.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shadow.core import driving
from shadow.errors import ShadowInputError

PREFIX_CACHE_GIB = 2.0  # the default bound, on any device: a 21k-token prefix of the 0.8B, a state at every line, is about 1 GiB


class Node:
    """One grid line of the trie: the chunk below it (`key`), its KV rows (`kv`, `kv_bytes`), the
    state at the line if one is kept (`state`, `state_bytes`), when each was last used."""

    __slots__ = ("key", "parent", "children", "line", "kv", "kv_bytes", "state", "state_bytes", "used",
                 "state_used", "alive")

    def __init__(self, key: Hashable, parent: Node | None, line: int, kv: Any, kv_bytes: int):
        self.key, self.parent, self.line = key, parent, line
        self.children: dict[Hashable, Node] = {}
        self.kv, self.kv_bytes = kv, kv_bytes
        self.state: Any = None
        self.state_bytes = 0
        self.used = self.state_used = 0
        self.alive = True

    @property
    def has_state(self) -> bool:
        return self.state_bytes > 0 or self.state is not None


@dataclass
class PrefixCounts:
    """What the cache did: lookups that found a line (`hits`) or none (`misses`), the ids the hits
    did not read again (`tokens_saved`), lines stored, units evicted."""

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    lines_stored: int = 0
    evictions: int = 0
    start_s: float = 0.0  # seconds of the hits' copies into fresh states


class PrefixTrie:
    """Grid lines by their chunks' keys, bounded by `cap` bytes (KV rows and states), least
    recently used first out. Payloads are opaque (tensors live, None in the replay's model)."""

    def __init__(self, grid: int, cap: int):
        if cap < 0:
            raise ShadowInputError(f"the prefix cache's bound must not be negative (got {cap} bytes)")
        self.grid, self.cap = grid, cap
        self.root = Node(None, None, 0, None, 0)
        self.bytes = 0
        self.nodes = 0
        self.states = 0
        self.clock = 0
        self.counts = PrefixCounts()

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def walk(self, keys: Iterable[Hashable], start: Node | None = None) -> list[Node]:
        """The nodes whose keys follow `keys` from `start` (default the root), as far as they match."""
        node, path = start or self.root, []
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def touch(self, path: Sequence[Node], state: Node | None = None) -> None:
        """A lookup used `path`'s KV rows and `state`'s state."""
        now = self.tick()
        for node in path:
            node.used = now
        if state is not None:
            state.state_used = now

    def child(self, parent: Node, key: Hashable, kv: Any, kv_bytes: int) -> Node:
        """The child of `parent` for `key`, made with its KV rows if new."""
        node = parent.children.get(key)
        now = self.tick()
        if node is None:
            node = Node(key, parent, parent.line + self.grid, kv, kv_bytes)
            parent.children[key] = node
            self.bytes += kv_bytes
            self.nodes += 1
        node.used = now
        return node

    def keep_state(self, node: Node, state: Any, nbytes: int) -> bool:
        """Keep `state` at `node`'s line unless it holds one; whether it was kept."""
        if node.has_state:
            node.state_used = self.tick()
            return False
        node.state, node.state_bytes = state, nbytes
        node.state_used = self.tick()
        self.bytes += nbytes
        self.states += 1
        self.counts.lines_stored += 1
        return True

    def evict(self, protect: Node | None = None) -> None:
        """Units out until the bytes fit the cap: first the states of inner lines where no sessions
        diverged (a later session rarely starts there), then leaf lines and the states of lines
        where sessions diverged, each kind least recently used first. `protect`'s path (the line
        just stored) goes last: its inner lines' states may go, its nodes only if it alone is past
        the cap."""
        if self.bytes <= self.cap:
            return
        protect = self._trim(protect)
        kept = set()
        node = protect
        while node is not None:
            kept.add(id(node))
            node = node.parent
        units = []  # (rank, last use, node, whole): a leaf whole, an inner node's state alone
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack += node.children.values()
            branch = int(len(node.children) > 1)  # sessions diverged here: its state is the one they start at
            if id(node) in kept:
                if node is not protect and node.has_state:  # the path's KV rows stay, its inner states may go
                    units.append((branch, node.state_used, node, False))
                continue
            if not node.children:
                units.append((1, max(node.used, node.state_used), node, True))
            elif node.has_state:
                units.append((branch, node.state_used, node, False))
        units.sort(key=lambda u: u[:2])
        for _, _, node, whole in units:
            if self.bytes <= self.cap:
                break
            if not node.alive:
                continue
            if whole and not node.children:
                self._drop_leaf(node, kept)
            else:
                self._drop_state(node)
        if self.bytes > self.cap and protect is not None:
            self.evict()

    def _trim(self, node: Node | None) -> Node | None:
        """A line just stored whose path's KV rows and own state alone are past the cap: its deepest
        lines go (a shallower line that fits is worth more than none), up to the nearest line
        that fits with a state of its own; that line, or None."""
        while node is not None and node is not self.root:
            kv, up = 0, node
            while up is not self.root:
                kv += up.kv_bytes
                up = up.parent
            if kv + node.state_bytes <= self.cap:
                return node if node.has_state else None
            if node.children:
                return None  # other lines go through it: the ordinary order decides
            parent = node.parent
            self._drop_leaf_only(node)
            node = parent
        return None

    def _drop_leaf_only(self, node: Node) -> None:
        self._drop_state(node, counted=False)
        del node.parent.children[node.key]
        node.alive, node.kv = False, None  # a session's walk may still name it: its rows go now
        self.bytes -= node.kv_bytes
        self.nodes -= 1
        self.counts.evictions += 1

    def _drop_state(self, node: Node, counted: bool = True) -> None:
        if node.has_state:
            self.bytes -= node.state_bytes
            node.state, node.state_bytes = None, 0
            self.states -= 1
            self.counts.evictions += counted

    def _drop_leaf(self, node: Node, kept: set[int]) -> None:
        """A leaf out; its parent, a leaf now and without a state of its own, follows while over the cap."""
        while node is not None and node is not self.root and not node.children and id(node) not in kept:
            parent = node.parent
            self._drop_leaf_only(node)
            if self.bytes <= self.cap or parent.has_state:
                break
            node = parent

    def extend(self, walk: Walk, line: int, key_of, kv_of, state_of) -> None:
        """A session's reads reached `line`: within its `walk.scope`, and while what it stored stays
        within half the cap (a long session read from its start never pushes every other line out),
        the chunks below the line the trie lacks are added (`key_of(a)`, `kv_of(a)` -> (payload,
        bytes) for the chunk at row `a`) and the line's state kept (`state_of()` -> (payload,
        bytes)); then the cap is enforced."""
        g = self.grid
        if line <= 0 or line > walk.scope or self.cap <= 0 or walk.stored > self.cap // 2:
            return
        node, lo = self.root, 0
        if walk.node is not None and walk.node.alive and walk.line <= line:
            node, lo = walk.node, walk.line
        for a in range(lo, line, g):
            key = key_of(a)
            child = node.children.get(key)
            if child is None:
                kv, nbytes = kv_of(a)
                child = self.child(node, key, kv, nbytes)
                walk.stored += nbytes
            else:
                child.used = self.tick()
            node = child
        if not node.has_state:
            state, nbytes = state_of()
            self.keep_state(node, state, nbytes)
            walk.stored += nbytes
        else:
            node.state_used = self.tick()
        walk.line, walk.node = line, node
        self.evict(protect=node)

    def status(self) -> dict:
        c = self.counts
        return {"bytes": self.bytes, "cap_bytes": self.cap, "lines": self.states, "chunks": self.nodes,
                "hits": c.hits, "misses": c.misses, "tokens_saved": c.tokens_saved,
                "lines_stored": c.lines_stored, "evictions": c.evictions, "start_s": round(c.start_s, 6)}


@dataclass
class Walk:
    """Where a session stands in the cache: `scope`, the last grid line of its first prompt (lines
    up to it are offered); the deepest line it offered and that line's node (a shortcut for the
    next offer, valid while the node is in the trie and the session did not roll back); the bytes
    it added."""

    scope: int
    line: int = 0
    node: Node | None = field(default=None, repr=False)
    stored: int = 0  # bytes it added to the cache


class PrefixCache:
    """The cache on one reader's model: tensors of the reader's device and dtype. `cap_bytes`
    bounds it (0 keeps nothing)."""

    def __init__(self, model, grid: int, cap_bytes: int):
        self.model = model
        self.trie = PrefixTrie(grid, cap_bytes)
        probe = model.new_state()
        self.attention = [i for i, layer in enumerate(probe.layers) if hasattr(layer, "k")]
        self.state_bytes = probe.arena.conv.numel() * probe.arena.conv.element_size() + \
            probe.arena.recurrent.numel() * probe.arena.recurrent.element_size()

    @property
    def grid(self) -> int:
        return self.trie.grid

    @property
    def counts(self) -> PrefixCounts:
        return self.trie.counts

    def status(self) -> dict:
        return self.trie.status()

    def keys(self, ids: Sequence[int], lo: int, hi: int) -> list[tuple[int, ...]]:
        g = self.grid
        return [tuple(ids[a : a + g]) for a in range(lo, hi, g)]

    # a session's feed ------------------------------------------------------------------------

    def fed(self, keeper, session, feed: driving.Feed, new: bool) -> driving.Feed:
        """After `session` was fed a prompt (`new`: it held no ids before): `fed_prompt`'s rules."""
        return fed_prompt(self, keeper, session, feed, new)

    def start(self, keeper, session) -> int:
        """A session at 0 starts at the deepest cached line at or below its ids' last whole chunk:
        the path's KV rows and the line's state copied into a fresh state. Where the ids match
        cached chunks deeper than that line (another session's batched run passed them without
        stopping), that line is marked, so that the session's own reads stop and store it. Returns
        the line (0: no hit)."""
        g = self.grid
        if len(session.ids) < g:
            return 0  # nothing whole to start from: not a lookup
        path = self.trie.walk(self.keys(session.ids, 0, len(session.ids) // g * g))
        hit = next((n for n in reversed(path) if n.has_state), None)
        if path and (hit is None or path[-1].line > hit.line):
            driving.mark(keeper, session, path[-1].line)
        if hit is None:
            self.counts.misses += 1
            return 0
        began = time.perf_counter()
        used = path[: path.index(hit) + 1]
        self.trie.touch(used, hit)
        state = self.model.new_state()
        for layer in state.attention:
            layer.reserve(hit.line)
        into, rows = [state.arena.conv, state.arena.recurrent], [hit.state[0], hit.state[1]]
        for node in used:
            a, b = node.line - g, node.line
            for layer, (k, v) in zip(state.attention, node.kv):
                into += [layer.k[:, a:b], layer.v[:, a:b]]
                rows += [k, v]
        torch._foreach_copy_(into, rows)  # every copy at once (grouped launches on a GPU), bits as they are
        state.length = hit.line
        session.state = state
        session.checkpoints = []
        session.marks = [m for m in session.marks if m >= hit.line]
        session.prefix.line, session.prefix.node = hit.line, hit
        driving.chunks_read(keeper, session)  # a checkpoint wanted at the line is taken now
        self.counts.hits += 1
        self.counts.tokens_saved += hit.line
        self.counts.start_s += time.perf_counter() - began  # queued copies on a GPU: their launch, not their end
        return hit.line

    # a session's reads ------------------------------------------------------------------------

    def offer(self, session) -> None:
        """The session's reads reached a line: `PrefixTrie.extend`, the KV rows copied from the
        session's buffers and the GDN state from its arena."""
        if session.prefix is None:
            return
        g, state = self.grid, session.state

        def kv_of(a: int):
            kv = [(state.layers[i].k[:, a : a + g].clone(), state.layers[i].v[:, a : a + g].clone())
                  for i in self.attention]
            return kv, sum(k.numel() * k.element_size() * 2 for k, _ in kv)

        self.trie.extend(session.prefix, session.committed, lambda a: tuple(session.ids[a : a + g]), kv_of,
                         lambda: ((state.arena.conv.clone(), state.arena.recurrent.clone()), self.state_bytes))


def fed_prompt(cache, keeper, session, feed: driving.Feed, new: bool) -> driving.Feed:
    """The cache's rules at a prompt fed, live and modelled alike: the session's scope set on its
    first prompt (the last grid line of the ids it holds, `session.known`); its shortcut dropped on
    a rollback; and, where it now reads from the start, its start at the deepest cached line
    (`cache.start`). Returns the feed with `cached` (that line) and `rolled_back_to`/`reread` as
    reading resumes."""
    g = cache.grid
    if new or session.prefix is None:
        session.prefix = Walk(session.known // g * g if new else 0)
    elif feed.rolled_back_to is not None:
        session.prefix.line, session.prefix.node = 0, None
    if session.committed != 0:
        return feed
    line = cache.start(keeper, session)
    if not line:
        return feed
    if feed.rolled_back_to is not None:
        return driving.Feed(feed.first_diff, line, max(0, feed.reread - line), line)
    return driving.Feed(feed.first_diff, feed.rolled_back_to, feed.reread, line)


def cache_for(model, grid: int, gib: float | None) -> PrefixCache | None:
    """A prefix cache of `gib` GiB on `model`'s device (None or 0: none)."""
    if gib is None or gib == 0:
        return None
    if not gib > 0 or gib != gib:
        raise ShadowInputError(f"--prefix-cache-gib must be a positive number of GiB (got {gib})")
    return PrefixCache(model, grid, int(gib * 2**30))
