"""What-if: a batched read that may take several consecutive chunks of one session, not one chunk
a session. The reader cannot do this yet (a session's second chunk in a forward needs its first
chunk's GDN state within the same layer: the two would be one 1,024-row sequence in the GDN calls
and two entries of the attention table, and whether fla's kernels give the bits of two 512-row
calls that way is for the GPU to show). This script replays a ledger with the scheduler and the
replay's device widened so, charged the same batch costs by depth, to see what it would buy.

    python3 experiments/same_session_batches.py out/trajectories.ledger.jsonl --pack 29 --share 0.02 \\
        --cap-gib 0 --batch 8 --read-rate-json docs/results/batch/read-rate-h200-batches-desc.json

takes `shadow replay-ledger`'s own arguments and prints its tables; with SAME_SESSION=0 in the
environment it is `replay-ledger` unchanged (the side-by-side arm).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import shadow.offline.replay as replay_module
from shadow.core.schedule import ReadScheduler, graphed_batch
from shadow.offline.engine_replay import EngineReplay


class SameSessionScheduler(ReadScheduler):
    """After the sessions in rank order (one chunk each), the batch's free places go to the next
    whole chunks of the sessions already in it, while the estimate stays within the limit."""

    def _batch(self, first, limit_s, fits=None):
        others, est = super()._batch(first, limit_s, fits)
        entries = list(others)
        if len(entries) + 1 >= self.rule.batch:
            return others, est
        names = [first.name, *(n for n, _ in entries)]
        depths = [first.committed, *(d for _, d in entries)]
        for name in names:
            s = self.sessions[name]
            for k in range(1, self._whole(s)):
                if len(entries) + 1 >= self.rule.batch:
                    break
                total = self.batch_estimate([*depths, s.committed + k * self.grid])
                if total is None or total > limit_s + 1e-12:
                    break
                entries.append((name, s.committed + k * self.grid))
                depths.append(s.committed + k * self.grid)
                est = total
        size = graphed_batch(len(entries) + 1)
        entries = entries[: size - 1]
        return tuple(entries), self.batch_estimate([first.committed, *(d for _, d in entries)])

    def read_done(self, read, chunks, seconds, now):
        s = self.sessions.get(read.session)
        if chunks > 0 and read.others and s is not None and s.committed == read.depth:
            s.committed += self.grid  # the first session's chunk before its later ones among the others
        super().read_done(read, chunks, seconds, now)


def _batch(self, read, t):
    """As `EngineReplay._batch`, with a session's consecutive chunks allowed among the others."""
    first = self.store.peek(read.session)
    if first is None or first.committed != read.depth or first.committed + self.grid > first.ids:
        return replace(read, others=()), 0, t
    batch, at = [(first, first.committed)], {first.name: first.committed + self.grid}
    for name, depth in read.others:
        h = self.store.peek(name)
        if h is not None and at.get(name, h.committed) == depth and depth + self.grid <= h.ids:
            batch.append((h, depth))
            at[name] = depth + self.grid
    batch = batch[: graphed_batch(len(batch))]
    t = self._busy(t, self.costs.batch_s([d for _, d in batch]))
    for h, _ in batch:
        self.store.advance(h)
    if len(batch) - 1 != len(read.others):
        read = replace(read, others=tuple((h.name, d) for h, d in batch[1:]))
    return read, len(batch), t


if __name__ == "__main__":
    if os.environ.get("SAME_SESSION", "1") != "0":
        replay_module.ReadScheduler = SameSessionScheduler
        EngineReplay._batch = _batch
    from cli.main import app

    app(["replay-ledger", *sys.argv[1:]])
