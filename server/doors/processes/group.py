"""Everything `--frontend-processes N` (N >= 2) adds to the engine process, behind one object app.py drives.

The engine keeps its gRPC server, bound on a unix socket in a private 0700 folder (the front ends relay
to it), and adds the arena link (engine_door.py) and the front-end processes (supervisor.py), which
serve the public port.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from server.doors.drain import Drain
from server.doors.processes.engine_door import EngineDoor
from server.doors.processes.supervisor import Frontends, reserve_port
from server.repository.registry import Registry
from server.doors.grpc.server import RpcOptions
from server.doors.access import AccessPolicy
from server.doors.ports import check_free, claiming

DEFAULT_ARENA_BYTES = 64 * 2**20  # per front end: half for requests, half for answers; fuller means inline


class FrontendGroup:
    def __init__(self, count: int, rpc: RpcOptions, access: AccessPolicy, grace_s: float, arena_bytes: int, loop: str,
                 registry: Registry, drain: Drain, on_failed, tracing=None):
        """`tracing`: the server's TraceControl; calls the front ends decode are traced in this process."""
        check_free("gRPC", rpc.host, rpc.port)  # the front ends share the port (SO_REUSEPORT) only among themselves
        with claiming("gRPC", rpc.host, rpc.port):
            self._reserved = reserve_port(rpc.host, rpc.port)
        self.folder = Path(tempfile.mkdtemp(prefix="ferry-"))  # 0700: only this user reaches the engine's sockets
        self.engine_socket = self.folder / "engine.sock"
        self.rpc = rpc
        self.port = self._reserved.getsockname()[1]
        self.door = EngineDoor(registry, drain, self.folder, arena_bytes, tracing)
        spec = {
            "host": rpc.host, "port": self.port, "max_message_bytes": rpc.max_message_bytes,
            "max_concurrent_rpcs": rpc.max_concurrent_rpcs, "tls_cert": _path(rpc.tls_cert),
            "tls_key": _path(rpc.tls_key), "tls_ca": _path(rpc.tls_ca),
            "auth": [t.decode() for t in access.tokens.inference], "admin": [t.decode() for t in access.tokens.admin],
            "restricted": [[category, header, value.decode()] for category, (header, value) in access.restricted.items()],
            "door": str(self.door.path), "engine": str(self.engine_socket), "arena_bytes": arena_bytes,
            "drain_grace_s": grace_s, "log_level": logging.getLevelName(logging.getLogger().level), "event_loop": loop,
        }
        self.frontends = Frontends(count, spec, self.door, on_failed)

    @property
    def failed(self) -> bool:
        return self.frontends.failed

    async def start(self) -> None:
        """The engine's private gRPC server must be serving on `engine_socket` already."""
        await self.door.start()
        await self.frontends.start()

    def release(self) -> None:
        """Give the port and the folder back without having started (another door's port was taken)."""
        self._reserved.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def drain(self) -> None:
        """Every front end refuses new calls from now on (its probes still relayed)."""
        self.frontends.drain()

    async def stop(self, grace_s: float) -> None:
        """Admitted work is answered: front ends wait for callers to leave within `grace_s`, stop, and exit."""
        self.door.stop_frontends(grace_s)
        await self.frontends.wait_stopped(grace_s + 10.0)
        await self.door.stop()
        self._reserved.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _path(path: Path | None) -> str | None:
    return str(path) if path is not None else None
