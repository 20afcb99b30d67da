"""What the ledger replay charges for the shadow's device work: a chunk by the depth of its first
row, a restore and a spill by their bytes, an ask's forward, a voice phrase, and the proxy's own
tokenisation of a prompt the engine does not show.

The defaults are measurements, each named with the run it comes from (docs/BENCHMARKS.md,
docs/STORE.md); a user replaces them with their own (`ChunkTable.from_read_rate` takes a
`shadow read-rate --json` line), and `known_costs` gives a live scheduler the same line's costs.
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shadow.core.schedule import KnownCosts

GIB = 1 << 30

# One chunk of the 0.8B shape at grid 512 on the H200, fla-triton kernels (revision 2), ms by the
# depth of its first row: `shadow read-rate --model qwen3.5-0.8b --device cuda --grid 512 --grid 256
# --grid 1024 --grid 2048 --grid 4096 --contexts 0,16384,65536,100352 --repeats 7 --json`
# (docs/results/read-rate-h200-r2.json, its grid-512 rows).
H200_CHUNK_MS = ((0, 2.970570), (16384, 3.792175), (65536, 6.191487), (100352, 7.835424))
H200_GRID = 512
H200_RESTORE_GIB_S = 1.86  # format 3, O_DIRECT, a 0.79 GiB file (docs/results/store/restore-h200-format3.json)
H200_SPILL_GIB_S = 1.34  # the same run's spills
# a move to or from the host tier: a 58k session back from pinned host memory on a lent H100, the
# slower of its two ways (out 45.1) (docs/results/store/restore-h100-host.json)
GPU_HOST_GIB_S = 42.26
H200_ASK_MS = 8.0539  # one ask's forward at 41,802 ids, the read-rate run above (`ask_ms`)
H200_PHRASE_MS = 66.56  # a voice phrase, median (docs/results/voice-replay-h200-qwen3.5-0.8b.txt)
# The Qwen3.5 Jinja template rendered and tokenised (`ChatRenderer.prompt_ids`), median over 84
# trajectory prompts on the project's 2-core CPU machine: `python3 experiments/tokenize_speed.py
# --template ../shared/data/templates/qwen3.5.jinja --trajectories ../shared/data/trajectories/mini-swe-agent
# --prompts 2 --repeats 3` (docs/results/cost/tokenize-speed-cpu.txt).
CPU_TOKENIZE_MS_PER_1K = 2.621


@dataclass(frozen=True)
class ChunkTable:
    """Seconds of one chunk by the depth of its first row: the measured depths, linear between two
    of them, the nearest one's past either end. `label` names where it came from."""

    depths: tuple[int, ...]
    seconds: tuple[float, ...]
    label: str

    def __post_init__(self) -> None:
        if not self.depths or len(self.depths) != len(self.seconds) or list(self.depths) != sorted(set(self.depths)):
            raise ValueError("a chunk table needs rising depths, one cost each")
        if any(not math.isfinite(s) or s <= 0 for s in self.seconds) or min(self.depths) < 0:
            raise ValueError("a chunk table's costs are positive and its depths not negative")

    @classmethod
    def flat(cls, ms_per_1k: float, grid: int) -> ChunkTable:
        """One cost at every depth: `ms_per_1k` ms per 1,000 tokens."""
        return cls((0,), (grid * ms_per_1k / 1e6,), f"{ms_per_1k:g} ms/1k")

    @classmethod
    def h200(cls, grid: int = H200_GRID) -> ChunkTable:
        """The built-in table (H200_CHUNK_MS), measured at grid 512; another grid scales it by its
        chunk's rows (a rough guess: say so where it is used)."""
        scale = grid / H200_GRID
        return cls(tuple(d for d, _ in H200_CHUNK_MS), tuple(ms * scale / 1000 for _, ms in H200_CHUNK_MS),
                   "H200 by depth" if grid == H200_GRID else f"H200 by depth, scaled to grid {grid}")

    @classmethod
    def from_read_rate(cls, doc: dict, grid: int, label: str) -> ChunkTable:
        """A `shadow read-rate --json` document: its `rows` at `grid` of its own model and kernels
        (each with `context` and `ms_per_chunk` or `ms_per_1k_tokens`), by depth; a document with
        no rows, its one `ms_per_1k_tokens` at every depth. ValueError when neither is there."""
        rows = doc.get("rows")
        if not rows:
            rate = float(doc["ms_per_1k_tokens"])
            if not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"its ms_per_1k_tokens is not a positive number ({rate})")
            return replace(cls.flat(rate, grid), label=f"{label} ({rate:g} ms/1k)")
        if not isinstance(rows, list):
            raise ValueError("its rows are not a list")
        at: dict[int, float] = {}
        for row in rows:
            if not isinstance(row, dict) or row.get("grid", grid) != grid:
                continue
            if any(row.get(k, doc.get(k)) != doc.get(k) for k in ("model", "kernels")):
                continue  # another model's or kernel set's rows of the same run
            ms = row["ms_per_chunk"] if "ms_per_chunk" in row else float(row["ms_per_1k_tokens"]) * grid / 1000
            at[int(row["context"])] = float(ms) / 1000
        if not at:
            raise ValueError(f"no rows at grid {grid}")
        depths = tuple(sorted(at))
        return cls(depths, tuple(at[d] for d in depths), label)

    def __call__(self, depth: int) -> float:
        i = bisect.bisect_right(self.depths, depth)
        if i == 0:
            return self.seconds[0]
        if i == len(self.depths):
            return self.seconds[-1]
        lo, hi = self.depths[i - 1], self.depths[i]
        return self.seconds[i - 1] + (self.seconds[i] - self.seconds[i - 1]) * (depth - lo) / (hi - lo)

    def ms_per_1k(self, depth: int, grid: int) -> float:
        return self(depth) * 1e6 / grid


# Batched reads of the same shape on the H200 (fla-triton revision 3, CUDA graphs per batch; the
# sessions' GDN convs in one launch, their gated delta rules in one call and their gated norms in one
# a layer, their attention in one launch a layer): ms of one forward reading
# the next chunk of B sessions all at one depth, B = 1, 2, 4, 8: `python3 experiments/batch_rate.py
# --model qwen3.5-0.8b --device cuda --depth D --batches 1,2,4,8 --repeats 5`
# (docs/results/batch/batch-rate-h200-depth{0,16384,65536}.txt, one device call, 2026-12-03).
H200_BATCH_MS = {
    0: {1: 3.117, 2: 4.607, 4: 8.107, 8: 14.947},
    16384: {1: 3.799, 2: 6.202, 4: 11.34, 8: 21.623},
    65536: {1: 6.248, 2: 11.111, 4: 20.959, 8: 40.594},
}


def read_rate_document(text: str) -> dict:
    """The `--json` document of a `shadow read-rate` run: its output's last line that is not
    blank, a JSON object. ValueError otherwise."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("it is empty")
    doc = json.loads(lines[-1])
    if not isinstance(doc, dict):
        raise ValueError("its last line is not a JSON object")
    return doc


def known_costs(doc: dict, grid: int, label: str) -> KnownCosts:
    """What a live scheduler starts from, of a read-rate document at `grid` (its own model's and
    kernels' rows): each chunk's seconds by depth, and each batched read's by size and depth.
    ValueError when it has no chunk rows at that grid or rows it cannot use."""
    table = ChunkTable.from_read_rate(doc, grid, label)
    batches = []
    for row in doc.get("batch_rows") or []:
        if not isinstance(row, dict) or row.get("grid", grid) != grid or int(row.get("batch", 1)) < 2 or row.get("run"):
            continue
        if any(row.get(k, doc.get(k)) != doc.get(k) for k in ("model", "kernels")):
            continue
        ms, context = float(row["ms_per_read"]), int(row["context"])
        if not math.isfinite(ms) or ms <= 0 or context < 0:
            raise ValueError(f"a batch row's ms_per_read is not a positive number or its context is negative ({row})")
        batches.append((int(row["batch"]), context, ms / 1000))
    return KnownCosts(tuple(zip(table.depths, table.seconds)), tuple(batches), label)


@dataclass(frozen=True)
class BatchTable:
    """What a chunk costs inside a batched read: by batch size and depth, the batched read's time
    over B single chunks' at that depth (`ratios[B]`, one per depth of `depths`; linear between
    depths, the nearest past either end). A batch of chunks at depths d1 .. dB costs the sum of
    `chunk(d_i) * ratio(B, d_i)`: the row-wise work is shared, each session's attention and
    recurrence its own. A size not measured takes the largest measured size below it.

    `run_ratios[B]`, where measured: the same for a chunk in a run (one session's next chunks in
    the batch, its GDN layers reading them as one sequence): a run of B chunks from a depth, over
    the single chunks at its chunks' own depths (linear between the depths measured); without
    them a run's chunk costs what any batched chunk does."""

    depths: tuple[int, ...]
    ratios: dict[int, tuple[float, ...]]
    label: str
    run_ratios: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.depths or list(self.depths) != sorted(set(self.depths)) or min(self.depths) < 0:
            raise ValueError("a batch table needs rising depths")
        # a batch over 1.5 times its chunks alone is no measurement of a batch; a run may be read
        # entry after entry (the reference kernels read a run's chunks one after another)
        for kind, table, most in (("batch", self.ratios, 1.5), ("run", self.run_ratios, 3.0)):
            for size, ratios in table.items():
                if size < 2 or len(ratios) != len(self.depths):
                    raise ValueError(f"a {kind} table has sizes of 2 or more, one ratio a depth each")
                if any(not math.isfinite(r) or not 0 < r <= most for r in ratios):
                    raise ValueError(f"a {kind} of {size}'s ratios are positive (at most {most:g}: slower than its chunks alone)")

    @classmethod
    def measured(cls, ms: dict[int, dict[int, float]], label: str, runs: dict[int, dict[int, float]] | None = None,
                 grid: int = 512) -> BatchTable:
        """From ms of one batched read by depth, then batch size (size 1 at every depth); and of one
        session's run of B chunks from each depth (`runs`, the same depths and sizes, or none)."""
        depths = tuple(sorted(ms))
        if any(1 not in ms[d] or ms[d][1] <= 0 for d in depths):
            raise ValueError("every depth needs its single chunk's time (batch size 1)")
        sizes = sorted({b for d in depths for b in ms[d] if b > 1})
        missing = [(d, b) for d in depths for b in sizes if b not in ms[d]]
        if missing:
            raise ValueError(f"batch sizes measured at some depths only (e.g. {missing[0][1]} at depth {missing[0][0]})")
        ratios = {b: tuple(ms[d][b] / (b * ms[d][1]) for d in depths) for b in sizes}
        run_ratios = {}
        if runs:
            if sorted(runs) != list(depths) or any(sorted(runs[d]) != sizes for d in depths):
                raise ValueError("runs measured at other depths or sizes than the batches")
            singles = ChunkTable(depths, tuple(ms[d][1] / 1000 for d in depths), label)
            run_ratios = {b: tuple(runs[d][b] / 1000 / sum(singles(d + k * grid) for k in range(b)) for d in depths)
                          for b in sizes}
        return cls(depths, ratios, label, run_ratios)

    @classmethod
    def h200(cls) -> BatchTable:
        return cls.measured(H200_BATCH_MS, "H200 batches")

    @classmethod
    def from_read_rate(cls, doc: dict, grid: int, label: str) -> BatchTable | None:
        """A `shadow read-rate --batches ... --json` document's `batch_rows` at `grid` (of its own
        model and kernels); None where it has none at that grid. ValueError for rows it cannot use."""
        rows = doc.get("batch_rows")
        if not rows:
            return None
        if not isinstance(rows, list):
            raise ValueError("its batch_rows are not a list")
        ms: dict[int, dict[int, float]] = {}
        runs: dict[int, dict[int, float]] = {}
        for row in rows:
            if not isinstance(row, dict) or row.get("grid", grid) != grid:
                continue
            if any(row.get(k, doc.get(k)) != doc.get(k) for k in ("model", "kernels")):
                continue
            if not isinstance(row.get("run", False), bool):
                raise ValueError(f"a batch row's run is true or false ({row})")
            (runs if row.get("run") else ms).setdefault(int(row["context"]), {})[int(row["batch"])] = float(row["ms_per_read"])
        if not ms:
            return None  # batches measured at another grid only
        return cls.measured(ms, label, runs or None, grid)

    def ratio(self, size: int, depth: int, run: bool = False) -> float:
        """A chunk at `depth` in a batched read of `size` (`run`: a chunk of a run, where measured)."""
        table = self.run_ratios if run and self.run_ratios else self.ratios
        sizes = [b for b in sorted(table) if b <= size]
        if size <= 1 or not sizes:
            return 1.0
        ratios = table[sizes[-1]]  # (readers batch in graphed sizes, 2, 4, 8: `graphed_batch`)
        i = bisect.bisect_right(self.depths, depth)
        if i == 0:
            return ratios[0]
        if i == len(self.depths):
            return ratios[-1]
        lo, hi = self.depths[i - 1], self.depths[i]
        return ratios[i - 1] + (ratios[i] - ratios[i - 1]) * (depth - lo) / (hi - lo)


@dataclass(frozen=True)
class CostTable:
    """The device's costs the replay charges: `chunk` by depth; restores and spills at `restore_gib_s`
    and `spill_gib_s` of their file's bytes; moves to and from the host tier at `host_gib_s`; an ask's forward `ask_s`; one voice phrase `phrase_s`;
    the proxy's tokenisation of a prompt, `tokenize_s_per_1k` seconds per 1,000 ids; a batched
    read, `batch_s`; an ask's chunks at `ask_chunk_scale` times `chunk` (1: the same; a live run's
    measured ratio where its asks' reads met another share of the engine's work than the share's
    did); `charge`, where given, the costs a share read is charged at most (as `serve --share-charge
    alone` keeps them at load: a live run's, beside its learned `chunk`), else its modelled seconds;
    `ask_samples`, where given, an ask's forward as a live run measured them (seconds), each ask
    drawing one (seeded), else `ask_s` for every ask; `host_rates`, where given, the GiB/s of moves
    back from the host tier as a live run measured them, each move back drawing one (`host_back_s`),
    else `host_gib_s`. The defaults are the H200's and this CPU's measurements above."""

    chunk: ChunkTable
    restore_gib_s: float = H200_RESTORE_GIB_S
    spill_gib_s: float = H200_SPILL_GIB_S
    host_gib_s: float = GPU_HOST_GIB_S
    ask_s: float = H200_ASK_MS / 1000
    phrase_s: float = H200_PHRASE_MS / 1000
    tokenize_s_per_1k: float = CPU_TOKENIZE_MS_PER_1K / 1000
    batch: BatchTable = field(default_factory=BatchTable.h200)  # what a chunk costs in a batched read
    ask_chunk_scale: float = 1.0
    charge: KnownCosts | None = None
    ask_samples: tuple[float, ...] = ()
    host_rates: tuple[float, ...] = ()

    def batch_s(self, depths: list[int], runs: list[bool] | None = None) -> float:
        """Seconds of one batched read of one chunk at each of `depths` (`runs`: whether each is
        a chunk of a run, a session with several chunks in the batch)."""
        runs = runs or [False] * len(depths)
        return sum(self.chunk(d) * self.batch.ratio(len(depths), d, run) for d, run in zip(depths, runs))

    def restore_s(self, nbytes: int) -> float:
        return nbytes / GIB / self.restore_gib_s if math.isfinite(self.restore_gib_s) else 0.0

    def host_s(self, nbytes: int) -> float:
        """Seconds of one move of `nbytes` to or from the host tier."""
        return nbytes / GIB / self.host_gib_s if math.isfinite(self.host_gib_s) else 0.0

    def host_back_s(self, nbytes: int, draws: random.Random) -> float:
        """Seconds of one move of `nbytes` back from the host tier: at a speed drawn from
        `host_rates` where given (from `draws`), else as `host_s`."""
        if not self.host_rates:
            return self.host_s(nbytes)
        return nbytes / GIB / draws.choice(self.host_rates)

    def spill_s(self, nbytes: int) -> float:
        return nbytes / GIB / self.spill_gib_s if math.isfinite(self.spill_gib_s) else 0.0

    def tokenize_s(self, tokens: int) -> float:
        return tokens / 1000 * self.tokenize_s_per_1k


class ReadTime:
    """Seconds to read chunks k .. m of a session (chunk j's first row at depth j * grid), from a
    chunk table (or any function of a chunk's depth): prefix sums, grown as deeper chunks are asked
    for (O(1) a question)."""

    def __init__(self, chunk: Callable[[int], float], grid: int):
        self.chunk, self.grid = chunk, grid
        self._sum = [0.0]

    def __call__(self, first: int, end: int) -> float:
        """Seconds of chunks first .. end - 1."""
        while len(self._sum) <= end:
            self._sum.append(self._sum[-1] + self.chunk((len(self._sum) - 1) * self.grid))
        return self._sum[end] - self._sum[first] if end > first else 0.0
