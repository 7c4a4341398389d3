"""Tensors between Ferry's processes: written once into an arena block, read as numpy views over it.

The record says where a tensor is: in the arena (`offset` set, `data` None) or inline in the frame
(`data` its raw KServe bytes), used for small tensors and when the arena is missing or full. A
writer allocates in the half of the arena it owns and writes each tensor once; the reader makes views (no copy) and hands a block
back (the owner frees it) only when its last view is gone: `view` arranges that with a finalizer on
the object every view keeps alive. BYTES travel as their raw KServe bytes (length-prefixed elements)
and are parsed on arrival, which copies them anyway, so their block is handed back at once.
"""

from __future__ import annotations

import pickle
import weakref
from typing import Callable, NamedTuple

import numpy as np

from server.tensors import datatypes

from server.tensors import wire as tensors
from server.ipc.arena import Allocator, Arena

# Below this size a tensor rides in its frame: copying a few hundred bytes costs less than a block's
# allocation, its finalizer and the message that hands it back.
INLINE_BYTES = 2048


class Tensor(NamedTuple):
    """Its fields by position too: `view` reads a plain tuple of the same layout, which a link may send
    instead (a plain tuple pickles without a class lookup and a Python call each way)."""

    name: str
    datatype: str  # the KServe datatype, e.g. "FP32"
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None = None  # where in the arena, or None: inline
    data: bytes | bytearray | pickle.PickleBuffer | None = None  # PickleBuffer: pickled as a bytearray


def put(name: str, array: np.ndarray, arena: Arena | None, blocks: Allocator | None) -> Tensor:
    """`array` written once into a block of `blocks` (inline when there is no arena, it does not fit, or
    it is small)."""
    array = np.asarray(array)
    api = datatypes.from_numpy(array.dtype).api
    raw = tensors.to_raw(array) if array.dtype.kind in "OSU" else None
    nbytes = len(raw) if raw is not None else array.nbytes
    if raw is None and nbytes <= INLINE_BYTES:  # a bytearray: the reader's array is writable, as a block's is
        return Tensor(name, api, tuple(array.shape), nbytes, None, bytearray(_bytes_of(array)))
    offset = blocks.allocate(nbytes) if blocks is not None and nbytes else None
    if offset is None:
        return Tensor(name, api, tuple(array.shape), nbytes, None, raw if raw is not None else _inline(array))
    if raw is not None:
        arena.view[offset : offset + nbytes] = raw
    else:
        np.ndarray(array.shape, array.dtype, buffer=arena.mapping, offset=offset)[...] = array
    return Tensor(name, api, tuple(array.shape), nbytes, offset)


def _inline(array: np.ndarray) -> pickle.PickleBuffer | bytearray:
    """A tensor that rides in its frame without a copy of its own: the frame's pickle reads the array's
    memory (its one copy), and a writable buffer arrives as a bytearray, so the reader's array is
    writable, as a block's is (model code may hand an input to DLPack, which needs writable memory). A
    read-only array is copied into a bytearray for the same reason."""
    data = _bytes_of(array)
    return pickle.PickleBuffer(data) if data.flags.writeable else bytearray(data)


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """The array's bytes as uint8: Python's buffer protocol cannot describe extension dtypes (bfloat16)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def view(tensor: Tensor, arena: Arena | None, free: Callable[[int], None]) -> np.ndarray:
    """The tensor as a numpy array over the arena (or the frame's bytes); `free(offset)` runs once the
    last view of an arena block is gone (for BYTES, at once: the parsed elements are copies)."""
    name, datatype, shape, nbytes, offset, *data = tensor  # a Tensor, or a plain tuple laid out as one
    dtype = datatypes.BY_API[datatype]
    if offset is None:
        return tensors.from_raw(name, dtype, tuple(shape), data[0])
    array = tensors.from_raw(name, dtype, tuple(shape), arena.view[offset : offset + nbytes])
    if array.dtype == object:
        free(offset)
    else:
        weakref.finalize(root(array), free, offset).atexit = False  # nobody is left to tell at exit
    return array


def root(array: np.ndarray):
    """The object every numpy view of `array` keeps alive: its data's first non-array owner."""
    owner = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    return owner
