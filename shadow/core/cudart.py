"""Page-locking host memory for the GPU, called without holding the GIL.

`host_register` page-locks memory the caller mapped (`cudaHostRegister`, portable to every device's
context) through the CUDA runtime torch loaded, by ctypes, which lets go of the GIL for the call:
a register of hundreds of MiB takes tens of milliseconds, and other Python threads (the one that
reads) go on meanwhile. Where no runtime library is found in the process (a torch linked to it
statically), torch's own binding is used."""

from __future__ import annotations

import ctypes
import threading

import torch

HOST_REGISTER_PORTABLE = 1
_lock = threading.Lock()
_calls: list = []


def host_register(address: int, nbytes: int) -> None:
    """Page-lock `nbytes` at `address` (page-aligned, mapped by the caller); raises on a CUDA error."""
    register, _ = _functions()
    err = int(register(address, nbytes, HOST_REGISTER_PORTABLE))
    if err:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {err}")


def host_unregister(address: int) -> None:
    """Undo `host_register` at `address` (errors are ignored: the memory is unmapped next)."""
    _, unregister = _functions()
    unregister(address)


def _functions():
    with _lock:
        if not _calls:
            torch.cuda.init()
            path = _loaded_cudart()
            if path is None:
                rt = torch.cuda.cudart()
                _calls.extend([rt.cudaHostRegister, rt.cudaHostUnregister])
            else:
                lib = ctypes.CDLL(path)
                lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
                lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
                lib.cudaHostRegister.restype = lib.cudaHostUnregister.restype = ctypes.c_int
                _calls.extend([lib.cudaHostRegister, lib.cudaHostUnregister])
        return _calls[0], _calls[1]


def _loaded_cudart() -> str | None:
    """The path of the CUDA runtime library mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            return next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
    except OSError:
        return None
