"""Per-session model state: attention KV rows and Gated DeltaNet conv and recurrent state.

One small object per layer, as in mlx-lm's cache protocol. The forward writes into these objects
in place (fixed addresses, so a CUDA graph can hold them); nothing lives on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shadow.model.config import ModelConfig

KV_STEP = 8192  # the KV buffer grows in steps of this many rows


class AttentionState:
    """KV rows of one attention layer: k, v are [kv_heads, capacity, head_dim]; rows >= length are junk."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows, growing in steps of KV_STEP; rows already held keep their bits."""
        if rows <= self.capacity:
            return
        capacity = -(-rows // KV_STEP) * KV_STEP
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([kv_heads, T, head_dim]) at rows start .. start+T."""
        self.reserve(start + k.shape[1])
        self.k[:, start : start + k.shape[1]] = k
        self.v[:, start : start + v.shape[1]] = v

    def nbytes(self, length: int) -> int:
        return 2 * self.k[:, :length].numel() * self.k.element_size()


class DeltaState:
    """Gated DeltaNet state of one layer: conv [conv_dim, K-1] (model dtype), recurrent [H, Dk, Dv]
    float32; views into a `DeltaArena`, written in place by the forward."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor):
        self.conv, self.recurrent = conv, recurrent

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


class DeltaArena:
    """Every GDN layer's state in two tensors, conv [n, conv_dim, K-1] (model dtype) and recurrent
    [n, H, Dk, Dv] float32, with one `DeltaState` of views per layer (`layers`): copying the whole
    GDN state of a session is two copies, not two per layer. The forward writes the views in place."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        c, n = config, len(config.linear_layers)
        self.conv = torch.zeros(n, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(
            n, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            dtype=torch.float32, device=device,
        )
        self.layers = [DeltaState(self.conv[j], self.recurrent[j]) for j in range(n)]

    def copy_(self, other: DeltaArena) -> None:
        """Take `other`'s values (same config, dtype)."""
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)


@dataclass
class DeltaSnapshot:
    """A copy of every GDN layer's conv and recurrent state at `position` (a checkpoint, or a fork's
    return point), shaped like a `DeltaArena`: conv [n, conv_dim, K-1], recurrent [n, H, Dk, Dv]
    (iterating either gives the layers in order); restoring it is two copies."""

    position: int
    conv: torch.Tensor
    recurrent: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


class ModelState:
    """The whole state of one session: `layers[i]` matches layer i's kind; `length` rows are valid.
    While a fork is open (`Reader.fork`), `length` counts the fork's rows too and `fork_base` holds
    the length it began at: what the session has read, for every other thread."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.config = config
        self.device = device
        self.length = 0
        self.fork_base: int | None = None  # while a fork is open on this state: its length when it began
        self.arena = DeltaArena(config, dtype, device)
        delta = iter(self.arena.layers)
        self.layers: list[AttentionState | DeltaState] = [
            AttentionState(config.num_key_value_heads, config.head_dim, dtype, device)
            if kind == "full_attention"
            else next(delta)
            for kind in config.layer_types
        ]

    @property
    def attention(self) -> list[AttentionState]:
        return [s for s in self.layers if isinstance(s, AttentionState)]

    @property
    def delta(self) -> list[DeltaState]:
        return [s for s in self.layers if isinstance(s, DeltaState)]

    def nbytes(self) -> int:
        """Bytes of the valid state: KV rows up to length, GDN state."""
        return sum(a.nbytes(self.length) for a in self.attention) + sum(d.nbytes() for d in self.delta)

    def allocated_bytes(self) -> int:
        """Bytes held: the KV buffers at their capacity, GDN state."""
        return sum(a.nbytes(a.capacity) for a in self.attention) + sum(d.nbytes() for d in self.delta)

    def snapshot(self) -> DeltaSnapshot:
        """Copy the GDN state at the current length (KV rows need no copy: rows below a cut stay valid)."""
        return DeltaSnapshot(self.length, self.arena.conv.clone(), self.arena.recurrent.clone())

    def restore(self, snap: DeltaSnapshot) -> None:
        """Go back to `snap`: its GDN state is copied in place and the KV rows above it are dropped."""
        if snap.position > self.length:
            raise ValueError(f"snapshot at {snap.position} is past the state's length {self.length}")
        self.arena.conv.copy_(snap.conv)
        self.arena.recurrent.copy_(snap.recurrent)
        self.length = snap.position

    # the state's tensors by name: what compare, save and load agree on ---------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state, KV cut to the valid rows, by a stable name (for compare and save)."""
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, AttentionState):
                out[f"layers.{i}.k"] = layer.k[:, : self.length]
                out[f"layers.{i}.v"] = layer.v[:, : self.length]
            else:
                out[f"layers.{i}.conv"] = layer.conv
                out[f"layers.{i}.recurrent"] = layer.recurrent
        return out


    def expected(self, length: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The dtype and shape of every tensor `tensors()` gives for a state of this model at
        `length` valid rows: what a saved state must hold to be loaded into this one."""
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, AttentionState):
                out[f"layers.{i}.k"] = out[f"layers.{i}.v"] = (
                    layer.k.dtype, (layer.k.shape[0], length, layer.k.shape[2]))
            else:
                out[f"layers.{i}.conv"] = (layer.conv.dtype, tuple(layer.conv.shape))
                out[f"layers.{i}.recurrent"] = (layer.recurrent.dtype, tuple(layer.recurrent.shape))
        return out

    def load(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Take the values of `tensors` (named and shaped as `expected(length)` says; the caller
        checked that), copied onto this state's device; `length` rows become valid."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, AttentionState):
                layer.write(0, tensors[f"layers.{i}.k"].to(self.device), tensors[f"layers.{i}.v"].to(self.device))
            else:
                layer.conv.copy_(tensors[f"layers.{i}.conv"])
                layer.recurrent.copy_(tensors[f"layers.{i}.recurrent"])
        self.length = length

    # checkpoints (snapshots) by name, the same way ------------------------------------------

    def snapshot_tensors(self, snaps: list[DeltaSnapshot]) -> dict[str, torch.Tensor]:
        """Every tensor of `snaps` (checkpoints of this state, oldest first) by a stable name."""
        return snapshot_tensors(snaps)

    def expected_snapshots(self, count: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The dtype and shape of every tensor `snapshot_tensors` gives for `count` snapshots."""
        arena, out = self.arena, {}
        for j in range(count):
            for i in range(arena.conv.shape[0]):
                out[f"checkpoints.{j}.{i}.conv"] = (arena.conv.dtype, tuple(arena.conv.shape[1:]))
                out[f"checkpoints.{j}.{i}.recurrent"] = (arena.recurrent.dtype, tuple(arena.recurrent.shape[1:]))
        return out

    def load_snapshots(self, tensors: dict[str, torch.Tensor], positions: list[int]) -> list[DeltaSnapshot]:
        """The snapshots at `positions` from `tensors` (named as `snapshot_tensors` names them), on
        this state's device."""
        n = self.arena.conv.shape[0]
        return [
            DeltaSnapshot(
                p,
                torch.stack([tensors[f"checkpoints.{j}.{i}.conv"] for i in range(n)]).to(self.device),
                torch.stack([tensors[f"checkpoints.{j}.{i}.recurrent"] for i in range(n)]).to(self.device),
            )
            for j, p in enumerate(positions)
        ]


def snapshot_tensors(snaps: list[DeltaSnapshot]) -> dict[str, torch.Tensor]:
    """Every tensor of `snaps` (a session's checkpoints, oldest first) by a stable name."""
    out = {}
    for j, snap in enumerate(snaps):
        for i, (conv, rec) in enumerate(zip(snap.conv, snap.recurrent)):
            out[f"checkpoints.{j}.{i}.conv"] = conv
            out[f"checkpoints.{j}.{i}.recurrent"] = rec
    return out


def tensor_kind(name: str) -> str:
    """The kind of a state tensor from its name: "k", "v", "conv" or "recurrent"."""
    return name.rsplit(".", 1)[-1]
