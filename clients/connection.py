"""Channels: plaintext or TLS, with the message limits KServe v2 clients assume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from clients import balancing

# Tensors can be large; tritonclient and the server both allow messages up to 2 GiB.
MESSAGE_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

Pem = str | Path | bytes  # a file path, or the PEM bytes themselves


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS for the channel. Without root certificates gRPC uses the system's trust store."""

    root_certificates: Pem | None = None
    private_key: Pem | None = None  # with certificate_chain: a client certificate (mutual TLS)
    certificate_chain: Pem | None = None
    server_name: str | None = None  # the name to verify when it differs from the URL's host

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(_read(self.root_certificates), _read(self.private_key),
                                            _read(self.certificate_chain))

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def tls_options(ssl: bool, root_certificates: Pem | None, private_key: Pem | None,
                certificate_chain: Pem | None, server_name: str | None) -> TlsOptions | None:
    """TLS when asked for or implied by any certificate option; None means plaintext."""
    if ssl or root_certificates or private_key or certificate_chain or server_name:
        return TlsOptions(root_certificates, private_key, certificate_chain, server_name)
    return None


def open_channel(url: str, tls: TlsOptions | None, asynchronous: bool = False):
    """A channel to one server, or balanced over several replicas (see clients/balancing.py)."""
    module = grpc.aio if asynchronous else grpc
    target = balancing.parse(url)
    options = MESSAGE_OPTIONS + target.channel_options()
    if tls is None:
        return module.insecure_channel(target.target, options=options)
    return module.secure_channel(target.target, tls.credentials(), options=options + tls.channel_options())


def _read(pem: Pem | None) -> bytes | None:
    if pem is None or isinstance(pem, bytes):
        return pem
    return Path(pem).read_bytes()
