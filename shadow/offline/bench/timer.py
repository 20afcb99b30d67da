"""Synchronised wall-clock timing: the device is synchronised before and after the timed call,
so host overhead (launches, Python) counts, as it does for a reader in a live server."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of `repeats` calls of fn after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)
