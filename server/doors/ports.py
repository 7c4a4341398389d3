"""The ports `ferry serve` binds, and the one line it ends with when one of them cannot be had.

Triton prints one line naming the service and the address and exits non-zero when a port is taken; so
does Ferry, for each door (gRPC, HTTP, metrics, the front-end processes' public port), before any model
loads. Each door binds inside `claiming`, which turns the OS's refusal into `PortUnavailable`; app.run
closes what it had bound, and __main__ prints the message and exits 1 (no traceback: nothing is wrong
with Ferry, the machine is busy).
"""

from __future__ import annotations

import contextlib
import socket


class PortUnavailable(Exception):
    def __init__(self, service: str, host: str, port: int, reason: str):
        super().__init__(f"ferry: cannot serve {service} on {host}:{port}: {reason}")


@contextlib.contextmanager
def claiming(service: str, host: str, port: int):
    """Bind inside this block: an OSError (EADDRINUSE, EACCES, EADDRNOTAVAIL) becomes PortUnavailable."""
    try:
        yield
    except OSError as exc:
        raise PortUnavailable(service, host, port, _reason(exc)) from None


def refusal(host: str, port: int) -> str:
    """Why a plain socket cannot bind (host, port): for binders that do not say (grpcio raises a bare
    RuntimeError), asked after they failed."""
    with _probe(host) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            return _reason(exc)
    return "the address could not be bound"


def check_free(service: str, host: str, port: int) -> None:
    """Raise PortUnavailable unless (host, port) can be bound by a socket that shares it with no one: before
    binders that set SO_REUSEPORT themselves (the front-end processes), which would otherwise share a port
    some other program of this user listens on, and before grpcio, which logs its own error line first."""
    if port == 0:
        return
    with _probe(host) as probe, claiming(service, host, port):
        probe.bind((host, port))


def _probe(host: str) -> socket.socket:
    """A socket that binds where a server's would: SO_REUSEADDR, as every door sets, so connections of a
    previous run left in TIME_WAIT do not count as the port in use (a listener still does)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()
