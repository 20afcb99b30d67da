"""What the resident cap keeps, without tensors: a session's bytes from the model's shapes, which
sessions leave memory when a settle finds the cap passed, and how fast restores run.

The store (`store.SessionStore`) applies these rules to real sessions and the ledger replay to
modelled ones, so the two keep, spill and drop the same sessions at the same settles.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

from shadow.core.blockio import ALIGN
from shadow.model.config import ModelConfig
from shadow.model.state import KV_STEP

GIB = 1 << 30
# the host tier's bound a shadow on a GPU gets unless told otherwise, for the live service and its
# replay alike: 32 GiB holds some 36 sessions of 58k tokens of the 0.8B (0.88 GiB each)
HOST_CAP_GIB = 32.0
# on a GPU the store keeps this much host memory pinned and free ahead of the next moves out, pinned on
# a thread of its own within the host tier's and staging's bounds; at or past those bounds, all of it
# is pinned when the store starts and none while it serves
PIN_AHEAD_GIB = 2.0
# the resident cap a shadow gets unless told otherwise, beside an engine (proxy mode) and on the CPU,
# for the live service and its replay alike: four 58k sessions of the 0.8B (0.88 GiB each) and room
CAP_GIB = 4.0
# an embedded shadow on a GPU sizes its cap from the device memory free once the generator is loaded
# (`embedded_cap_gib`): this share of what its requests leave, less this headroom, at least the floor
EMBEDDED_SHARE = 0.8
EMBEDDED_HEADROOM_GIB = 1.0
EMBEDDED_FLOOR_GIB = 0.5


def embedded_cap_gib(free_bytes: int, generator_bytes: int, other_bytes: int = 0) -> float:
    """The resident cap of an embedded shadow on a GPU, GiB: `EMBEDDED_SHARE` of the device memory
    free once the generator is loaded (`free_bytes`) less what the generator's requests may hold at
    most (`generator_bytes`: their states at their longest) and the shadow's other device memory
    (`other_bytes`: the prefix cache's bound), less `EMBEDDED_HEADROOM_GIB` (activations, graphs,
    moves in flight); at least `EMBEDDED_FLOOR_GIB`."""
    left = EMBEDDED_SHARE * (free_bytes - generator_bytes - other_bytes) / GIB - EMBEDDED_HEADROOM_GIB
    return max(EMBEDDED_FLOOR_GIB, left)


@dataclass(frozen=True)
class StateSize:
    """Bytes of one session's state for a model: `kv_row` per KV row (K and V of every attention
    layer), `delta` for the GDN conv and recurrent state, `checkpoint` per checkpoint."""

    kv_row: int
    delta: int
    checkpoint: int
    kv_step: int = KV_STEP

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int = 2) -> StateSize:
        """The sizes `ModelState` allocates for `config` in a model dtype of `dtype_bytes` (the
        recurrent state is float32 whatever the dtype)."""
        attention, delta = len(config.attention_layers), len(config.linear_layers)
        kv_row = attention * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
        conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes
        recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        return cls(kv_row, delta * (conv + recurrent), delta * (conv + recurrent))

    def capacity(self, rows: int) -> int:
        """KV rows a buffer holding `rows` rows has room for."""
        return -(-rows // self.kv_step) * self.kv_step

    def resident(self, capacity: int, checkpoints: int) -> int:
        """Bytes a resident session holds (`store.session_bytes`): KV buffers at `capacity` rows,
        GDN state, checkpoints."""
        return self.kv_row * capacity + self.delta + self.checkpoint * checkpoints

    def host(self, committed: int, tokens: int, checkpoints: int) -> int:
        """Bytes of the session's copy in the host tier (`hosttier.host_bytes`): its valid rows,
        GDN state, checkpoints and ids."""
        return 8 * tokens + self.kv_row * committed + self.delta + self.checkpoint * checkpoints

    def file(self, committed: int, tokens: int, checkpoints: int) -> int:
        """About the bytes of the session's file (`sessionfile.file_bytes`): what a restore reads."""
        return 8 * tokens + self.kv_row * committed + self.delta + self.checkpoint * checkpoints + ALIGN


class Settle:
    """One settle's plan. `sizes`: (session, bytes) of the resident sessions, least recently used
    first. Iterating yields (session, bytes) to move out of memory, in that order, while the total
    is over `cap`, passing over `keep` and the names in `skip`; the caller says `left(bytes)` for
    each one that did leave (one whose write failed stays, and the total with it)."""

    def __init__(self, sizes: Sequence[tuple[str, int]], cap: int, keep: str | None = None,
                 skip: Container[str] = ()):
        self.sizes, self.cap, self.keep, self.skip = list(sizes), cap, keep, skip
        self.total = sum(b for _, b in self.sizes)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for name, size in self.sizes:
            if self.total <= self.cap:
                return
            if name == self.keep or name in self.skip:
                continue
            yield name, size

    def left(self, size: int) -> None:
        self.total -= size


class RestoreRate:
    """The store's restore speed, bytes per second: sums of bytes and seconds of its restores
    (each restore weighs by its size), older ones decayed by `decay` at each new one, so the rate
    follows the machine; `warm` sets it outright (a measurement). None until it has one."""

    def __init__(self, decay: float = 0.7):
        self.decay = decay
        self._bytes = self._seconds = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            self._bytes = self._bytes * self.decay + nbytes
            self._seconds = self._seconds * self.decay + seconds

    def warm(self, gib_per_s: float) -> None:
        if gib_per_s > 0:
            self._bytes, self._seconds = gib_per_s * GIB, 1.0

    @property
    def gib_per_s(self) -> float | None:
        return self._bytes / GIB / self._seconds if self._seconds else None

    def seconds(self, nbytes: int) -> float | None:
        """The estimated seconds to restore a file of `nbytes`."""
        return nbytes * self._seconds / self._bytes if self._bytes else None
