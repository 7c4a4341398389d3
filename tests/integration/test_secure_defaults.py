"""Secure by default (issue 26): what runs code or changes what is served is off until a flag turns it on,
and then needs the admin token; Triton's restricted-API categories guard each door. Checked over gRPC
(our stubs, tritonclient in a subprocess: its protobufs clash with ours) and HTTP, on real servers."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer

INFER_TOKEN, ADMIN_TOKEN = "infer-secret", "admin-secret"
A = np.arange(8, dtype=np.float32).reshape(2, 4)
CONFIG = json.dumps({"backend": "onnxruntime", "max_batch_size": 4})


def _repo(root, *names):
    for name in names:
        builders.add_sub(root / "repo" / name / "1" / "model.onnx")
    return root / "repo"


def _model_bytes(root) -> bytes:
    return builders.add_sub(root / "outside" / "1" / "model.onnx").read_bytes()


def _uploaded(tmp) -> list:
    """Inline model folders the server wrote under its own TMPDIR."""
    return list(tmp.glob("ferry-inline-*/*"))


def _bearer(token):
    return None if token is None else (("authorization", f"Bearer {token}"),)


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    try:
        call(*args, timeout=60, **kwargs)
    except grpc.RpcError as err:
        return err
    raise AssertionError(f"{call} was allowed")


def _upload_request(name: str, model: bytes) -> pb.RepositoryModelLoadRequest:
    return pb.RepositoryModelLoadRequest(model_name=name, parameters={
        "config": pb.ModelRepositoryParameter(string_param=CONFIG),
        "file:1/model.onnx": pb.ModelRepositoryParameter(bytes_param=model)})


def http(server, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.http_url + path, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read()
            return response.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            return err.code, json.loads(text or b"{}")
        except json.JSONDecodeError:  # Starlette's plain 404 for a route that does not exist
            return err.code, {"error": text.decode()}


def _infer_sum(server, model: str, metadata=None) -> np.ndarray:
    response = kserve.stub(server.channel).ModelInfer(kserve.request(model, {"INPUT0": A, "INPUT1": A}),
                                                      metadata=metadata, timeout=60)
    return kserve.outputs(response)["OUTPUT0"]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("default")
    (root / "tmp").mkdir()
    server = RunningServer(_repo(root, "simple"), env={"TMPDIR": str(root / "tmp")})  # no flag at all
    server.root, server.model = root, _model_bytes(root)
    yield server
    server.stop()


def test_by_default_load_and_unload_are_refused_over_grpc_naming_the_flag(default_server):
    stub = kserve.stub(default_server.channel)
    for request in (pb.RepositoryModelLoadRequest(model_name="simple"), _upload_request("evil", default_server.model)):
        err = rpc_error(stub.RepositoryModelLoad, request)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "--model-control-mode explicit" in err.details()
    err = rpc_error(stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name="simple"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "--model-control-mode explicit" in err.details()
    assert not _uploaded(default_server.root / "tmp")  # nothing the caller sent reached the disk
    assert stub.ModelReady(pb.ModelReadyRequest(name="simple"), timeout=30).ready
    np.testing.assert_array_equal(_infer_sum(default_server, "simple"), A + A)  # exact: a float sum of equal values


def test_by_default_http_load_and_unload_answer_what_grpc_answers_never_500(default_server):
    upload = {"parameters": {"config": CONFIG, "file:1/model.onnx": base64.b64encode(default_server.model).decode()}}
    for path, body in (("/v2/repository/models/simple/load", {}), ("/v2/repository/models/evil/load", upload),
                       ("/v2/repository/models/simple/unload", {})):
        status, answer = http(default_server, path, body)
        assert status == 503, (path, answer)
        assert "--model-control-mode explicit" in answer["error"]
    assert not _uploaded(default_server.root / "tmp")
    assert http(default_server, "/v2/models/simple/ready")[0] == 200


def test_by_default_shared_memory_registration_log_and_trace_changes_are_refused(default_server):
    stub = kserve.stub(default_server.channel)
    err = rpc_error(stub.SystemSharedMemoryRegister,
                    pb.SystemSharedMemoryRegisterRequest(name="r", key="/ferry_never", byte_size=64))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-shared-memory" in err.details()
    assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=30).regions
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=30)  # nothing to clear: fine

    change = pb.LogSettingsRequest(settings={"log_info": pb.LogSettingsRequest.SettingValue(bool_param=False)})
    err = rpc_error(stub.LogSettings, change)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-log-settings" in err.details()
    assert stub.LogSettings(pb.LogSettingsRequest(), timeout=30).settings["log_info"].bool_param  # unchanged
    status, answer = http(default_server, "/v2/systemsharedmemory/region/r/register", {"key": "/ferry_never", "byte_size": 64})
    assert status == 403 and "--allow-shared-memory" in answer["error"]  # the HTTP door asks the same registry
    status, answer = http(default_server, "/v2/logging", {"log_info": False})
    assert status == 403 and "--allow-log-settings" in answer["error"]
    assert http(default_server, "/v2/logging")[1]["log_info"] is True

    trace = pb.TraceSettingRequest()
    trace.settings["trace_level"].value.append("TIMESTAMPS")
    err = rpc_error(stub.TraceSetting, trace)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-trace-settings" in err.details()
    assert list(stub.TraceSetting(pb.TraceSettingRequest(), timeout=30).settings["trace_level"].value) == ["OFF"]
    status, answer = http(default_server, "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]})
    assert status == 403 and "--allow-trace-settings" in answer["error"]
    assert http(default_server, "/v2/trace/setting")[1]["trace_level"] == ["OFF"]


TRITON_LOAD = """
import sys, tritonclient.grpc as tc, tritonclient.http as th
from tritonclient.utils import InferenceServerException
for client in (tc.InferenceServerClient(sys.argv[1]), th.InferenceServerClient(sys.argv[2])):
    try:
        client.load_model("simple")
        print("loaded")
    except InferenceServerException as e:
        print("refused", "--model-control-mode explicit" in str(e))
"""


def test_tritonclient_sees_the_refusal_and_the_flag(default_server):
    done = subprocess.run([sys.executable, "-c", TRITON_LOAD, default_server.address, default_server.http_address],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["refused True", "refused True"]


def _tokens(root) -> tuple[str, ...]:
    (root / "infer.tokens").write_text(INFER_TOKEN + "\n")
    (root / "admin.tokens").write_text(ADMIN_TOKEN + "\n")
    return "--auth-token-file", str(root / "infer.tokens"), "--admin-token-file", str(root / "admin.tokens")


def test_explicit_mode_without_the_upload_flag_loads_from_the_repository_but_refuses_files(tmp_path):
    (tmp_path / "tmp").mkdir()
    server = RunningServer(_repo(tmp_path, "simple"), "--model-control-mode", "explicit", *_tokens(tmp_path),
                           env={"TMPDIR": str(tmp_path / "tmp")})
    try:
        stub, admin = kserve.stub(server.channel), _bearer(ADMIN_TOKEN)
        assert not stub.ModelReady(pb.ModelReadyRequest(name="simple"), metadata=admin, timeout=30).ready
        err = rpc_error(stub.RepositoryModelLoad, _upload_request("evil", _model_bytes(tmp_path)), metadata=admin)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "--allow-model-upload" in err.details()
        upload = {"parameters": {"config": CONFIG, "file:1/model.onnx": base64.b64encode(b"x").decode()}}
        status, answer = http(server, "/v2/repository/models/evil/load", upload, {"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 403 and "--allow-model-upload" in answer["error"]
        assert not _uploaded(tmp_path / "tmp")
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="simple"), metadata=admin, timeout=60)
        np.testing.assert_array_equal(_infer_sum(server, "simple", admin), A + A)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def upload_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("upload")
    server = RunningServer(_repo(root, "simple", "other"), "--model-control-mode", "explicit", "--load-model", "*",
                           "--allow-model-upload", *_tokens(root))
    server.model = _model_bytes(root)
    yield server
    server.stop()


def test_load_model_star_loads_every_model(upload_server):
    index = kserve.stub(upload_server.channel).RepositoryIndex(pb.RepositoryIndexRequest(ready=True),
                                                               metadata=_bearer(INFER_TOKEN), timeout=30)
    assert {m.name for m in index.models} == {"simple", "other"}


def test_uploads_need_the_admin_token_over_grpc(upload_server):
    stub = kserve.stub(upload_server.channel)
    request = _upload_request("inline", upload_server.model)
    assert rpc_error(stub.RepositoryModelLoad, request).code() == grpc.StatusCode.UNAUTHENTICATED
    err = rpc_error(stub.RepositoryModelLoad, request, metadata=_bearer(INFER_TOKEN))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
    stub.RepositoryModelLoad(request, metadata=_bearer(ADMIN_TOKEN), timeout=60)
    np.testing.assert_array_equal(_infer_sum(upload_server, "inline", _bearer(INFER_TOKEN)), A + A)
    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="inline"), metadata=_bearer(ADMIN_TOKEN),
                               timeout=60)


def test_http_uploads_work_as_grpc_ones_with_the_admin_token(upload_server):
    upload = {"parameters": {"config": CONFIG, "file:1/model.onnx": base64.b64encode(upload_server.model).decode()}}
    path = "/v2/repository/models/inline_http/load"
    assert http(upload_server, path, upload)[0] == 401
    assert http(upload_server, path, upload, {"Authorization": f"Bearer {INFER_TOKEN}"})[0] == 403
    assert http(upload_server, path, upload, {"Authorization": f"Bearer {ADMIN_TOKEN}"})[0] == 200
    np.testing.assert_array_equal(_infer_sum(upload_server, "inline_http", _bearer(INFER_TOKEN)), A + A)
    bad = {"parameters": {"config": CONFIG, "file:1/model.onnx": "not base64!"}}
    status, answer = http(upload_server, "/v2/repository/models/bad/load", bad, {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 400 and "base64" in answer["error"]


# Each category in one of two groups, as an operator splits users from admins.
USER, ADMIN = ("health,metadata,inference,model-config,statistics", "user-key", "U"), \
    ("shared-memory,model-repository,trace,logging", "admin-key", "A")


@pytest.fixture(scope="module")
def restricted_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("restricted")
    groups = [f"{cats}:{key}={value}" for cats, key, value in (USER, ADMIN)]
    server = RunningServer(_repo(root, "simple"), "--model-control-mode", "explicit", "--load-model", "*",
                           "--allow-shared-memory", "--allow-log-settings",
                           *[a for g in groups for a in ("--grpc-restricted-protocol", g)],
                           *[a for g in groups for a in ("--http-restricted-api", g)], timeout_s=120)
    yield server
    server.stop()


GRPC_CALLS = {  # category -> a call in it (method name, request)
    "health": ("ServerReady", pb.ServerReadyRequest()),
    "metadata": ("ModelMetadata", pb.ModelMetadataRequest(name="simple")),
    "inference": ("ModelInfer", kserve.request("simple", {"INPUT0": A, "INPUT1": A})),
    "model-config": ("ModelConfig", pb.ModelConfigRequest(name="simple")),
    "statistics": ("ModelStatistics", pb.ModelStatisticsRequest(name="simple")),
    "shared-memory": ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest()),
    "model-repository": ("RepositoryIndex", pb.RepositoryIndexRequest()),
    "trace": ("TraceSetting", pb.TraceSettingRequest()),
    "logging": ("LogSettings", pb.LogSettingsRequest()),
}


def _group(category: str):
    return next(g for g in (USER, ADMIN) if category in g[0].split(","))


@pytest.mark.parametrize("category", list(GRPC_CALLS))
def test_every_restricted_grpc_category_refuses_without_its_key_and_serves_with_it(restricted_server, category):
    method, request = GRPC_CALLS[category]
    call = getattr(kserve.stub(restricted_server.channel), method)
    _, key, value = _group(category)
    header = f"triton-grpc-protocol-{key}"
    err = rpc_error(call, request)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"expecting header '{header}'" in err.details()
    other = next(g for g in (USER, ADMIN) if g[1] != key)  # the other group's key does not open this one
    assert rpc_error(call, request, metadata=((f"triton-grpc-protocol-{other[1]}", other[2]),)).code() == \
        grpc.StatusCode.PERMISSION_DENIED
    call(request, metadata=((header, value),), timeout=60)  # served


HTTP_CALLS = {  # category -> (path, body or None for GET)
    "health": ("/v2/health/ready", None), "metadata": ("/v2/models/simple", None),
    "inference": ("/v2/models/simple/infer", {"inputs": [
        {"name": n, "shape": [2, 4], "datatype": "FP32", "data": A.reshape(-1).tolist()} for n in ("INPUT0", "INPUT1")]}),
    "model-config": ("/v2/models/simple/config", None), "statistics": ("/v2/models/simple/stats", None),
    "shared-memory": ("/v2/systemsharedmemory/status", None), "model-repository": ("/v2/repository/index", {}),
    "logging": ("/v2/logging", None), "trace": ("/v2/trace/setting", None),
}


@pytest.mark.parametrize("category", list(HTTP_CALLS))
def test_every_restricted_http_category_refuses_without_its_key_and_serves_with_it(restricted_server, category):
    path, body = HTTP_CALLS[category]
    _, key, value = _group(category)
    status, answer = http(restricted_server, path, body)
    assert status == 403 and f"expecting header '{key}'" in answer["error"]
    status, answer = http(restricted_server, path, body, {key: value})
    assert status == 200, (status, answer)


TRITON_KEY = """
import sys, numpy as np, tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException
client = tc.InferenceServerClient(sys.argv[1])
a = np.arange(8, dtype=np.float32).reshape(2, 4)
inputs = [tc.InferInput("INPUT0", [2, 4], "FP32"), tc.InferInput("INPUT1", [2, 4], "FP32")]
for i in inputs:
    i.set_data_from_numpy(a)
try:
    client.infer("simple", inputs)
    print("served")
except InferenceServerException as e:
    print("refused", "expecting header 'triton-grpc-protocol-user-key'" in str(e))
result = client.infer("simple", inputs, headers={"triton-grpc-protocol-user-key": "U"})
print("served", bool(np.array_equal(result.as_numpy("OUTPUT0"), a + a)))
"""


def test_tritonclient_passes_the_restricted_key_as_a_header(restricted_server):
    done = subprocess.run([sys.executable, "-c", TRITON_KEY, restricted_server.address],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["refused True", "served True"]


@pytest.mark.parametrize("value, words", [
    ("bogus:k=v", "unknown category ['bogus']"), ("inference", "<categories>:<key>=<value>"),
    ("inference:k=v --grpc-restricted-protocol inference:j=w", "restricted twice"),
])
def test_bad_restricted_flags_stop_the_server_before_it_starts(tmp_path, value, words):
    flags = [a for part in value.split(" --grpc-restricted-protocol ")
             for a in ("--grpc-restricted-protocol", part)]
    done = subprocess.run([sys.executable, "-m", "server", "serve", "--model-repository", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and words in done.stderr, done.stderr
