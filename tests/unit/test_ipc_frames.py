"""A frame carrying a tensor too large for the arena (Triton's bls_memory sends 1 GiB through BLS) costs its
sender one copy of the tensor, the pickle: the record does not copy it first, the frame's length is not
joined to it, and what a non-blocking socket does not take at once waits as a view of the pickle. Counted
with tracemalloc in the sending process; another process reads the frame and answers what it got."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tracemalloc

import numpy as np

from server.ipc import tensors
from server.ipc.frames import FrameSocket
from tests.conftest import ROOT

SIZE = 64 << 20  # bytes: beyond any arena, so the tensor rides in the frame
PEER = """
import socket, sys
from server.ipc.frames import FrameSocket
link = FrameSocket(socket.socket(fileno=int(sys.argv[1])))
record = link.recv()[1]
link.send(("got", record[3], bytes(record[5][:8]), type(record[5]).__name__))
link.recv()  # until the test closes its end
"""


def _linked() -> tuple[FrameSocket, subprocess.Popen]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=ROOT)
    theirs.close()
    return FrameSocket(ours), peer


def _expected(array: np.ndarray) -> tuple:
    return ("got", SIZE, array[:2].tobytes(), "bytearray")  # a bytearray: the reader's array is writable


def _peak_of(run) -> int:
    """Bytes allocated at the peak of `run()`, beyond what was allocated before it."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_blocking_link_sends_a_large_tensor_with_one_copy_of_it():
    link, peer = _linked()
    array = np.arange(SIZE // 4, dtype=np.float32)
    try:
        peak = _peak_of(lambda: link.send(("T", tensors.put("x", array, None, None))))
        assert link.recv() == _expected(array)
    finally:
        link.close()
        peer.wait(30)
    # the pickle, grown in steps of half its size: 1.5 copies at most (it was 3: the record's copy, the
    # pickle and the pickle joined to its length)
    assert peak < 1.75 * SIZE, f"{peak / SIZE:.2f} copies of the tensor"


def test_a_link_read_by_an_event_loop_keeps_what_the_socket_did_not_take_as_a_view():
    link, peer = _linked()
    array = np.arange(SIZE // 4, dtype=np.float32)
    loop = asyncio.new_event_loop()
    answered = loop.create_future()
    try:
        link.attach(loop, answered.set_result, lambda: answered.done() or answered.set_exception(EOFError()))

        def run():
            link.send(("T", tensors.put("x", array, None, None)))  # on the loop's thread: written at once
            assert link._out, "the socket took the whole frame at once: nothing was left to wait"
            loop.run_until_complete(answered)  # the loop writes the rest as the peer reads it

        peak = _peak_of(run)
        assert answered.result() == _expected(array)
    finally:
        link.close()
        loop.close()
        peer.wait(30)
    # the pickle again (it was 4: the record's copy, the pickle joined to its length, the part the socket did
    # not take cut from that, and the part appended to the link's backlog)
    assert peak < 1.75 * SIZE, f"{peak / SIZE:.2f} copies of the tensor"
