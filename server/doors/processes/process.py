"""One front-end process (`python -m server.doors.processes.process`, started by the engine with its spec on stdin).

It serves the public gRPC port beside its siblings (SO_REUSEPORT: the kernel spreads connections over
them), applies the same TLS, message limits, tokens and drain gate as the one-process server, answers
ModelInfer through the arena link (infer.py) and relays everything else to the engine (proxy.py).
Drain is the engine's to order, so the port answers exactly as one process does: SIGTERM (sent when
the engine starts draining) closes the gate at once (new calls UNAVAILABLE, probes still relayed);
the STOP frame (sent once the engine has answered or cut off everything admitted) starts the same
ending as app.py's: wait for callers to leave, stop gRPC, exit 0. SIGINT is ignored: a terminal's
Ctrl-C reaches the whole process group, and the engine orders the shutdown. If the engine goes away,
the process exits 1 (its calls are answered UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import grpc

from server import event_loop
from server.ipc.arena import Arena
from server.doors.processes.infer import METHOD, EngineLink, FrontInfer
from server.doors.processes.proxy import Relay
from server.doors.access import AccessPolicy
from server.doors.grpc.auth import AccessCheck
from server.doors.grpc.drain import DrainGate
from server.doors.grpc.gates import ServiceHandlers, serve_behind
from server.doors.grpc.passthrough import MalformedBodies
from server.doors.tokens import Tokens

log = logging.getLogger("ferry.frontend")
QUIET_S = 1.0  # as app.QUIET_S: no refused call for this long means callers have left
SERVICE = "inference.GRPCInferenceService"


def _server(spec: dict) -> grpc.aio.Server:
    limit = spec["max_message_bytes"]
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
               ("grpc.so_reuseport", 1)]  # the default on Linux; said here because the design depends on it
    return grpc.aio.server(options=options, maximum_concurrent_rpcs=spec["max_concurrent_rpcs"])


def _bind(server: grpc.aio.Server, spec: dict) -> int:
    address = f"{spec['host']}:{spec['port']}"
    if spec["tls_cert"] and spec["tls_key"]:
        ca = Path(spec["tls_ca"]).read_bytes() if spec["tls_ca"] else None
        credentials = grpc.ssl_server_credentials(
            [(Path(spec["tls_key"]).read_bytes(), Path(spec["tls_cert"]).read_bytes())],
            root_certificates=ca, require_client_auth=ca is not None)
        return server.add_secure_port(address, credentials)
    return server.add_insecure_port(address)


async def serve(spec: dict) -> int:
    loop = asyncio.get_running_loop()
    log.info("front end %d: event loop: %s", spec["index"] + 1, event_loop.name(loop))
    engine_lost, stop, grace = asyncio.Event(), asyncio.Event(), [spec["drain_grace_s"]]

    def on_stop(grace_s: float) -> None:
        grace[0] = grace_s
        stop.set()

    arena = Arena(Path(spec["arena"]), spec["arena_bytes"], create=False) if spec["arena"] else None
    link = EngineLink(arena, engine_lost.set, on_stop)
    link.tracing = spec.get("tracing", False)
    await loop.create_unix_connection(lambda: link.frames, spec["door"])
    unlimited = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channel = grpc.aio.insecure_channel(f"unix:{spec['engine']}", options=unlimited)
    gate = DrainGate()
    access = AccessPolicy(Tokens(tuple(t.encode() for t in spec["auth"]), tuple(t.encode() for t in spec["admin"])),
                          {category: (header, value.encode()) for category, header, value in spec["restricted"]})
    server = _server(spec)
    relay = Relay(channel, skip=frozenset({METHOD}))
    front = FrontInfer(link, relay, MalformedBodies())
    services = ServiceHandlers()  # behind the gates, no method registered (server/doors/grpc/gates.py says why)
    services.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ModelInfer": front.handler()}),
                                       relay))
    serve_behind(server, services, [AccessCheck(access), gate] if access.enabled else [gate])
    if _bind(server, spec) != spec["port"]:
        log.error("front end %d could not bind port %d", spec["index"], spec["port"])
        return 1
    await server.start()
    link.frames.send(("hello", spec["index"], os.getpid()))
    loop.add_signal_handler(signal.SIGTERM, gate.close)
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    done, _ = await asyncio.wait([loop.create_task(stop.wait()), loop.create_task(engine_lost.wait())],
                                 return_when=asyncio.FIRST_COMPLETED)
    if engine_lost.is_set():
        log.error("front end %d: the engine process went away; exiting", spec["index"])
        await server.stop(0)
        return 1
    await _drain(server, gate, grace[0])
    if link.requests is not None and link.requests.used:  # every answered call's blocks should be back by now
        log.warning("front end %d: %d bytes of the arena's request half still held at stop", spec["index"] + 1,
                    link.requests.used)
    await channel.close()
    link.frames.close()
    return 0


async def _drain(server: grpc.aio.Server, gate: DrainGate, grace_s: float) -> None:
    """As app.py's drain once admitted work is answered: wait for callers to leave, then stop gRPC."""
    began = asyncio.get_running_loop().time()
    gate.close()  # already closed by SIGTERM, unless the engine stopped us without one
    await gate.quiet(QUIET_S, grace_s)
    await server.stop(max(1.0, grace_s - (asyncio.get_running_loop().time() - began)))


def main() -> None:
    spec = json.load(sys.stdin)
    logging.basicConfig(level=spec["log_level"], format=f"%(asctime)s %(levelname)s %(name)s[{spec['index']}]: %(message)s")
    raise SystemExit(event_loop.run(serve(spec), spec["event_loop"]))


if __name__ == "__main__":
    main()
