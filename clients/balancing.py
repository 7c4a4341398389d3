"""One client, several replicas: which gRPC target a `--url` names, and the service config that makes
gRPC itself spread calls over the replicas and step around one that is draining or dead.

A single HOST:PORT is dialled as before. Several addresses (`h1:p1,h2:p2`), a `dns:///name:port` (a
Kubernetes headless Service answers with every ready pod) or an explicit `ipv4:`/`ipv6:` list get:
- `round_robin`: one connection per replica, calls in turn over the ready ones (the default,
  pick_first, would pin every call to one replica);
- `healthCheckConfig`: each connection watches grpc.health.v1, so a replica that reports NOT_SERVING
  (Ferry does on SIGTERM) leaves the rotation before its process goes away;
- a retry policy on UNAVAILABLE: a call refused by a draining replica, or lost with a connection before
  any answer came, is sent again, to the next replica. gRPC never retries once a response has started,
  so no request is executed twice by a replica that answered.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass

RETRIED_SERVICES = ("inference.GRPCInferenceService", "ferry.generate.v1.Generation")
MAX_ATTEMPTS = 5  # gRPC caps attempts at 5 whatever the policy asks


@dataclass(frozen=True, slots=True)
class Target:
    """What the channel dials, and the replicas behind it (for per-replica statistics)."""

    target: str
    replicas: tuple[str, ...]
    balanced: bool

    def channel_options(self) -> list[tuple[str, object]]:
        if not self.balanced:
            return []
        return [("grpc.service_config", service_config()), ("grpc.enable_retries", 1)]


def parse(url: str) -> Target:
    """`HOST:PORT`, `H1:P1,H2:P2,...`, `dns:///NAME:PORT`, `ipv4:A:P,...` or `ipv6:[A]:P,...`."""
    url = url.strip()
    if url.startswith(("dns:", "ipv4:", "ipv6:")):
        return Target(url, (), True)
    parts = [p.strip() for p in url.split(",") if p.strip()]
    if len(parts) < 2:
        return Target(url, (url,), False)
    resolved = [_numeric(part) for part in parts]
    families = {":" in host for host, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"--url {url!r}: mixes IPv4 and IPv6 addresses; gRPC balances over one family")
    if families == {True}:
        addresses = [f"[{host}]:{port}" for host, port in resolved]
        return Target("ipv6:" + ",".join(addresses), tuple(addresses), True)
    addresses = [f"{host}:{port}" for host, port in resolved]
    return Target("ipv4:" + ",".join(addresses), tuple(addresses), True)


def replicas(target: Target) -> list[str]:
    """Each replica's own HOST:PORT: listed ones as given, a DNS name resolved now (as gRPC resolves it)."""
    if target.replicas:
        return list(target.replicas)
    scheme, _, rest = target.target.partition(":")
    if scheme in ("ipv4", "ipv6"):
        return [a.strip() for a in rest.split(",") if a.strip()]
    host, port = _split(rest.lstrip("/").rpartition("/")[2], default_port="443")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    found = {info[4][0] for info in infos}
    return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in found)


def service_config(max_attempts: int = MAX_ATTEMPTS, balanced: bool = True) -> str:
    """`balanced=False`: the retry policy alone, for one address that is itself a balancer (an L7 proxy
    sends the retried call to another replica)."""
    balancing = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": ""},  # "" is Ferry's readiness: NOT_SERVING while loading or draining
    }
    return json.dumps({
        **(balancing if balanced else {}),
        "methodConfig": [{
            "name": [{"service": s} for s in RETRIED_SERVICES],
            "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.05s", "maxBackoff": "1s",
                            "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
        }],
    })


def _numeric(address: str) -> tuple[str, str]:
    host, port = _split(address)
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0], port


def _split(address: str, default_port: str | None = None) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or "]" in port:
        if default_port is None:
            raise ValueError(f"--url: {address!r} has no port (expected HOST:PORT)")
        host, port = address, default_port
    return host.strip("[]"), port
