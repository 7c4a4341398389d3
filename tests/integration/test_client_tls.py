"""TLS from both clients and the CLI, against a server started with --tls-cert/--tls-key (openssl makes the cert)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest

from clients import AsyncInferenceClient, FerryClientError, InferenceClient
from tests.conftest import ROOT, RunningServer, link_shipped_models

if shutil.which("openssl") is None:
    pytest.skip(reason="the openssl command is needed to make a self-signed certificate", allow_module_level=True)

NAME = "ferry.test"  # the certificate's only name: dialing 127.0.0.1 must override the name to verify


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={NAME}",
                    "-addext", f"subjectAltName=DNS:{NAME}"], check=True, capture_output=True)
    repo = tmp / "repo"
    repo.mkdir()
    link_shipped_models(repo, "simple")
    server = RunningServer(repo, "--tls-cert", str(cert), "--tls-key", str(key))
    yield server, cert, key
    server.stop()


def test_sync_client_verifies_the_server_certificate(tls_server):
    server, cert, key = tls_server
    with InferenceClient(server.address, root_certificates=cert, tls_server_name=NAME, timeout_s=30) as client:
        assert client.is_ready()
        a = np.ones((1, 16), np.float32)
        assert client.infer("simple", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
    # a client certificate is offered too (this server does not ask for one)
    with InferenceClient(server.address, root_certificates=cert.read_bytes(), private_key=key, certificate_chain=cert,
                         tls_server_name=NAME, timeout_s=30) as client:
        assert client.is_live()


def test_async_client_over_tls(tls_server):
    server, cert, _ = tls_server

    async def main():
        async with AsyncInferenceClient(server.address, root_certificates=cert.read_bytes(), tls_server_name=NAME,
                                        timeout_s=30) as client:
            return await client.server_metadata()

    assert asyncio.run(main()).name == "ferry"


@pytest.mark.parametrize("options", [
    {},  # plaintext to a TLS port
    {"ssl": True, "tls_server_name": NAME},  # the system's roots do not trust a self-signed certificate
    {"root_certificates": "CERT"},  # trusted, but 127.0.0.1 is not the certificate's name
], ids=["plaintext", "untrusted", "wrong-name"])
def test_refused_handshakes_are_unavailable(tls_server, options):
    server, cert, _ = tls_server
    options = {k: (cert if v == "CERT" else v) for k, v in options.items()}
    with InferenceClient(server.address, timeout_s=30, **options) as client, pytest.raises(FerryClientError) as info:
        client.is_live()
    assert info.value.status == grpc.StatusCode.UNAVAILABLE


def test_cli_over_tls(tls_server):
    server, cert, _ = tls_server
    done = subprocess.run([sys.executable, "-m", "server", "health", "--url", server.address, "--root-certs", str(cert),
                           "--tls-server-name", NAME], cwd=ROOT, check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "live yes, ready yes" in done.stdout
