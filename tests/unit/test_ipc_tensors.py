"""Tensors between Ferry's processes: where each one travels, and what the reader gets."""

from __future__ import annotations

import gc
import pickle

import numpy as np

from server.ipc import tensors
from server.ipc.arena import Allocator, Arena


def _arena(tmp_path) -> tuple[Arena, Allocator]:
    arena = Arena(tmp_path / "arena", 1 << 20, create=True)
    return arena, Allocator(0, arena.size)


def test_small_tensors_ride_in_the_frame_and_arrive_writable(tmp_path):
    arena, blocks = _arena(tmp_path)
    array = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous: still one record
    record = pickle.loads(pickle.dumps(tensors.put("x", array, arena, blocks), protocol=5))
    assert record.offset is None and record.nbytes == array.nbytes
    got = tensors.view(record, arena, lambda offset: None)
    np.testing.assert_array_equal(got, array)
    got += 1  # model code may change its input in place, as it may a block's view
    np.testing.assert_array_equal(got, array + 1)
    assert blocks.allocate(arena.size) is not None  # nothing was taken from the arena


def test_large_tensors_go_through_the_arena_and_their_block_comes_back_with_the_last_view(tmp_path):
    arena, blocks = _arena(tmp_path)
    array = np.random.default_rng(0).standard_normal(4096).astype(np.float32)  # 16 KiB, above INLINE_BYTES
    assert array.nbytes > tensors.INLINE_BYTES
    record = tensors.put("x", array, arena, blocks)
    assert record.offset is not None and record.data is None
    freed = []
    got = tensors.view(record, arena, freed.append)
    np.testing.assert_array_equal(got, array)
    part = got[10:20]
    del got
    gc.collect()
    assert freed == []  # a slice still reads the block
    del part
    gc.collect()
    assert freed == [record.offset]


def test_bytes_tensors_are_parsed_on_arrival_whatever_their_size(tmp_path):
    arena, blocks = _arena(tmp_path)
    array = np.array([b"a", b"", b"\x00\xffz" * 1000], dtype=object)
    freed = []
    got = tensors.view(tensors.put("s", array, arena, blocks), arena, freed.append)
    assert list(got) == list(array)
