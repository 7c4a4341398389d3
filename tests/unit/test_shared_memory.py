"""server/tensors/shared_memory.py against real mapped files: bounds, the one copy, release."""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest

from server.tensors import datatypes
from server.errors import AlreadyExistsError, InvalidInputError, RegionNotFoundError
from server.tensors.shared_memory import SHM_DIR, Placement, SharedMemoryRegistry, placement

FP32, BYTES = datatypes.BY_API["FP32"], datatypes.BY_API["BYTES"]


@pytest.fixture
def shm(tmp_path) -> SharedMemoryRegistry:
    registry = SharedMemoryRegistry(tmp_path)
    yield registry
    registry.close()


def make(directory: Path, key: str, data: bytes) -> Path:
    path = directory / key.lstrip("/")
    path.write_bytes(data)
    return path


def test_input_is_copied_once_out_of_the_region_at_its_offset(shm, tmp_path):
    values = np.arange(8, dtype=np.float32)
    path = make(tmp_path, "/in", b"\xff" * 10 + values.tobytes())
    region = shm.register("in", "/in", 10, 32)  # an offset mmap cannot take as is (not page-aligned)
    got = shm.read(Placement("INPUT0", "in", 0, 32), FP32, (2, 4))
    assert np.array_equal(got, values.reshape(2, 4))
    path.write_bytes(b"\0" * 42)  # the client overwrites its region while the request is queued
    assert np.array_equal(got, values.reshape(2, 4)) and got.flags.owndata
    assert region.byte_size == 32 and region.offset == 10


def test_output_written_at_its_offset_and_visible_in_the_file(shm, tmp_path):
    path = make(tmp_path, "/out", b"\0" * 64)
    region = shm.register("out", "/out", 0, 64)
    out = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert region.write(Placement("OUTPUT0", "out", 16, 32), out[:, ::-1]) == 24  # non-contiguous source
    assert np.array_equal(np.frombuffer(path.read_bytes()[16:40], np.int32), out[:, ::-1].reshape(-1))


def test_bytes_tensors_use_the_length_prefixed_codec(shm, tmp_path):
    framed = b"".join(struct.pack("<I", len(v)) + v for v in (b"ab", b"", b"xyz"))
    make(tmp_path, "/s", framed + b"\0" * 50)
    region = shm.register("s", "/s", 0, 64)
    assert shm.read(Placement("T", "s", 0, len(framed)), BYTES, (3,)).tolist() == [b"ab", b"", b"xyz"]
    with pytest.raises(InvalidInputError, match="BYTES"):
        shm.read(Placement("T", "s", 0, len(framed) - 1), BYTES, (3,))
    assert region.write(Placement("O", "s", 0, 64), np.array([b"hello"], dtype=object)) == 9


def test_input_size_must_match_shape_and_datatype(shm, tmp_path):
    make(tmp_path, "/k", b"\0" * 64)
    shm.register("r", "/k", 0, 64)
    with pytest.raises(InvalidInputError, match="'INPUT0'. Expected 32, got 16: raw content is 16 bytes but shape \\[2, 4\\] of FP32 needs 32"):
        shm.read(Placement("INPUT0", "r", 0, 16), FP32, (2, 4))


@pytest.mark.parametrize("offset, size, message", [
    (64, 4, "Invalid offset for shared memory region: 'r'"),
    (60, 8, "Invalid offset \\+ byte size for shared memory region: 'r'.*8 bytes at offset 60.*64 bytes"),
    (0, 2**63, "Invalid offset \\+ byte size"),
])
def test_bounds_are_checked_before_memory_is_touched(shm, tmp_path, offset, size, message):
    make(tmp_path, "/k", b"\0" * 64)
    shm.register("r", "/k", 0, 64)
    with pytest.raises(InvalidInputError, match=message):
        shm.read(Placement("INPUT0", "r", offset, size), datatypes.BY_API["UINT8"], (size,))
    with pytest.raises(InvalidInputError, match=message):
        shm.targets([Placement("OUTPUT0", "r", offset, size)])


def test_output_larger_than_its_byte_size_names_the_output_and_the_sizes(shm, tmp_path):
    make(tmp_path, "/k", b"\0" * 64)
    region = shm.register("r", "/k", 0, 64)
    with pytest.raises(InvalidInputError, match="output 'OUTPUT0' \\(8 bytes\\) should be at least 16 bytes"):
        region.write(Placement("OUTPUT0", "r", 0, 8), np.zeros(4, np.float32))


def test_registration_errors(shm, tmp_path):
    make(tmp_path, "/k", b"\0" * 64)
    shm.register("r", "/k", 0, 64)
    with pytest.raises(AlreadyExistsError, match="'r' already in manager"):
        shm.register("r", "/k", 0, 8)
    with pytest.raises(RegionNotFoundError, match="Unable to open shared memory region: '/missing'"):
        shm.register("m", "/missing", 0, 8)
    with pytest.raises(InvalidInputError, match="past the end of '/k' \\(64 bytes\\)"):
        shm.register("big", "/k", 8, 64)
    with pytest.raises(InvalidInputError, match="byte_size must be positive"):
        shm.register("zero", "/k", 0, 0)
    for key in ("/a/../k", "/..", "/", ""):
        with pytest.raises(InvalidInputError, match="invalid shm key"):
            shm.register("bad", key, 0, 8)
    with pytest.raises(InvalidInputError, match="reserved prefix"):
        shm.register("bad", "/triton_python_backend_shm_region_1", 0, 8)
    assert [r.name for r in shm.status()] == ["r"]  # nothing half-registered


def test_unregister_releases_the_mapping_and_later_use_is_refused(shm, tmp_path):
    make(tmp_path, "/k", b"\0" * 64)
    region = shm.register("r", "/k", 0, 64)
    target = shm.targets([Placement("OUTPUT0", "r", 0, 64)])["OUTPUT0"]
    shm.unregister("r")
    assert region.closed and region._mapping.closed and len(shm) == 0
    with pytest.raises(RegionNotFoundError, match="Unable to find shared memory region: 'r'"):
        shm.read(Placement("INPUT0", "r", 0, 4), FP32, (1,))
    with pytest.raises(RegionNotFoundError, match="'r' was unregistered before output 'OUTPUT0'"):
        target[0].write(target[1], np.zeros(1, np.float32))  # a request queued while its region went
    with pytest.raises(RegionNotFoundError, match="system shared memory region: 'r'"):
        shm.status("r")
    shm.unregister("r")  # unknown names are no error, as Triton


def test_close_releases_every_region(tmp_path):
    shm = SharedMemoryRegistry(tmp_path)
    make(tmp_path, "/k", b"\0" * 64)
    regions = [shm.register(name, "/k", 0, 64) for name in ("a", "b")]
    assert {r.name for r in shm.status()} == {"a", "b"}
    shm.close()
    assert len(shm) == 0 and all(r.closed and r._mapping.closed for r in regions)


def test_a_real_posix_object_in_dev_shm():
    if not SHM_DIR.is_dir():
        pytest.skip(reason="no /dev/shm on this system")
    key = f"/ferry_unit_{uuid.uuid4().hex}"
    fd = os.open(SHM_DIR / key[1:], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, np.float32([1, 2, 3, 4]).tobytes())
        shm = SharedMemoryRegistry()
        shm.register("real", key, 0, 16)
        assert shm.read(Placement("X", "real", 4, 8), FP32, (2,)).tolist() == [2.0, 3.0]
        shm.close()
    finally:
        os.close(fd)
        os.unlink(SHM_DIR / key[1:])


def test_placement_parameters_follow_triton():
    assert placement("T", {}) is None
    assert placement("T", {"shared_memory_region": "r", "shared_memory_byte_size": 8}) == Placement("T", "r", 0, 8)
    with pytest.raises(InvalidInputError, match="'shared_memory_byte_size' must be specified"):
        placement("T", {"shared_memory_region": "r"})
    with pytest.raises(InvalidInputError, match="can not be specified without 'shared_memory_region'"):
        placement("T", {"shared_memory_offset": 4})
    with pytest.raises(InvalidInputError, match="expected string_param"):
        placement("T", {"shared_memory_region": 3, "shared_memory_byte_size": 8})
    with pytest.raises(InvalidInputError, match="non-negative"):
        placement("T", {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": -1})
