"""Machine facts, timing (best of N) and peak memory (a process's RSS high-water mark; CUDA's
allocator peak). torch is imported by the functions that use it."""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary() -> str:
    """Architecture, CPU count and Python version, as one line."""
    return f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}"


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds one call of `fn` takes, and its result."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def best_of(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """The fastest of `repeat` calls of `fn` in seconds, and the last call's result."""
    best = float("inf")
    for _ in range(repeat):
        seconds, result = timed(fn)
        best = min(best, seconds)
    return best, result


# ----------------------------------------------------------------------------------- memory


def _status_kb(key: str) -> int | None:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM), or None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def vmhwm_mb() -> float | None:
    """This process's peak RSS since it started (or since `reset_rss_peak`), in MB."""
    hwm = _status_kb("VmHWM")
    return None if hwm is None else hwm / 1024


def fix_malloc() -> None:
    """Make glibc return every large freed array to the OS, so each call's peak RSS is its own.

    glibc raises its mmap threshold after big frees and then serves the next big arrays from heap
    pages that are already resident, which would hide them from the RSS high-water mark.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (fixed, no longer dynamic)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def reset_rss_peak() -> int | None:
    """Reset the RSS high-water mark to the current RSS; return the RSS in kB (None: no /proc)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


def rss_peak_extra_mb(base_kb: int | None) -> float | None:
    """The RSS high-water mark over `base_kb` (what `reset_rss_peak` returned), in MB."""
    hwm = _status_kb("VmHWM")
    if base_kb is None or hwm is None:
        return None
    return (hwm - base_kb) / 1024


def reset_cuda_peak(device: torch.device) -> None:
    """Start CUDA's allocator peak afresh (nothing on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_gib(device: torch.device) -> float | None:
    """CUDA's allocator peak since the last reset, in GiB (None on CPU)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand CUDA's cached blocks back."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
