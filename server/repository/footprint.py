"""How much memory a model version holds: measured around its load, or declared in its config.

A load is measured as the process's resident memory (and, where CUDA is present, each device's used
memory) just before and just after its instances are built. The difference is what the budget charges
(server/repository/residency.py). It is an estimate: allocator caches kept from earlier loads, pages
another thread touched meanwhile, the CUDA context a first device load creates all land in it or hide
from it. So a config may declare the figure instead (`parameters { key: "memory_bytes" value: {
string_value: "64MiB" } }`), and then that is what counts.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass, field

from protos import model_config_pb2 as mc
from server import heap
from server.errors import ConfigError

HOST = "host"
_HEAP = "_heap"  # a snapshot's malloc in-use bytes: folded into HOST by `measured`
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1.5GiB', '1048576' -> bytes; raises ValueError naming the text."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (a number of bytes, or with a unit: 512MiB, 2GB, 1.5GiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def shown_size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one loaded version holds, per place: 'host' and 'cuda:N'."""

    bytes_by_place: dict[str, int] = field(default_factory=dict)
    declared: bool = False

    @property
    def host(self) -> int:
        return self.bytes_by_place.get(HOST, 0)

    def shown(self) -> str:
        places = ", ".join(f"{place} {shown_size(n)}" for place, n in sorted(self.bytes_by_place.items()))
        return f"{places or 'host 0.0 MiB'} ({'declared' if self.declared else 'measured'})"


def declared(config: mc.ModelConfig | None, source: str) -> Footprint | None:
    """The config's `memory_bytes` parameter ('SIZE' for host memory, or 'host=SIZE,cuda:0=SIZE'); None without one."""
    if config is None or "memory_bytes" not in config.parameters:
        return None
    text = config.parameters["memory_bytes"].string_value
    try:
        return Footprint(parse_places(text, default_place=HOST), declared=True)
    except ValueError as exc:
        raise ConfigError(f"{source}: parameter memory_bytes: {exc}") from None


def parse_places(text: str, default_place: str = HOST) -> dict[str, int]:
    """'2GiB' or 'host=2GiB,cuda:0=30GiB' -> {place: bytes}."""
    places = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        place, _, size = part.rpartition("=")
        place = place.strip() or default_place
        if place != HOST and not re.fullmatch(r"cuda:\d+", place):
            raise ValueError(f"{place!r} is not a place (host or cuda:N)")
        places[place] = parse_size(size)
    if not places:
        raise ValueError(f"{text!r} names no size")
    return places


def snapshot(cuda_devices: frozenset[int] | set[int] = frozenset()) -> dict[str, int]:
    """Memory in use now: this process's resident bytes and heap, and each named CUDA device's used bytes.
    Devices are asked only for a load that places instances on them, so a CPU-only server never starts CUDA."""
    used = {HOST: _resident_bytes(), _HEAP: _heap_in_use()}
    if cuda_devices:
        used.update(_device_used(cuda_devices))
    return used


def _device_used(cuda_devices) -> dict[str, int]:
    """The device's own view (torch.cuda.mem_get_info: total minus free), so what ONNX Runtime or any other
    library allocates there counts, not only torch's tensors."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    used = {}
    for index in sorted(cuda_devices):
        if index < torch.cuda.device_count():
            free, total = torch.cuda.mem_get_info(index)
            used[f"cuda:{index}"] = total - free
    return used


def measured(before: dict[str, int], after: dict[str, int]) -> Footprint:
    """The growth between two snapshots. Host memory is the larger of resident growth and heap growth:
    resident memory misses what the load took from pages the heap already held (freed by an earlier
    load or by the config's completion), the heap misses what was mapped outside it."""
    grown = {place: max(0, after.get(place, 0) - before.get(place, 0)) for place in after}
    grown[HOST] = max(grown.get(HOST, 0), grown.pop(_HEAP, 0))
    return Footprint(grown)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back, every arena (0 where there is no mallinfo2)."""
    if _LIBC is None:
        return 0
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def _libc():
    libc = heap.libc_handle()
    try:
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except AttributeError:  # no libc found (None), or one without mallinfo2
        return None


_LIBC = _libc()


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the peak is the best the standard library gives
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
