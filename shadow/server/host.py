"""The model host: loads the shadow's model (its reader and store), hands out one handle to it, and
lets it go after an idle burst.

Work takes the handle once (`host.model`, a `Model`) and uses that handle's reader and store
throughout: an unload meanwhile drops the host's reference, never the objects a job holds, so no
job ever finds a reader without its store, or None, halfway through. Loads and unloads run on
the device thread (`DeviceThread`), between other jobs; `on_load` runs there first (the read
scheduler's estimates are measured, the voice made), before the model is handed out.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shadow.errors import ShadowUnavailable
from shadow.core.reader import Reader
from shadow.server.device import DeviceThread
from shadow.core.store import SessionStore

log = logging.getLogger("shadow.serve")


@dataclass(frozen=True)
class Model:
    """One loaded model: its reader, its store, the weights' label."""

    reader: Reader
    store: SessionStore
    weights: str

    @property
    def grid(self) -> int:
        return self.reader.grid

    @property
    def weights_hash(self) -> str:
        return self.store.identity.weights_hash


class ModelHost:
    """Holds the model (given at once, or loaded by `load` on the device thread). `ready` is set
    while a model is held; `load_error` keeps the last load's failure."""

    def __init__(self, device: DeviceThread, load: Callable[[], tuple[Reader, SessionStore, str]] | None = None,
                 on_load: Callable[[Model], None] = lambda model: None):
        self.device, self._load, self.on_load = device, load, on_load
        self.ready = threading.Event()
        self.ended = threading.Event()  # loaded, or failed to (cleared while a load is due)
        self.load_error: str | None = None
        self.weights = ""  # the label of the last model held (kept after an unload)
        self._model: Model | None = None
        self._lock = threading.Lock()
        self._loading = False

    @property
    def model(self) -> Model | None:
        """The model held now (None while loading, unloaded or failed): take it once per job."""
        return self._model

    @property
    def can_unload(self) -> bool:
        """Only a model the host can load again is ever let go."""
        return self._load is not None

    def use(self, reader: Reader, store: SessionStore, weights: str) -> Model:
        model = Model(reader, store, weights)
        self.on_load(model)
        self._model, self.weights = model, weights
        self.ready.set()
        self.ended.set()
        return model

    def start_load(self) -> None:
        """Hand the device a load job, unless the model is held or a load is on its way."""
        with self._lock:
            if self._loading or self.ready.is_set() or self._load is None:
                return
            self._loading = True
            self.ended.clear()
        self.device.submit(self.load_now, "load")

    def load_now(self) -> None:
        """On the device thread: load the model (unless held); a failure is kept for status and asks."""
        try:
            if not self.ready.is_set() and self._load is not None:
                self.use(*self._load())
                self.load_error = None
        except Exception as e:  # the proxy goes on passing requests through without a shadow
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("the shadow failed to load: %s", self.load_error)
        finally:
            with self._lock:
                self._loading = False
            self.ended.set()

    def loaded(self) -> Model | None:
        """On the device thread, before model work: the model, loaded again if an idle burst let it
        go (None if it failed to load)."""
        if not self.ready.is_set() and self.load_error is None:
            self.load_now()
        return self._model

    def ensure(self) -> Model:
        """As `loaded`, or ShadowUnavailable."""
        model = self.loaded()
        if model is None:
            raise ShadowUnavailable(f"the shadow failed to load ({self.load_error})")
        return model

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the model (loading in the background, or loaded again after an unload), up to timeout_s."""
        if not self.ready.is_set() and self.load_error is None:
            self.start_load()
        self.ended.wait(timeout_s)
        if not self.ready.is_set():
            raise ShadowUnavailable(self.load_error and f"the shadow failed to load ({self.load_error})"
                                    or "the shadow is still loading its model")

    def unload(self) -> None:
        """On the device thread: let the model go (the caller parked its sessions); the next
        `loaded` loads it again."""
        self._model = None
        self.ready.clear()
        self.ended.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def pool_free(self) -> int:
        """Bytes the caching allocator holds for the model's device and nothing uses (0 off CUDA)."""
        model = self._model
        device = model.reader.model.device if model is not None else None
        if device is None or device.type != "cuda":
            return 0
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
