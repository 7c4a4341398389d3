"""join_rows: np.concatenate along the batch, copied without handing the GIL around."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from server.tensors.assembly import copy_rows, join_rows

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("parts", [
    [RNG.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(5)],
    [RNG.integers(0, 9, (1, 7)), RNG.integers(0, 9, (3, 7))],
    [np.ones((1, 2), np.float16), np.zeros((4, 2), np.float16)],
    [np.ones((1, 2), bool), np.zeros((2, 2), bool)],
    [np.array([[b"a"]], dtype=object), np.array([[b"bc"]], dtype=object)],  # object arrays: np.concatenate
    [np.ones((2, 3), np.float32)[:, ::2], np.ones((1, 2), np.float32)],  # non-contiguous part
], ids=["fp32", "int64", "fp16", "bool", "bytes", "strided"])
def test_equals_concatenate(parts):
    joined, expected = join_rows(parts), np.concatenate(parts)
    assert joined.dtype == expected.dtype and joined.shape == expected.shape
    assert np.array_equal(joined, expected)
    assert joined.flags.writeable


def test_parts_that_disagree_raise_as_concatenate_does():
    with pytest.raises(ValueError, match="dimension"):
        join_rows([np.ones((1, 1), np.float32), np.ones((1, 3), np.float32)])


def test_the_copy_keeps_the_gil():
    """A thread waiting for the GIL never runs during the copy (np.concatenate lets it in per part)."""
    spins, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            spins[0] += 1

    parts = [RNG.standard_normal((1, 32, 512)).astype(np.float32) for _ in range(23)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no forced switch can fall inside the sub-millisecond copy, even on a busy machine
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)  # the spinner has the GIL; we get it back at its next forced switch
        before = spins[0]
        joined = join_rows(parts)
        during = spins[0] - before
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    assert during == 0
    assert np.array_equal(joined, np.concatenate(parts))


def test_zero_size_parts_are_joined_and_padded_without_a_byte_cast():
    """memoryview(...).cast refuses a shape with a zero; such parts have nothing to copy."""
    empty = [np.ones((1, 0), np.float32), np.ones((2, 0), np.float32)]
    assert join_rows(empty).shape == (3, 0)
    parts = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((0, 3), np.float32), np.ones((1, 3), np.float32)]
    np.testing.assert_array_equal(join_rows(parts), np.concatenate(parts))
    out = np.full((3, 4), -1, np.float32)
    copy_rows(out, [np.ones((1, 0), np.float32), np.full((1, 4), 2, np.float32), np.full((1, 2), 3, np.float32)])
    assert out.tolist() == [[-1] * 4, [2] * 4, [3, 3, -1, -1]]
