"""BLS from a forked child of a model process: model code that runs a `multiprocessing.Pool` inside
execute and calls other models from its workers (Triton's bls suite does, in test_multiprocess).

A forked child cannot use its parent's link to the server: the thread that reads it stayed behind in
the parent, and two processes writing one socket would interleave their frames. So every fork gets a
socketpair of its own, made just before the fork. The child talks over its end as if it were the
server's link; in the parent a relay thread forwards the child's calls over the parent's link under
refs of the parent's own, and the answers back under the child's. Tensors reach the child inline in
the frame: the arena's blocks are the parent's to allocate and free, and a child that allocated from
its copy of the parent's allocator would hand out blocks the parent also uses.
"""

from __future__ import annotations

import os
import socket
import threading

from server.backends.python import protocol as p
from server.ipc import tensors as ipc_tensors
from server.ipc.frames import FrameSocket

_ASKS = {p.CALL, p.CONTROL, p.METRIC}  # frames whose second item is a ref the server answers with CALLED


class Forks:
    """The relays of one model process's forked children (and, in a child, what it forks in turn)."""

    def __init__(self, host):
        self._host = host
        self._ends: tuple[socket.socket, socket.socket] | None = None
        self._relayed: dict[int, tuple[FrameSocket, int, dict[int, int]]] = {}  # our ref -> (child, its ref, map)
        self._lock = threading.Lock()
        os.register_at_fork(before=self._before, after_in_parent=self._in_parent, after_in_child=self._in_child)

    def _before(self) -> None:
        self._ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def _in_parent(self) -> None:
        ours, theirs = self._ends
        self._ends = None
        theirs.close()
        threading.Thread(target=self._relay, args=(FrameSocket(ours),), name="ferry-fork-relay", daemon=True).start()

    def _in_child(self) -> None:
        ours, theirs = self._ends
        self._ends = None
        ours.close()
        self._relayed = {}  # the parent's children are not this process's
        self._lock = threading.Lock()
        self._host.forked(FrameSocket(theirs))

    def _relay(self, child: FrameSocket) -> None:
        """In the parent, one thread per child, until the child's end closes (it exited)."""
        host = self._host
        ours_of: dict[int, int] = {}  # the child's refs -> ours
        while (frame := child.recv()) is not None:
            kind = frame[0]
            if kind in _ASKS:
                ref = host.next_ref()
                with self._lock:
                    ours_of[frame[1]] = ref
                    self._relayed[ref] = (child, frame[1], ours_of)
                host.ask((kind, ref, *frame[2:]))
            elif kind == p.UNCALL and frame[1] in ours_of:
                host.link.send((p.UNCALL, ours_of[frame[1]]))
            elif kind == p.LOG:
                host.link.send(frame)
        child.close()

    def called(self, ref: int, reply: tuple | None, final: bool) -> bool:
        """A CALLED frame for a child's call goes on to that child (True); any other is the host's (False)."""
        with self._lock:
            relayed = self._relayed.get(ref)
            if relayed is None:
                return False
            child, theirs, ours_of = relayed
            if final:
                del self._relayed[ref]
                ours_of.pop(theirs, None)
        if reply is not None:
            outputs, error, parameters = reply
            reply = ([self._inline(t) for t in outputs], error, parameters)
        try:
            child.send((p.CALLED, theirs, reply, final))
        except OSError:  # the child is gone: nobody waits for this answer
            pass
        return True

    def _inline(self, tensor: tuple) -> tuple:
        """A tensor of an answer, in the frame: read out of its block (which the parent's view frees once
        dropped, as for any answer it reads)."""
        if tensor[4] is None:
            return tensor
        return tuple(ipc_tensors.put(tensor[0], self._host.view(tensor), None, None))
