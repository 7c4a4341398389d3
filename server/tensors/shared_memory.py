"""System shared memory regions, as Triton's SystemSharedMemory* API has them: register, read, write, release.

A client creates a POSIX shared memory object (shm_open, a key such as "/input_simple"), registers
[offset, offset + byte_size) of it under a name, and then names that region in infer requests instead
of sending tensor bytes. This module owns the mappings; the RPC handlers (rpc/shared_memory.py) only
translate. Pure Python and mmap, no grpc.

On Linux a POSIX shared memory object named "/x" is the file /dev/shm/x (glibc's shm_open opens
exactly that), so a key is opened there; a key with a '/' after its leading ones is refused, since it
would name a path outside /dev/shm.

Inputs are copied out of a region once, at decode: the client may overwrite or unregister its region
while the request waits in a queue, so no view into the mapping outlives the decode. Outputs are
written once, from the finished array straight into the mapping. Every offset and size is checked
against the registered region before memory is touched. All calls come from the event loop (the gRPC
handlers), so registration, use and release never run concurrently and need no lock.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.tensors import datatypes

from server.tensors import wire as tensors
from server.errors import AlreadyExistsError, DisabledError, InvalidInputError, RegionNotFoundError
from server.names import capped, shown

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Triton reserves this key prefix for its Python backend's own regions and refuses it; so does Ferry.
RESERVED_PREFIX = "triton_python_backend_shm_region_"
REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
_SIZE_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request puts one tensor: `byte_size` bytes at `offset` into region `region`."""

    tensor: str
    region: str
    offset: int
    byte_size: int


def placement(tensor: str, params: dict) -> Placement | None:
    """The tensor's shared memory parameters (Triton's names and rules), or None when it names no region."""
    region = params.get(REGION)
    if region is None:
        for key in (OFFSET, BYTE_SIZE):
            if key in params:
                raise InvalidInputError(f"'{key}' can not be specified without '{REGION}' parameter for tensor {shown(tensor)}")
        return None
    if not isinstance(region, str):
        raise InvalidInputError(f"invalid value type for '{REGION}' parameter for tensor {shown(tensor)}, expected string_param.")
    if BYTE_SIZE not in params:
        raise InvalidInputError(f"'{BYTE_SIZE}' must be specified along with '{REGION}' parameter for tensor {shown(tensor)}")
    values = {}
    for key, default in ((OFFSET, 0), (BYTE_SIZE, None)):
        value = params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInputError(f"'{key}' for tensor {shown(tensor)} must be a non-negative int64_param, "
                                    f"got {capped(repr(value), 60)}")
        values[key] = value
    if values[OFFSET] + values[BYTE_SIZE] > _SIZE_MAX:  # JSON integers have no bound: Triton's words
        raise InvalidInputError(f"Integer overflow detected: byte_size ({values[BYTE_SIZE]}) + offset ({values[OFFSET]}) "
                                f"exceeds maximum value ({_SIZE_MAX}) for region {shown(region)}")
    return Placement(tensor, region, values[OFFSET], values[BYTE_SIZE])


def write_output(target: tuple[Region, Placement], array: np.ndarray) -> dict[str, str | int]:
    """Write one output into the region a request named for it; the tensor's parameters to answer with
    (Triton's: the region, the bytes written, and the offset when it is not 0), for either door to encode."""
    region, where = target
    params: dict[str, str | int] = {REGION: where.region, BYTE_SIZE: region.write(where, array)}
    if where.offset:
        params[OFFSET] = where.offset
    return params


class Region:
    """One registered region: [offset, offset + byte_size) of the object `key`, mapped read-write."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, mapping: mmap.mmap, start: int):
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        self._mapping = mapping
        self._view = memoryview(mapping)[start : start + byte_size]  # the region itself, 0-based
        self.closed = False
        self.users = 0  # requests in flight that named it (SharedMemoryRegistry.hold)
        self.unregistered = False  # unregistered while in use: released when its last user ends

    def _span(self, use: str, offset: int, byte_size: int) -> memoryview:
        """The bytes [offset, offset + byte_size) of the region, refused unless wholly inside it."""
        if self.closed:
            raise RegionNotFoundError(f"shared memory region {shown(self.name)} was unregistered before {use} "
                                      "could use it; register it again and resend the request")
        if offset >= self.byte_size:
            raise InvalidInputError(f"Invalid offset for shared memory region: {shown(self.name)}: {use} asks for offset "
                                    f"{offset} but the region holds {self.byte_size} bytes")
        if offset + byte_size > self.byte_size:
            raise InvalidInputError(f"Invalid offset + byte size for shared memory region: {shown(self.name)}: {use} asks "
                                    f"for {byte_size} bytes at offset {offset}, past the region's {self.byte_size} bytes")
        return self._view[offset : offset + byte_size]

    def check(self, where: Placement, use: str) -> None:
        self._span(use, where.offset, where.byte_size)

    def read(self, where: Placement, dtype: datatypes.DataType, shape: tuple[int, ...]) -> np.ndarray:
        """The input tensor at `where`, copied out of the mapping (the one copy; see the module docstring)."""
        chunk = self._span(f"input {shown(where.tensor)}", where.offset, where.byte_size)
        array = tensors.from_raw(where.tensor, dtype, shape, chunk)  # size and BYTES framing checked here
        return array if array.dtype == object else array.copy()  # BYTES elements are already their own objects

    def write(self, where: Placement, array: np.ndarray) -> int:
        """Write an output tensor at `where` as raw KServe bytes; returns the bytes written."""
        use = f"output {shown(where.tensor)}"
        data = tensors.to_raw(array) if array.dtype.kind in "OSU" else None
        nbytes = len(data) if data is not None else array.nbytes
        if nbytes > where.byte_size:  # Triton's words, then the way out
            raise InvalidInputError(
                f"shared memory size specified with the request for output {shown(where.tensor)} ({where.byte_size} "
                f"bytes) should be at least {nbytes} bytes to hold the results; register a larger region or ask for "
                "the output in the response")
        chunk = self._span(use, where.offset, nbytes)
        if data is not None:
            chunk[:] = data
        else:  # straight from the array into the mapping: no intermediate bytes
            np.ndarray(array.shape, array.dtype, buffer=chunk)[...] = array
        return nbytes

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._view.release()
        try:
            self._mapping.close()
        except BufferError:  # a view from a refused decode is still referenced (a traceback): unmapped when collected
            log.debug("shared memory region %r: mapping still referenced, unmapped when released", self.name)


REGISTER_REFUSED = ("Client shared memory is disabled: registering a shared memory region is turned off on this server "
                    "(it maps a file that the client "
                    "names into the server's memory); start the server with --allow-shared-memory to allow it, or send "
                    "the tensors in the request")


class SharedMemoryRegistry:
    """Name -> Region. Regions are released on unregister and by `close()` at shutdown."""

    def __init__(self, directory: Path = SHM_DIR, allow_register: bool = True):
        self.directory = directory
        self.allow_register = allow_register  # off: the server maps nothing a client names (--allow-shared-memory)
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not self.allow_register:
            raise DisabledError(REGISTER_REFUSED)
        if not name:
            raise InvalidInputError("a shared memory region needs a name")
        if name in self._regions:  # Triton's words
            raise AlreadyExistsError(f"shared memory region {shown(name)} already in manager; unregister it first "
                                     "or register the object under another name")
        if byte_size <= 0:
            raise InvalidInputError(f"failed to register shared memory region {shown(name)}: invalid args: byte_size must "
                                    "be positive")
        path = self._path(name, key)
        fd = _open(name, key, path)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInputError(f"failed to register shared memory region {shown(name)}: invalid args: offset "
                                        f"{offset} + byte_size {byte_size} is past the end of {shown(key)} ({size} bytes)")
            start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets must be page-aligned
            try:
                mapping = mmap.mmap(fd, offset + byte_size - start, offset=start)
            except OSError as exc:
                raise InvalidInputError(f"failed to register shared memory region {shown(name)}: cannot map "
                                        f"{shown(key)}: {exc.strerror}") from None
        finally:
            os.close(fd)
        region = self._regions[name] = Region(name, key, offset, byte_size, mapping, offset - start)
        log.info("shared memory region %r registered: %s [%d, %d)", name, key, offset, offset + byte_size)
        return region

    def _path(self, name: str, key: str) -> Path:
        base = key.lstrip("/")
        if key.startswith(RESERVED_PREFIX) or base.startswith(RESERVED_PREFIX):
            raise InvalidInputError(f"cannot register shared memory region {shown(name)} with key {shown(key)} as the "
                                    f"key contains the reserved prefix '{RESERVED_PREFIX}'")
        if not base or "/" in base or base in (".", "..") or "\0" in base:
            raise InvalidInputError(f"cannot register shared memory region {shown(name)} - invalid shm key {shown(key)}: "
                                    "a POSIX shared memory name is '/' followed by a name without further '/'")
        return self.directory / base

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:  # Triton's words, then what to do
            raise RegionNotFoundError(f"Unable to find shared memory region: {shown(name)}; register it with "
                                      "SystemSharedMemoryRegister before naming it in a request")
        return region

    def status(self, name: str = "") -> list[Region]:
        if not name:
            return list(self._regions.values())
        if name not in self._regions:
            raise RegionNotFoundError(f"Unable to find system shared memory region: {shown(name)}")
        return [self._regions[name]]

    def unregister(self, name: str = "") -> None:
        """One region, or every one when `name` is empty; an unknown name is no error (as Triton). A region a
        request in flight named stays registered (listed, and usable by new requests) until its last such
        request ends, as in Triton; then it goes without another call."""
        if name:
            regions = [self._regions[name]] if name in self._regions else []
        else:
            regions = list(self._regions.values())
        for region in regions:
            if region.users:
                region.unregistered = True
            else:
                self._drop(region)

    def hold(self, names) -> list[Region]:
        """The regions a request names, kept registered until `release` (call it when the request ends)."""
        held = [self._regions[n] for n in dict.fromkeys(names) if n in self._regions]
        for region in held:
            region.users += 1
        return held

    def release(self, held: list[Region]) -> None:
        for region in held:
            region.users -= 1
            if not region.users and region.unregistered and self._regions.get(region.name) is region:
                self._drop(region)

    def _drop(self, region: Region) -> None:
        del self._regions[region.name]
        region.close()
        log.info("shared memory region %r unregistered", region.name)

    def read(self, where: Placement, dtype: datatypes.DataType, shape: tuple[int, ...]) -> np.ndarray:
        return self.get(where.region).read(where, dtype, shape)

    def targets(self, placements: list[Placement]) -> dict[str, tuple[Region, Placement]]:
        """Outputs to write into regions, each checked against its region now, before any work is done."""
        found = {}
        for where in placements:
            region = self.get(where.region)
            region.check(where, f"output {shown(where.tensor)}")
            found[where.tensor] = (region, where)
        return found

    def close(self) -> None:
        """At shutdown: every region, in use or not."""
        for region in list(self._regions.values()):
            self._drop(region)

    def __len__(self) -> int:
        return len(self._regions)


def _open(name: str, key: str, path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegionNotFoundError(f"Unable to open shared memory region: {shown(key)}: no shared memory object has that "
                                  f"key (create it with shm_open first); region {shown(name)} was not registered") from None
    except OSError as exc:
        raise InvalidInputError(f"Unable to open shared memory region: {shown(key)}: {exc.strerror}; "
                                f"region {shown(name)} was not registered") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidInputError(f"Unable to open shared memory region: {shown(key)} is not a shared memory object")
    return fd
