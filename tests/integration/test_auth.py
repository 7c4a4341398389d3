"""Authentication and authorization (issue 18, row 10): bearer tokens with separate inference and admin
rights, open probes, and mutual TLS. Every refusal is checked for its status, from our stubs, our
clients and CLI, and tritonclient (in a subprocess: its protobuf messages cannot share our process)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients import FerryClientError, InferenceClient
from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import ROOT, RunningServer, link_shipped_models

INFER_TOKEN, ADMIN_TOKEN = "infer-secret", "admin-secret"
A = np.arange(16, dtype=np.float32).reshape(1, 16)
SIMPLE = {"INPUT0": A, "INPUT1": np.ones_like(A)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "infer.tokens").write_text(f"# inference clients\n{INFER_TOKEN}\n\n")
    (tmp / "admin.tokens").write_text(ADMIN_TOKEN + "\n")
    repo = tmp / "repo"
    repo.mkdir()
    link_shipped_models(repo, "simple")
    # explicit model control: the load/unload rights are what these tests check (the default refuses them all)
    running = RunningServer(repo, "--auth-token-file", str(tmp / "infer.tokens"),
                            "--admin-token-file", str(tmp / "admin.tokens"), "--model-control-mode", "explicit",
                            "--load-model", "*")
    yield running
    running.stop()


def bearer(token: str | None):
    return None if token is None else (("authorization", f"Bearer {token}"),)


def code_of(call) -> grpc.StatusCode:
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


@pytest.mark.parametrize("token, expected", [
    (None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED),
    (INFER_TOKEN, grpc.StatusCode.OK), (ADMIN_TOKEN, grpc.StatusCode.OK),
], ids=["no-token", "wrong-token", "inference-token", "admin-token"])
def test_inference_metadata_and_reflection_need_a_valid_token(server, token, expected):
    stub = kserve.stub(server.channel)
    md = bearer(token)
    assert code_of(lambda: stub.ModelInfer(kserve.request("simple", SIMPLE), metadata=md, timeout=30)) == expected
    assert code_of(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="simple"), metadata=md, timeout=30)) == expected
    assert code_of(lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=md, timeout=30)) == expected
    reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    listing = reflection_pb2.ServerReflectionRequest(list_services="")
    assert code_of(lambda: list(reflect.ServerReflectionInfo(iter([listing]), metadata=md, timeout=30))) == expected


def test_probes_stay_open_without_a_token(server):
    stub = kserve.stub(server.channel)
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
    check = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_model_control_needs_the_admin_token(server):
    stub = kserve.stub(server.channel)
    unload = pb.RepositoryModelUnloadRequest(model_name="simple")
    for token, expected in ((None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED),
                            (INFER_TOKEN, grpc.StatusCode.PERMISSION_DENIED)):
        try:
            stub.RepositoryModelUnload(unload, metadata=bearer(token), timeout=30)
            raise AssertionError(f"unload with {token!r} was allowed")
        except grpc.RpcError as err:
            assert err.code() == expected
            assert err.details()  # a message a person can act on
    assert stub.ModelReady(pb.ModelReadyRequest(name="simple"), metadata=bearer(INFER_TOKEN), timeout=30).ready

    stub.RepositoryModelUnload(unload, metadata=bearer(ADMIN_TOKEN), timeout=60)
    assert not stub.ModelReady(pb.ModelReadyRequest(name="simple"), metadata=bearer(INFER_TOKEN), timeout=30).ready
    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="simple"), metadata=bearer(ADMIN_TOKEN), timeout=60)
    assert stub.ModelReady(pb.ModelReadyRequest(name="simple"), metadata=bearer(INFER_TOKEN), timeout=30).ready


def test_log_settings_need_the_admin_token(server):
    stub = kserve.stub(server.channel)
    for token, expected in ((None, grpc.StatusCode.UNAUTHENTICATED), (INFER_TOKEN, grpc.StatusCode.PERMISSION_DENIED),
                            (ADMIN_TOKEN, grpc.StatusCode.OK)):
        md = bearer(token)
        assert code_of(lambda md=md: stub.LogSettings(pb.LogSettingsRequest(), metadata=md, timeout=30)) == expected
    assert http_status(server, "/v2/logging", INFER_TOKEN) == 403
    assert http_status(server, "/v2/logging", ADMIN_TOKEN) == 200


def test_our_client_and_cli_send_the_token(server):
    with InferenceClient(server.address, timeout_s=30, token=INFER_TOKEN) as client:
        assert client.infer("simple", SIMPLE)["OUTPUT0"].tolist() == (A + 1).tolist()
        with pytest.raises(FerryClientError) as info:
            client.unload_model("simple")
        assert info.value.status == grpc.StatusCode.PERMISSION_DENIED
    with InferenceClient(server.address, timeout_s=30, headers={"authorization": "Bearer nope"}) as client:
        with pytest.raises(FerryClientError) as info:
            client.model_metadata("simple")
        assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
    cli = [sys.executable, "-m", "server", "models", "--url", server.address]
    refused = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0 and "token" in refused.stderr
    done = subprocess.run([*cli, "--token", INFER_TOKEN], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "simple" in done.stdout, done.stderr


TRITON = """
import sys, numpy as np, tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException
client = tc.InferenceServerClient(sys.argv[1])
a = np.arange(16, dtype=np.float32).reshape(1, 16)
inputs = [tc.InferInput("INPUT0", [1, 16], "FP32"), tc.InferInput("INPUT1", [1, 16], "FP32")]
inputs[0].set_data_from_numpy(a); inputs[1].set_data_from_numpy(np.ones_like(a))
def status(call):
    try:
        call(); return "OK"
    except InferenceServerException as e:
        return e.status()
print(status(lambda: client.infer("simple", inputs)))
print(status(lambda: client.infer("simple", inputs, headers={"authorization": "Bearer %s"})))
print(status(lambda: client.unload_model("simple", headers={"authorization": "Bearer %s"})))
print(client.is_server_live())
"""


def test_tritonclient_passes_the_token_with_headers(server):
    if importlib.util.find_spec("tritonclient") is None:  # never imported here: its protobufs clash with ours
        pytest.skip(reason="tritonclient is not installed")
    script = TRITON % (INFER_TOKEN, INFER_TOKEN)
    done = subprocess.run([sys.executable, "-c", script, server.address], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["StatusCode.UNAUTHENTICATED", "OK", "StatusCode.PERMISSION_DENIED", "True"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes the certificates")
def test_mutual_tls_refuses_clients_without_a_certificate(tmp_path):
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *curve, "-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.pem"),
             "-days", "1", "-subj", "/CN=ferry test CA")
    for name, ext in (("server", "subjectAltName=DNS:ferry.test"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", *curve, "-keyout", str(tmp_path / f"{name}.key"), "-out", str(tmp_path / f"{name}.csr"),
                 "-subj", f"/CN={name}")
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", str(tmp_path / f"{name}.csr"), "-CA", str(tmp_path / "ca.pem"),
                 "-CAkey", str(tmp_path / "ca.key"), "-CAcreateserial", "-out", str(tmp_path / f"{name}.pem"),
                 "-days", "1", "-extfile", str(tmp_path / f"{name}.ext"))
    repo = tmp_path / "repo"
    repo.mkdir()
    link_shipped_models(repo, "simple")
    server = RunningServer(repo, "--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"),
                           "--tls-ca", str(tmp_path / "ca.pem"))
    try:
        tls = {"root_certificates": tmp_path / "ca.pem", "tls_server_name": "ferry.test", "timeout_s": 30}
        with InferenceClient(server.address, **tls) as client, pytest.raises(FerryClientError) as info:
            client.is_live()
        assert info.value.status == grpc.StatusCode.UNAVAILABLE  # the handshake is refused
        with InferenceClient(server.address, private_key=tmp_path / "client.key",
                             certificate_chain=tmp_path / "client.pem", **tls) as client:
            assert client.infer("simple", SIMPLE)["OUTPUT0"].tolist() == (A + 1).tolist()
        health = subprocess.run([sys.executable, "-m", "server", "health", "--url", server.address, "--root-certs",
                                 str(tmp_path / "ca.pem"), "--tls-server-name", "ferry.test", "--client-cert",
                                 str(tmp_path / "client.pem"), "--client-key", str(tmp_path / "client.key")],
                                cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert health.returncode == 0, health.stderr  # what the Dockerfile's HEALTHCHECK runs
    finally:
        server.stop()


def http_status(server, path: str, token: str | None, body: bytes | None = None) -> int:
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(server.http_url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_http_checks_the_same_tokens_with_the_same_rights(server):
    infer = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "data": a.reshape(-1).tolist()}
                                   for n, a in SIMPLE.items()]}).encode()
    for token, expected in ((None, 401), ("wrong", 401), (INFER_TOKEN, 200), (ADMIN_TOKEN, 200)):
        assert http_status(server, "/v2/models/simple/infer", token, infer) == expected
        assert http_status(server, "/v2/models/simple", token) == expected
    assert http_status(server, "/v2/health/ready", None) == 200  # probes stay open
    assert http_status(server, "/v2/repository/models/simple/unload", INFER_TOKEN, b"{}") == 403
    assert http_status(server, "/v2/models/simple/ready", INFER_TOKEN) == 200
