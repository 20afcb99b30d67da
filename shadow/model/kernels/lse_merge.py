"""Attention computed in parts over a session's key rows, merged by each part's log-sum-exp.

A chunk's rows over its session's cached rows can be attended in parts (slices of the cached rows,
then the tail: the rows left and the chunk's own, under the causal mask), each part giving its
normalised output and its log-sum-exp, as FlashAttention-style kernels return them; this merges
them into the rows' attention. A row's parts are weighed by exp(lse - max) and summed in part
order (its slices in order, then its tail), in float32, by one program a (row, head): a session's
rows get the same bits whatever the other sessions in the call. `split_rows` cuts a session's
cached rows by its own depth alone, so a session's parts, and so its bits, are the same alone or
in a batch.

Not yet in a kernel set: the parts come from a kernel this module does not call (the survey in
`experiments/attention_kernels.py` calls FlashAttention-4). `merge_parts_reference` is the plain
torch form, tested against the Triton one.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


def split_rows(cached: int, t: int, slices: int = 4, least: int = 4096) -> tuple[int, int]:
    """(rows a slice, slices) for a session with `cached` rows before its chunk of `t` rows: at most
    `slices` equal slices of whole chunks of `t` rows, at least `least` rows each (none under that),
    the rows left (fewer than a slice) to the tail. A pure function of its arguments (the session's
    own depth)."""
    if cached < 0 or t < 1 or slices < 1 or least < 1:
        raise ValueError("split_rows needs cached >= 0 and positive t, slices and least")
    per = max(-(-least // t), -(-cached // (slices * t))) * t
    return per, cached // per


@triton.jit
def _merge(o_sl, lse_sl, o_tail, lse_tail, out, sessions, T, sl_rows, tail_rows, D: tl.constexpr):
    """One (row, head): its session's slices, then its tail, weighed by exp(lse - max), summed in
    that order. o_*: [rows, heads, D]; lse_*: [heads, rows]; sessions: [B, 2] int32 (first slice,
    slice count)."""
    row, h = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(1)
    b, t = row // T, row % T
    first = tl.load(sessions + 2 * b)
    count = tl.load(sessions + 2 * b + 1)
    tail_lse = tl.load(lse_tail + h * tail_rows + row)
    top = tail_lse  # finite: the tail holds the chunk's own rows, and a row sees itself
    for j in range(0, count):
        top = tl.maximum(top, tl.load(lse_sl + h * sl_rows + (first + j) * T + t))
    d = tl.arange(0, D)
    total = 0.0
    acc = tl.zeros([D], tl.float32)
    for j in range(0, count):
        r = (first + j) * T + t
        w = tl.exp(tl.load(lse_sl + h * sl_rows + r) - top)
        total += w
        acc += w * tl.load(o_sl + (r.to(tl.int64) * heads + h) * D + d).to(tl.float32)  # int64: rows x heads x D may pass 2^31
    w = tl.exp(tail_lse - top)
    total += w
    at = (row.to(tl.int64) * heads + h) * D + d
    acc += w * tl.load(o_tail + at).to(tl.float32)
    tl.store(out + at, (acc / total).to(out.dtype.element_ty))


@dataclasses.dataclass(frozen=True)
class MergeTable:
    """The sessions' table `merge_parts` reads, for these slice counts: [B, 2] int32 (first slice,
    slice count) on one device. Made once beforehand where the merge is captured in a CUDA graph
    (a copy from host memory cannot be captured)."""

    counts: tuple[int, ...]
    tensor: torch.Tensor


def merge_table(counts: list[int], device: torch.device | str) -> MergeTable:
    """The `MergeTable` of `counts` (each a whole number >= 0) on `device`."""
    _check_counts(counts)
    firsts = [sum(counts[:b]) for b in range(len(counts))]
    tensor = torch.tensor([[f, c] for f, c in zip(firsts, counts)], dtype=torch.int32).to(device)
    return MergeTable(tuple(counts), tensor)


def _check_counts(counts) -> None:
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"slice counts are whole numbers >= 0, one a session, not {counts!r}")


def _check(o_slices, lse_slices, o_tail, lse_tail, counts, t):
    _check_counts(counts)
    if o_tail.dim() != 3 or not o_tail.is_floating_point():
        raise ValueError("the tails must be [B*T, H, D] of a floating type")
    rows, heads, d = o_tail.shape
    if t < 1 or rows != t * len(counts) or lse_tail.shape != (heads, rows):
        raise ValueError("the tails must be [B*T, H, D] with their log-sum-exp [H, B*T]")
    if o_slices.shape != (t * sum(counts), heads, d) or lse_slices.shape != (heads, o_slices.shape[0]):
        raise ValueError("the slices must be [T * slices, H, D] with their log-sum-exp [H, T * slices]")
    if d < 1 or d & (d - 1):
        raise ValueError("the head width must be a power of two")
    if o_slices.dtype != o_tail.dtype or lse_slices.dtype != torch.float32 or lse_tail.dtype != torch.float32:
        raise ValueError("the slices must have the tails' dtype, and every log-sum-exp float32")
    for x in (o_slices, lse_slices, o_tail, lse_tail):
        if not x.is_contiguous() or x.device != o_tail.device:
            raise ValueError("the parts and their log-sum-exp must be contiguous, on one device")


def merge_parts(o_slices: torch.Tensor, lse_slices: torch.Tensor, o_tail: torch.Tensor, lse_tail: torch.Tensor,
                counts: list[int], t: int, out: torch.Tensor | None = None, table: MergeTable | None = None) -> torch.Tensor:
    """B sessions' chunks of `t` rows from their parts: session b's `counts[b]` slices, stacked in
    session order in `o_slices` [T * sum(counts), H, D] (slice after slice, T rows each) with their
    log-sum-exp `lse_slices` [H, T * sum(counts)] (natural log, float32), and its tail, rows b*T ..
    of `o_tail` [B*T, H, D] with `lse_tail` [H, B*T]. Returns [B*T, H, D] in o_tail's dtype (into
    `out` where given, contiguous). `table`: `merge_table(counts)` made beforehand (for a CUDA
    graph); else made here. Bad input raises ValueError before anything is written."""
    _check(o_slices, lse_slices, o_tail, lse_tail, counts, t)
    if table is None:
        table = merge_table(counts, o_tail.device)
    elif table.counts != tuple(counts) or table.tensor.device != o_tail.device:
        raise ValueError("the merge table was made for other slice counts or another device")
    rows, heads, d = o_tail.shape
    if out is None:
        out = torch.empty_like(o_tail)
    elif out.shape != o_tail.shape or not out.is_contiguous() or out.dtype != o_tail.dtype or out.device != o_tail.device:
        raise ValueError("out must be [B*T, H, D] contiguous in the tails' dtype, on their device")
    if not sum(counts):  # no slice anywhere: the tails stand in for them (never read)
        o_slices, lse_slices = o_tail, lse_tail
    _merge[(rows, heads)](o_slices, lse_slices, o_tail, lse_tail, out, table.tensor, t, lse_slices.shape[1], rows, D=d)
    return out


def merge_parts_reference(o_slices: torch.Tensor, lse_slices: torch.Tensor, o_tail: torch.Tensor,
                          lse_tail: torch.Tensor, counts: list[int], t: int) -> torch.Tensor:
    """`merge_parts`'s contract in plain torch ops (float32 softmax of the parts' log-sum-exp)."""
    _check(o_slices, lse_slices, o_tail, lse_tail, counts, t)
    out, first = [], 0
    for b, count in enumerate(counts):
        rows = slice(first * t, (first + count) * t)
        o = torch.cat([o_slices[rows].unflatten(0, (count, t)), o_tail[b * t : (b + 1) * t][None]]).float()
        lse = torch.cat([lse_slices[:, rows].unflatten(1, (count, t)), lse_tail[:, b * t : (b + 1) * t][:, None]], 1)
        weight = torch.softmax(lse.permute(1, 2, 0), dim=0)  # [parts, T, H]
        out.append((weight[..., None] * o).sum(0))
        first += count
    return torch.cat(out).to(o_tail.dtype)
