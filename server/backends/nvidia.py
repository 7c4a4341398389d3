"""Whether this machine has NVIDIA GPUs, as the driver reports them, without importing a CUDA library.

For the Python backend, which only needs to know (its GPU settings, on the server's side and in the
model process); a backend that runs on CUDA asks its own framework instead.
"""

from __future__ import annotations

from pathlib import Path

_GPUS = Path("/proc/driver/nvidia/gpus")


def gpu_count() -> int:
    return len(list(_GPUS.iterdir())) if _GPUS.is_dir() else 0
