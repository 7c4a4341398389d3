"""Where a gRPC server finds a call's handler: the services' handlers behind the server's gates (drain, access).

A gate decides from the method and the metadata alone, so it is applied where gRPC looks the method up,
as a plain call, not as a grpc.aio interceptor: grpc.aio runs interceptors as coroutines, its own chain
for each call (two coroutines and a partial for one interceptor) and the interceptor's own, on the
event loop every request shares.

Services are added through `ServiceHandlers` rather than to the server, so that none of their methods
is registered with gRPC's registered-method path: grpc.aio's server loop (grpcio 1.6x-1.8x) keeps one
pending call request per registered method and, for every call it accepts, waits on all of them at
once (asyncio.wait over ~26 futures for Ferry's services: about 7 us of the loop per call, measured),
where the generic path waits on one. Registration only saves the core a lookup of the method's name.
"""

from __future__ import annotations

from typing import Protocol

import grpc


class Gate(Protocol):
    def gate(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        """The handler to run: `handler` itself, or one that refuses the call (None: no such method)."""


class ServiceHandlers:
    """Stands in for the server while services are added (generated `add_*_to_server` functions, reflection):
    keeps their generic handlers, registers nothing (see the module's docstring)."""

    def __init__(self):
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        """Not registered: each service's generic handler already holds these methods."""


class GatedHandlers(grpc.GenericRpcHandler):
    """The services' handlers, each call's passed through the gates. `gates` in interceptor order: the first
    one's refusal is the one a refused call gets (it sees what the later ones returned)."""

    def __init__(self, handlers: list[grpc.GenericRpcHandler], gates: list[Gate] = ()):
        self._handlers = tuple(handlers)
        self._gates = tuple(reversed(gates))
        self._found: dict[str, grpc.RpcMethodHandler] = {}  # method -> its handler, once looked up (the services are fixed)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._found.get(details.method)
        if handler is None:  # first call of a method, or no such method (those are not kept: any name may come)
            for handlers in self._handlers:
                handler = handlers.service(details)
                if handler is not None:
                    self._found[details.method] = handler
                    break
        for gate in self._gates:
            handler = gate.gate(details, handler)
        return handler


def serve_behind(server: grpc.aio.Server, services: ServiceHandlers, gates: list[Gate] = ()) -> None:
    """Put every service added to `services` on `server`, behind `gates`."""
    server.add_generic_rpc_handlers((GatedHandlers(services.handlers, gates),))
