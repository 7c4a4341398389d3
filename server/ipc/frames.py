"""Small framed messages over a unix stream socket: the links between Ferry's own processes.

Two users, one format: the front end <-> engine link (`FrameLink`, an asyncio protocol) and a Python
model process <-> its instance in the server (`FrameSocket`, blocking, for threads). A frame is a
4-byte little-endian length and a pickled tuple. Writes made during one turn of the
event loop go out as one `write` at its end, and a read parses every complete frame it received, so
under load one system call carries many requests or answers: the link costs a few microseconds a
request, far less than a second gRPC hop. Both ends are Ferry's own processes (the socket lives in a
private 0700 folder, or a socketpair made at spawn), so unpickling is safe here.
"""

from __future__ import annotations

import asyncio
import collections
import pickle
import socket
import struct
import threading

_LENGTH = struct.Struct("<I")
# Up to this size a frame's length and its pickle are joined into one piece (one system call); a larger
# frame (a tensor too large for the arena rides in it) goes out as two, so its pickle is never copied.
_JOIN_BYTES = 1 << 16
_IOV = 64  # pieces a blocked link's backlog writes with one sendmsg


class FrameLink(asyncio.Protocol):
    """One end of the link; `on_frame(frame)` is called for every frame received, in order."""

    def __init__(self, on_frame, on_lost=None):
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = bytearray()
        self._pending: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, frame: tuple) -> None:
        """Queue a frame; everything queued in this loop turn is written together."""
        if self.closed:
            return
        data = pickle.dumps(frame, protocol=5)
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(_LENGTH.pack(len(data)))
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self.closed and self.transport is not None:
            self.transport.write(b"".join(pending))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start, end = 0, len(buffer)
        while end - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            if end - start - 4 < size:
                break
            frame = pickle.loads(memoryview(buffer)[start + 4 : start + 4 + size])
            start += 4 + size
            self._on_frame(frame)
        del buffer[:start]

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._on_lost is not None:
            self._on_lost(exc)

    def close(self) -> None:
        self._flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def pack(frame: tuple) -> bytes:
    data = pickle.dumps(frame, protocol=5)
    return _LENGTH.pack(len(data)) + data


def _pieces(frame: tuple) -> tuple[bytes, ...]:
    """The frame as it goes out: its length and its pickle, joined only when small."""
    data = pickle.dumps(frame, protocol=5)
    head = _LENGTH.pack(len(data))
    return (head + data,) if len(data) <= _JOIN_BYTES else (head, data)


class FrameSocket:
    """A blocking end of a link, for threads: any thread may send (one lock), one thread receives.

    `recv` blocks in the kernel with the GIL released, so a thread waiting for a model process costs
    the event loop nothing. Once no thread reads any more, `attach` hands the link to an event loop:
    it reads with add_reader and writes without blocking (other threads' sends are passed to it), so
    no thread hop and no GIL hand-off stand between a frame and the loop that wants it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._lock = threading.Lock()
        self._buffer = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by attach
        self._loop_thread = 0
        self._out: collections.deque[memoryview] = collections.deque()  # what the loop could not write yet
        self._closed = False
        self._on_frame = self._on_lost = None

    @property
    def attached(self) -> bool:
        return self._loop is not None

    def send(self, frame: tuple) -> None:
        pieces = _pieces(frame)
        with self._lock:
            if self._loop is None:
                for piece in pieces:
                    self.sock.sendall(piece)
                return
        if threading.get_ident() == self._loop_thread:
            self._write(pieces)
        else:
            self._loop.call_soon_threadsafe(self._write, pieces)

    def recv(self) -> tuple | None:
        """The next frame, or None once the other end has closed (EOF). Threads only, before `attach`."""
        buffer = self._buffer
        while True:
            frame = self._next_frame()
            if frame is not None:
                return frame
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                return None
            if not chunk:
                return None
            buffer += chunk

    def _next_frame(self) -> tuple | None:
        buffer = self._buffer
        if len(buffer) >= 4:
            (size,) = _LENGTH.unpack_from(buffer, 0)
            if len(buffer) - 4 >= size:
                frame = pickle.loads(memoryview(buffer)[4 : 4 + size])
                del buffer[: 4 + size]
                return frame
        return None

    def attach(self, loop: asyncio.AbstractEventLoop, on_frame, on_lost) -> None:
        """On `loop`'s thread, once no thread reads: from now on the loop reads (`on_frame(frame)` for
        each, `on_lost()` at EOF) and writes."""
        with self._lock:
            self.sock.setblocking(False)
            self._loop, self._loop_thread = loop, threading.get_ident()
            self._on_frame, self._on_lost = on_frame, on_lost
        loop.add_reader(self.sock.fileno(), self._readable)
        self._deliver()  # frames that arrived with the last one a thread read

    def _readable(self) -> None:
        try:
            chunk = self.sock.recv(1 << 18)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._lose()
            return
        self._buffer += chunk
        self._deliver()

    def _deliver(self) -> None:
        while not self._closed and (frame := self._next_frame()) is not None:
            self._on_frame(frame)

    def _write(self, pieces: tuple[bytes, ...]) -> None:
        """What the socket does not take now waits as views of the pieces themselves: a frame that carries
        a large tensor is never copied again on its way out."""
        if self._closed:
            return
        if self._out:
            self._out.extend(map(memoryview, pieces))
            return
        for i, piece in enumerate(pieces):
            try:
                sent = self.sock.send(piece)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._lose()
                return
            if sent < len(piece):
                self._out.append(memoryview(piece)[sent:])
                self._out.extend(map(memoryview, pieces[i + 1 :]))
                self._loop.add_writer(self.sock.fileno(), self._writable)
                return

    def _writable(self) -> None:
        out = self._out
        try:
            sent = self.sock.sendmsg([out[i] for i in range(min(len(out), _IOV))])
        except BlockingIOError:
            return
        except OSError:
            self._lose()
            return
        while sent and sent >= out[0].nbytes:
            sent -= out.popleft().nbytes
        if sent:
            out[0] = out[0][sent:]
        if not out:
            self._loop.remove_writer(self.sock.fileno())

    def _lose(self) -> None:
        if not self._closed:
            self._close_now()
            self._on_lost()

    def _close_now(self) -> None:
        if self._loop is not None and not self._closed:
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def close(self) -> None:
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self._close_now()
            return
        try:
            self._loop.call_soon_threadsafe(self._close_now)
        except RuntimeError:  # the loop is closed: nothing reads or writes any more
            self._closed = True
            self.sock.close()
