"""The forward split at its attention layers, each piece one CUDA graph per row count.

A session's KV buffer is its own and moves when it grows, so attention (the KV write and the
attention over the valid rows) runs eagerly between the pieces; everything else (embedding,
the GDN layers, MLPs, norms, projections) replays from graphs that read and write static
buffers. The GDN state is copied into the static buffers before a call and back after it
(two copies each way: both sides hold it in a `DeltaArena`).

The arithmetic is the model's own (the same steps as `Qwen35.forward`, `model.steps`), so with
graphs off the pieces give the same bits as the plain forward; tests check that on the CPU.

Several chunks read at once (`forward_batch`, B entries of T rows, a session's consecutive
entries its next chunks: `layout.Layout`) run the same pieces on their stacked rows, one state
slot an entry, and each entry's attention on its session's buffer between the pieces; a (B, T)
in `batches` x `sizes` gets graphs of its own, which serve every layout of B entries where the
steps read the layout as device tensors (`FusedSteps.batched_rule`), else the layout of B
sessions of one entry each (others run eagerly).

A forward can be run a piece at a time (`passes`): between two pieces nothing else may read or
change its sessions or run the same plan, and the states are whole again only at its end.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable

import torch

from shadow.model.layout import Layout, LayoutTensors
from shadow.model.qwen35 import Qwen35, attend_each, entry_starts
from shadow.model.state import DeltaArena, ModelState


EAGER_PLANS = 4  # eager (ungraphed) plans kept for reuse


class _Plan:
    """Static buffers (and graphs, once captured) for B entries' chunks of T rows each."""

    def __init__(self, model: Qwen35, t: int, b: int = 1):
        c, dev, dtype = model.config, model.device, model.dtype
        self.t, self.b = t, b
        self.ids = torch.zeros(b * t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b * t, dtype=torch.long, device=dev)
        # what piece p hands on, set by the piece: q, k, v (read by the attention after it), the
        # gate and x (read by piece p + 1); under a graph these are tensors of its pool that every
        # replay rewrites in place, so each piece keeps its own. `out`: the last piece's rows.
        self.handoff: dict[int, tuple[torch.Tensor, ...]] = {}
        self.out: torch.Tensor | None = None
        self.attended = torch.zeros(b * t, c.num_attention_heads, c.head_dim, dtype=dtype, device=dev)
        self.rope: tuple[torch.Tensor, ...] | None = None  # the chunk's rope tables, set by piece 0
        self.arenas = [DeltaArena(c, dtype, dev) for _ in range(b)]  # one slot an entry, in batch order
        self.layout = LayoutTensors(b, t, dev) if b > 1 else None  # which entries are one session's
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        self.busy = False  # a forward of it is under way (`passes`)


class PiecewiseForward:
    """Callable like the model: `(ids [T], state) -> hidden [T, hidden]`, advancing the state.

    Row counts in `sizes` get CUDA graphs (captured on first use, when `graphs` is on), and so do
    batches of `batches` entries of such chunks (`forward_batch`); others run the same pieces
    eagerly.
    """

    def __init__(self, model: Qwen35, sizes: Iterable[int] = (), graphs: bool | None = None,
                 batches: Iterable[int] = ()):
        self.model = model
        self.sizes = set(sizes)
        self.batches = {1, *batches}
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        self.attention_layers = model.config.attention_layers
        self._delta_index = {layer: j for j, layer in enumerate(model.config.linear_layers)}
        self._plans: dict[tuple, _Plan] = {}
        self._eager: list[tuple] = []  # eager plans' keys, oldest first
        self._pool = None

    @property
    def pieces(self) -> int:
        """Pieces a forward runs in (`passes` yields between them)."""
        return len(self.attention_layers) + 1

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, state: ModelState) -> torch.Tensor:
        return self.forward_batch(ids, [state])

    @torch.no_grad()
    def forward_batch(self, ids: torch.Tensor, states: list[ModelState]) -> torch.Tensor:
        """`Qwen35.forward_batch`'s contract: B entries of T ids each, stacked, in `states`' order
        (a state named by consecutive entries reads them as its next chunks)."""
        steps = self.passes(ids, states)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.no_grad()
    def passes(self, ids: torch.Tensor, states: list[ModelState]) -> Generator[None, None, torch.Tensor]:
        """`forward_batch` a piece at a time: yields after each piece but the last, returns the
        hidden rows. Until it returns, its sessions are half read (nothing else may read, fork or
        change them) and its plan is taken; closing it early leaves them so: finish it instead."""
        b = len(states)
        t = ids.shape[0] // b
        starts = entry_starts(states, t)
        layout = Layout.of(states)
        plan = self._plan(t, b, layout)
        if plan.busy:
            raise RuntimeError("a forward of this batch shape is under way: finish it first")
        plan.busy = True
        try:
            return (yield from self._run(plan, ids, states, starts, layout))
        finally:
            plan.busy = False

    def _run(self, plan: _Plan, ids: torch.Tensor, states: list[ModelState], starts: list[int],
             layout: Layout) -> Generator[None, None, torch.Tensor]:
        t = plan.t
        plan.ids.copy_(ids, non_blocking=True)
        if plan.b == 1:
            torch.arange(starts[0], starts[0] + t, out=plan.positions)
        else:
            for j, start in enumerate(starts):
                torch.arange(start, start + t, out=plan.positions[j * t : (j + 1) * t])
            plan.layout.set(layout)
        homes = [(first, states[first]) for first, _ in layout.firsts_and_runs]
        for first, state in homes:
            plan.arenas[first].copy_(state.arena)
        for piece in range(self.pieces):
            if piece:
                yield
            if plan.graphs is not None:
                plan.graphs[piece].replay()
            else:
                self._piece(plan, piece)
            if piece < len(self.attention_layers):
                layer = self.attention_layers[piece]
                q, k, v = plan.handoff[piece][:3]
                attend_each([s.layers[layer] for s in states], starts, q, k, v, self.model.kernels, out=plan.attended)
        for first, state in homes:
            state.arena.copy_(plan.arenas[first])
        for state, start in zip(states, starts):  # a session's last entry sets its length
            state.length = start + t
        return plan.out.clone()

    def _plan(self, t: int, b: int = 1, layout: Layout | None = None) -> _Plan:
        """The plan for (b, t), or for a layout the steps cannot read as device tensors, of that
        layout (never graphed: its graphs would serve that layout alone). Kept for good where it
        is graphed; an eager one only among the last `EAGER_PLANS` (each holds GDN state slots:
        one for every length met would grow without end)."""
        key: tuple = (b, t)
        if layout is not None and layout.mixed and not self._layout_on_device(b, t):
            key = (b, t, layout.runs)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self.model, t, b)
            if self.graphs and t in self.sizes and b in self.batches and len(key) == 2:
                self._capture(plan)
            else:
                self._eager.append(key)
                if len(self._eager) > EAGER_PLANS:
                    del self._plans[self._eager.pop(0)]
        return plan

    def _layout_on_device(self, b: int, t: int) -> bool:
        """Whether the steps read a layout of b entries of t rows only as device tensors."""
        batched_rule = getattr(self.model.steps, "batched_rule", None)
        return batched_rule is not None and batched_rule(b * t, b)

    def _piece(self, plan: _Plan, piece: int) -> None:
        """Layers from after attention layer `piece - 1` up to attention layer `piece`'s projections."""
        steps, bounds = self.model.steps, self.attention_layers
        if piece == 0:
            x, first = steps.embed(plan.ids), 0
            rope = steps.rope(plan.positions)
            if plan.rope is None:
                plan.rope = tuple(r.clone() for r in rope)
            else:
                for buf, val in zip(plan.rope, rope):
                    buf.copy_(val)
        else:
            gate, x = plan.handoff[piece - 1][3:]
            x = steps.attention_out(bounds[piece - 1], x, plan.attended, gate)
            first = bounds[piece - 1] + 1
        last = bounds[piece] if piece < len(bounds) else len(self.model.layers)
        for i in range(first, last):
            j = self._delta_index[i]
            slots = [arena.layers[j] for arena in plan.arenas]
            x = steps.gdn(i, x, slots, plan.layout) if plan.layout is not None else steps.gdn(i, x, slots)
        if piece < len(bounds):
            plan.handoff[piece] = (*steps.attention_in(last, x, plan.rope), x)
        else:
            plan.out = steps.final(x)

    def _capture(self, plan: _Plan) -> None:
        """Warm each piece up on a side stream (Triton autotunes there), then capture it."""
        pieces = range(self.pieces)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                for piece in pieces:
                    self._piece(plan, piece)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), torch.no_grad():
                self._piece(plan, piece)
            graphs.append(graph)
        plan.graphs = graphs
