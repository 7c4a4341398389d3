"""CUDA shared memory, as Triton's CudaSharedMemory* API has it, on a server that opens no CUDA IPC handles.

No CUDA region is ever registered, so the set of regions is always empty: unregistering (one or all)
succeeds and the status of all is empty, exactly as on a Triton server without a GPU. That matters:
most Triton client code starts by clearing both kinds of regions before it registers system shared
memory. Only registering is refused, saying what to use instead. Both doors (rpc/shared_memory.py,
web/shared_memory.py) call these, naming their own operation and their own system-memory route.
"""

from __future__ import annotations

from pathlib import Path

from server.errors import DisabledError, InvalidInputError, RegionNotFoundError, UnsupportedError
from server.names import shown
from server.tensors.shared_memory import REGISTER_REFUSED

REFUSED = ("{operation}: CUDA shared memory is not implemented by Ferry ({device}); use system shared memory "
           "({instead}) or send the tensors in the request")


def register(operation: str, instead: str, name: str, device_id: int, byte_size: int, allowed: bool) -> None:
    """Always refused, but first its arguments are checked, as Triton checks them before it opens the handle, so
    a client's mistake is answered as one. `operation` and `instead` are the door's names for this call and
    for system shared memory; `allowed`: whether the server registers client shared memory at all."""
    if not allowed:
        raise DisabledError(REGISTER_REFUSED)
    if not name:
        raise InvalidInputError("failed to register CUDA shared memory region: invalid args: a region needs a name")
    where = f"failed to register CUDA shared memory region {shown(name)}: invalid args"
    if byte_size <= 0:
        raise InvalidInputError(f"{where}: byte_size must be positive, got {byte_size}")
    if device_id < 0:
        raise InvalidInputError(f"{where}: device_id must be a non-negative CUDA device index, got {device_id}")
    gpus = Path("/proc/driver/nvidia/gpus")
    device = ("this server has a CUDA device but does not open CUDA IPC handles" if gpus.is_dir() and any(gpus.iterdir())
              else "no CUDA device is present on this server")
    raise UnsupportedError(REFUSED.format(operation=operation, device=device, instead=instead))


def status(name: str = "") -> list:
    """Every registered CUDA region (none), or the one named, which cannot exist (Triton's words)."""
    if name:
        raise RegionNotFoundError(f"Unable to find cuda shared memory region: {shown(name)}")
    return []


def unregister(name: str = "") -> None:
    """One region or all: nothing is registered, so there is nothing to release (an unknown name is no error)."""
