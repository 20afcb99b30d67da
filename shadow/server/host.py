"""The host of the shadow's model: loads it (its reader and store), hands out one handle to it
(`Shadow`), and lets it go after an idle burst.

Work takes the handle once (`host.shadow`) and uses that handle's reader and store throughout: an
unload meanwhile drops the host's reference, never the objects a job holds, so no job ever finds
a reader without its store, or None, halfway through. Loads and unloads run on the device thread,
between other jobs; `on_load` runs there first (the read scheduler's estimates are measured, the
voice made), before the handle is handed out.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shadow.core.reader import Reader
from shadow.core.store import SessionStore
from shadow.errors import ShadowUnavailable
from shadow.server import gcpauses
from shadow.server.device import DeviceThread

log = logging.getLogger("shadow.serve")


@dataclass(frozen=True)
class Shadow:
    """The loaded shadow: its reader, its store, the weights' label."""

    reader: Reader
    store: SessionStore
    weights: str

    @property
    def grid(self) -> int:
        return self.reader.grid

    @property
    def weights_hash(self) -> str:
        return self.store.identity.weights_hash


Loader = Callable[[], Shadow]


class ModelHost:
    """Holds the shadow: `source` is the shadow itself (handed out by `begin`: embedded mode, tests)
    or a function that loads it on the device thread (proxy mode: in the background, and again
    after an unload). `on_load(shadow)` runs before a shadow is handed out. `ready` is set while
    one is held; `load_error` keeps the last load's failure."""

    def __init__(self, device: DeviceThread, source: Shadow | Loader,
                 on_load: Callable[[Shadow], None] = lambda shadow: None):
        self.device, self.on_load = device, on_load
        self._load: Loader | None = None if isinstance(source, Shadow) else source
        self.ready = threading.Event()
        self.ended = threading.Event()  # loaded, or failed to (cleared while a load is due)
        self.load_error: str | None = None
        self.weights = ""  # the label of the last shadow held (kept after an unload)
        self._shadow: Shadow | None = None
        self._given = source if isinstance(source, Shadow) else None
        self._lock = threading.Lock()
        self._loading = False

    def begin(self) -> None:
        """Hand out a shadow given at construction (its `on_load` runs now); a loader waits for
        `start_load`."""
        if self._given is not None and self._shadow is None:
            self._use(self._given)

    @property
    def shadow(self) -> Shadow | None:
        """The shadow held now (None while loading, unloaded or failed): take it once per job."""
        return self._shadow

    @property
    def can_unload(self) -> bool:
        """Only a shadow the host can load again is ever let go."""
        return self._load is not None

    def _use(self, shadow: Shadow) -> None:
        self.on_load(shadow)
        gcpauses.refreeze()  # a server froze what it loaded before listening: this load's objects too
        self._shadow, self.weights = shadow, shadow.weights
        self.ready.set()
        self.ended.set()

    def start_load(self) -> None:
        """Hand the device a load job, unless a shadow is held or a load is on its way."""
        with self._lock:
            if self._loading or self.ready.is_set() or self._load is None:
                return
            self._loading = True
            self.ended.clear()
        self.device.submit(self.load_now, "load")

    def load_now(self) -> None:
        """On the device thread: load the shadow (unless held); a failure is kept for status and asks."""
        try:
            if not self.ready.is_set() and self._load is not None:
                self._use(self._load())
                self.load_error = None
        except Exception as e:  # the proxy goes on passing requests through without a shadow
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("the shadow failed to load: %s", self.load_error)
        finally:
            with self._lock:
                self._loading = False
            self.ended.set()

    def loaded(self) -> Shadow | None:
        """On the device thread, before model work: the shadow, loaded again if an idle burst let
        it go (None if it failed to load)."""
        if not self.ready.is_set() and self.load_error is None:
            self.load_now()
        return self._shadow

    def ensure(self) -> Shadow:
        """As `loaded`, or ShadowUnavailable."""
        shadow = self.loaded()
        if shadow is None:
            raise ShadowUnavailable(f"the shadow failed to load ({self.load_error})")
        return shadow

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the shadow (loading in the background, or loaded again after an unload), up to timeout_s."""
        if not self.ready.is_set() and self.load_error is None:
            self.start_load()
        self.ended.wait(timeout_s)
        if not self.ready.is_set():
            raise ShadowUnavailable(self.load_error and f"the shadow failed to load ({self.load_error})"
                                    or "the shadow is still loading its model")

    def unload(self) -> None:
        """On the device thread: let the shadow go (the caller parked its sessions); the next
        `loaded` loads it again."""
        self._shadow = None
        self.ready.clear()
        self.ended.clear()
        gcpauses.thaw()  # the model's objects, frozen at its load, collectable again
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def pool_free(self) -> int:
        """Bytes the caching allocator holds for the model's device and nothing uses (0 off CUDA)."""
        shadow = self._shadow
        device = shadow.reader.model.device if shadow is not None else None
        if device is None or device.type != "cuda":
            return 0
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
