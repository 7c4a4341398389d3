"""The shared memory a front end and the engine pass tensors through: one file in /dev/shm, mapped by both.

Its first half carries requests (the front end allocates there and writes each input once; the engine
reads numpy views straight from it and says when the last view is gone); its second half carries
answers (the engine allocates and writes each output once; the front end copies it into the reply and
frees it). Each half has exactly one allocating process, so no lock crosses processes: a free is a
message on the link. The file is reserved with posix_fallocate at creation, so a full /dev/shm is an
error at start (then tensors travel inline in the frames) rather than a SIGBUS on first touch, and it
is unlinked once both sides have mapped it, so nothing is left behind whatever happens to them.
"""

from __future__ import annotations

import bisect
import mmap
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
ALIGN = 64  # a cache line: numpy views of any dtype start aligned


class Arena:
    def __init__(self, path: Path, size: int, create: bool):
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)
            self.mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.path, self.size = path, size
        self.view = memoryview(self.mapping)

    @property
    def half(self) -> int:
        return self.size // 2

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class Allocator:
    """First fit over [start, start + size), in ALIGN-byte units; neighbours merge when freed.

    `allocate` answers None when nothing fits (the caller sends the tensor inline instead): a full arena
    slows a burst of large tensors down, it never refuses one."""

    def __init__(self, start: int, size: int):
        self._starts = [start] if size >= ALIGN else []  # free blocks, sorted by offset
        self._sizes = {start: size - size % ALIGN} if size >= ALIGN else {}
        self._used: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, start in enumerate(self._starts):
            size = self._sizes[start]
            if size >= need:
                del self._starts[i]
                del self._sizes[start]
                if size > need:
                    self._starts.insert(i, start + need)
                    self._sizes[start + need] = size - need
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect(self._starts, offset)
        if i < len(self._starts) and offset + size == self._starts[i]:  # merge with the next free block
            size += self._sizes.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == offset:  # ... and the previous
            self._sizes[self._starts[i - 1]] += size
            return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    @property
    def used(self) -> int:
        return sum(self._used.values())
