"""The grpc.aio server: bind, message limits, health, reflection, TLS."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server.doors.grpc import passthrough
from server.doors.grpc.gates import Gate, ServiceHandlers, serve_behind
from server.doors.ports import PortUnavailable, check_free, refusal

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Triton and tritonclient allow messages up to INT32_MAX; Python's default receive limit is 4 MiB.
MAX_MESSAGE_BYTES = 2**31 - 1
# A health service name that answers SERVING for as long as the process serves gRPC, loading and draining
# included: what a liveness probe asks (deploy/kubernetes). "" and the API services track readiness instead.
LIVENESS_SERVICE = "liveness"


@dataclass(frozen=True, slots=True)
class RpcOptions:
    host: str = "127.0.0.1"
    port: int = 8001
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_concurrent_rpcs: int | None = 16_384  # beyond this gRPC answers RESOURCE_EXHAUSTED itself
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None  # set: mutual TLS, clients must present a certificate signed by it
    unix_socket: Path | None = None  # set: serve only here, privately (front-end processes serve host:port)


class RpcServer:
    def __init__(self, options: RpcOptions, servicers: list[tuple[object, callable, str]],
                 gates: list[Gate] = ()):
        """`servicers`: (servicer, add_to_server function, full service name) for every service;
        `gates` decide every call first, in order (authentication, the drain gate; server/doors/grpc/gates.py)."""
        limit = options.max_message_bytes
        # grpcio sets SO_REUSEPORT on Linux by default: a second server would then share a port another one
        # listens on, each getting some of its connections. Off, as Triton's --reuse-grpc-port defaults.
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=options.max_concurrent_rpcs,
        )
        services = ServiceHandlers()  # every service behind the gates, none registered (gates.py says why)
        names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.malformed = passthrough.MalformedBodies()
        for servicer, _, name in servicers:  # parsed inside Ferry's handlers: a bad body is INVALID_ARGUMENT
            passthrough.add_service(servicer, name, services, self.malformed)
            names.append(name)
        self.health = health.aio.HealthServicer()  # looked up after the inference services, which most calls are for
        health_pb2_grpc.add_HealthServicer_to_server(self.health, services)
        self._served = [n for n in names if n not in (health.SERVICE_NAME, reflection.SERVICE_NAME)]
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(names), services)
        serve_behind(self.server, services, gates)
        self.port = self._bind(options)
        self.host = options.host

    def _bind(self, options: RpcOptions) -> int:
        address = f"{options.host}:{options.port}"
        if options.unix_socket is not None:  # reached only by this server's own front-end processes
            return self.server.add_insecure_port(f"unix:{options.unix_socket}")
        check_free("gRPC", options.host, options.port)  # before grpcio, which would log its own error first
        try:
            if options.tls_cert and options.tls_key:
                ca = options.tls_ca.read_bytes() if options.tls_ca else None
                credentials = grpc.ssl_server_credentials([(options.tls_key.read_bytes(), options.tls_cert.read_bytes())],
                                                          root_certificates=ca, require_client_auth=ca is not None)
                return self.server.add_secure_port(address, credentials)
            return self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio says only "Failed to bind"
            raise PortUnavailable("gRPC", options.host, options.port, refusal(options.host, options.port)) from None

    async def start(self) -> None:
        # grpcio's health servicer starts "" as SERVING; nothing is ready until set_serving(True).
        await self.set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._served]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


def inference_service(servicer) -> tuple[object, callable, str]:
    return servicer, pb_grpc.add_GRPCInferenceServiceServicer_to_server, INFERENCE_SERVICE
