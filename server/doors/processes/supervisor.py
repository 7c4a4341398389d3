"""The engine's hold on its front-end processes: start them, watch them, restart one that dies, stop them in order.

The public port is reserved first by a bound, never-listening SO_REUSEPORT socket, so `--grpc-port 0`
resolves to one port every front end then binds, and a restarted front end finds it free. A front end
that dies while the server serves is logged and restarted (its callers see their connection drop and
reconnect to a sibling); more than MAX_RESTARTS deaths within RESTART_WINDOW_S means something is wrong
with every start, and the server fails loudly instead: it drains and exits 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass

from server.doors.processes.engine_door import EngineDoor

log = logging.getLogger("ferry")
START_TIMEOUT_S = 120.0
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound SO_REUSEPORT socket holding `port` (0: a free one) for the front ends; it never listens."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


@dataclass(slots=True)
class _Process:
    index: int
    proc: asyncio.subprocess.Process
    watcher: asyncio.Task | None = None


class Frontends:
    def __init__(self, count: int, spec: dict, door: EngineDoor, on_failed):
        """`spec`: what every front end is told (process.py reads it); `on_failed()` stops the server."""
        self.count, self.spec, self.door = count, spec, door
        self._on_failed = on_failed
        self.processes: dict[int, _Process] = {}
        self._generation = 0
        self._deaths: list[float] = []
        self._stopping = False
        self.failed = False

    async def start(self) -> None:
        """Every front end started and connected, or RuntimeError naming the one that did not."""
        for index in range(self.count):
            await self._spawn(index)
        for index in range(self.count):
            await self._connected(index)

    async def _spawn(self, index: int) -> None:
        self._generation += 1
        arena = self.door.new_arena(index, self._generation)
        spec = {**self.spec, "index": index, "arena": str(arena) if arena else None,
                "tracing": self.door.tracing.active}  # later changes come as TRACING frames
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "server.doors.processes.process",
                                                    stdin=asyncio.subprocess.PIPE)
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        self.processes[index] = _Process(index, proc)

    async def _connected(self, index: int) -> None:
        process = self.processes[index]
        exited = asyncio.ensure_future(process.proc.wait())
        hello = self.door.hello[index]
        await asyncio.wait([exited, hello], timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        if not hello.done():
            exited.cancel()
            code = process.proc.returncode
            raise RuntimeError(f"front end process {index + 1} " + (f"exited with code {code} while starting"
                                                                if code is not None else "never connected to the engine"))
        exited.cancel()
        print(f"ferry: front end {index + 1} of {self.count} serving (pid {hello.result()})", flush=True)
        process.watcher = asyncio.get_running_loop().create_task(self._watch(process))

    async def _watch(self, process: _Process) -> None:
        code = await process.proc.wait()
        if self._stopping:
            return
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(self._deaths) > MAX_RESTARTS:
            log.critical("front end process %d (pid %d) exited with code %s: %d front-end deaths within %.0fs; "
                         "stopping the server", process.index + 1, process.proc.pid, code, len(self._deaths), RESTART_WINDOW_S)
            self.failed = True
            self._on_failed()
            return
        log.error("front end process %d (pid %d) exited with code %s; restarting it", process.index + 1, process.proc.pid, code)
        try:
            await self._spawn(process.index)
            await self._connected(process.index)
        except RuntimeError as exc:
            log.critical("%s; stopping the server", exc)
            self.failed = True
            self._on_failed()

    def drain(self) -> None:
        """SIGTERM every front end: each refuses new calls at once and exits once its admitted calls are answered."""
        self._stopping = True
        for process in self.processes.values():
            if process.proc.returncode is None:
                process.proc.send_signal(signal.SIGTERM)

    async def wait_stopped(self, timeout_s: float) -> None:
        procs = [p.proc for p in self.processes.values()]
        _, late = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=max(timeout_s, 1.0))
        for proc in procs:
            if proc.returncode is None:
                log.warning("front end process (pid %d) still running after the grace; killing it", proc.pid)
                proc.kill()
                await proc.wait()
        for process in self.processes.values():
            if process.watcher is not None:
                process.watcher.cancel()
