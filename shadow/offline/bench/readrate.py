"""How fast the reader reads: ms per chunk by grid and context depth, a whole session from empty,
an ask at the end of a long session, fork decode per token, and the reference path on the same ids.

Speed does not depend on the weights' values or the ids, so sessions are seeded random ids.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from shadow.offline.bench.timer import synchronize, time_ms
from shadow.core.reader import Reader, Session

SOURCE_SESSION = 58_278  # the source's whole-conversation read (5.1 s on its GPU)
ASK_SESSION = 41_802  # the source's ask: at the end of a 41,802-token session,
ASK_QUESTION = 290  # a 9-class question of about 290 tokens, 330 ids pending
LETTERS = [32, 33, 34, 35, 36, 37, 38, 39, 40]  # "A" .. "I" in the Qwen3.5 vocabulary


@dataclass
class DepthRow:
    model: str
    grid: int
    context: int
    ms_per_chunk: float
    ms_per_1k_tokens: float
    kernels: str = ""


@dataclass
class BatchRow:
    """One batched read of the next chunk of `batch` sessions all at `context` (batch 1: one
    session's chunk, timed the same way); `run`: of one session's next `batch` chunks from
    `context` on (a run, its GDN layers reading them as one sequence)."""

    model: str
    grid: int
    context: int
    batch: int
    ms_per_read: float
    ms_per_chunk: float
    kernels: str = ""
    run: bool = False


@dataclass
class ReadRate:
    """A run's measurements, each one's fields together (0 or None: not measured): chunks by
    depth; a whole session read from empty; batched reads; an ask at the end of a long session
    and fork decode; the reference path's read and ours of the same ids from empty."""

    rows: list[DepthRow] = field(default_factory=list)
    full_read_tokens: int = 0
    full_read_s: float = 0.0
    batch_rows: list[BatchRow] = field(default_factory=list)
    ask_session_tokens: int = 0
    ask_ms: float = 0.0
    fork_decode_ms_per_token: float = 0.0
    reference_ms_per_1k_tokens: float | None = None  # the reference path, reading compare_tokens from empty
    compare_tokens: int = 0
    ms_per_1k_tokens_read: float = 0.0  # ours, the same ids

    @property
    def speedup_vs_reference(self) -> float | None:
        if self.reference_ms_per_1k_tokens is None or not self.ms_per_1k_tokens_read:
            return None
        return self.reference_ms_per_1k_tokens / self.ms_per_1k_tokens_read


def random_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk_times(
    reader: Reader, contexts: Sequence[int], repeats: int = 5,
    progress: Callable[[str], None] | None = None, model: str = "",
) -> list[DepthRow]:
    """Median ms of one grid chunk read at each context depth (rounded down to the grid).
    Each timed chunk runs in a fork, so the session is the same for every repeat."""
    device = reader.model.device
    depths = sorted({c // reader.grid * reader.grid for c in contexts})
    session = reader.new_session("read-rate")
    reader.feed_prompt(session, random_ids(depths[-1] + reader.grid, seed=1))
    chunk = torch.tensor(session.ids[: reader.grid], device=device)
    rows = []
    for depth in depths:
        reader.advance(session, max_chunks=(depth - session.committed) // reader.grid)
        if progress:
            progress(f"{model} grid {reader.grid}, context {depth:,}")

        def one_chunk() -> None:
            with reader.fork(session.state) as state:
                reader.forward(chunk, state)

        ms = time_ms(one_chunk, device, repeats=repeats, warmup=2)
        rows.append(DepthRow(model, reader.grid, depth, ms, ms * 1000 / reader.grid, reader.model.kernels.name))
    return rows


def batch_times(
    reader: Reader, contexts: Sequence[int], batches: Sequence[int], repeats: int = 5,
    progress: Callable[[str], None] | None = None, model: str = "",
) -> list[BatchRow]:
    """Median ms of one read of the next chunk of B sessions at each context depth (rounded down to
    the grid) in one batched forward (`Reader.advance_batch`), for B = 1 (`advance`, the same way)
    and each size in `batches`; and of one session's next B chunks from that depth as one run (rows
    with `run`). A chunk's time depends on its shape, not on the values: the sessions' rows up to
    the depth are the zeros their buffers were made with, and each timing sets the sessions back
    to the depth."""
    device = reader.model.device
    depths = sorted({c // reader.grid * reader.grid for c in contexts})
    sizes = sorted({1, *batches})
    rows = []
    for depth in depths:
        sessions = sessions_at(reader, depth, max(sizes))
        for b in sizes:
            group = sessions[:b]
            if progress:
                progress(f"{model} batches of {b}, context {depth:,}")

            def one_read(group=group) -> None:
                for s in group:
                    s.state.length = depth
                if len(group) == 1:
                    reader.advance(group[0], max_chunks=1)
                else:
                    reader.advance_batch(group)

            ms = time_ms(one_read, device, repeats=repeats, warmup=2)
            rows.append(BatchRow(model, reader.grid, depth, b, ms, ms / b, reader.model.kernels.name))
        del sessions
        run = sessions_at(reader, depth, 1, chunks=max(sizes))[0]
        for b in sizes[1:]:
            if progress:
                progress(f"{model} a run of {b} chunks, context {depth:,}")

            def run_read(b=b) -> None:
                run.state.length = depth
                reader.advance_batch([run] * b)

            ms = time_ms(run_read, device, repeats=repeats, warmup=2)
            rows.append(BatchRow(model, reader.grid, depth, b, ms, ms / b, reader.model.kernels.name, run=True))
        del run
    return rows


def sessions_at(reader: Reader, depth: int, n: int, chunks: int = 1) -> list[Session]:
    """`n` sessions whose read position is `depth`, each with `chunks` whole chunks to read after it."""
    out = []
    for k in range(n):
        s = reader.new_session(f"read-rate batch {k}")
        for layer in s.state.attention:
            layer.reserve(depth + chunks * reader.grid)
        s.state.length = depth
        s.ids = [1000 + k] * (depth + chunks * reader.grid)
        out.append(s)
    return out


def read_seconds(reader: Reader, ids: list[int], runs: int = 3) -> float:
    """Seconds to read `ids` into an empty session (whole chunks; the tail stays pending), median of runs."""
    device = reader.model.device
    times = []
    for _ in range(runs):
        session: Session = reader.new_session("read")
        reader.feed_prompt(session, ids)
        synchronize(device)
        start = time.perf_counter()
        reader.advance(session)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def ask_and_decode(reader: Reader, n: int, repeats: int = 5, decode_tokens: int = 32) -> tuple[float, float]:
    """(ask ms, fork decode ms per token) at the end of an n-id session: a 290-id question with 9
    single-token choices over the pending tail; decode per token from the difference of a
    decode_tokens+1 and a 1-token decode of the same prompt, median over `repeats` such pairs.
    Between pairs the session reads one more chunk, so each pair decodes at key lengths no
    earlier timing met (a kernel that caches work per length, as cuDNN's attention does, cannot
    hide that cost here) while the fork reads the same number of rows."""
    device = reader.model.device
    session = reader.new_session("ask")
    reader.feed_prompt(session, random_ids(n, seed=3))
    reader.advance(session)
    question = random_ids(ASK_QUESTION, seed=4)
    ask = time_ms(lambda: reader.ask(session, question, LETTERS), device, repeats=repeats, warmup=2)
    reader.decode(session, question, decode_tokens + 1)  # warm-up: graphs captured, kernels compiled
    per_token = []
    for r in range(repeats):
        reader.feed_output(session, random_ids(reader.grid, seed=10 + r))  # one chunk more: new lengths
        reader.advance(session)
        long = time_ms(lambda: reader.decode(session, question, decode_tokens + 1), device, repeats=1, warmup=0)
        short = time_ms(lambda: reader.decode(session, question, 1), device, repeats=1, warmup=0)
        per_token.append((long - short) / decode_tokens)
    return ask, statistics.median(per_token)
