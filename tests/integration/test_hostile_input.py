"""Issue 18's front-door rows against a real server: malformed bodies (4), shapes and versions (5),
huge names (6), path-like model names and absolute paths (7), config content (8), python reload (11)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import generate_pb2  # noqa: F401 - registers ferry.generate.v1 in the descriptor pool
from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer

ONE = np.ones((1, 4), np.float32)
BAD_BODY = b"\xff\xff\xff\xff"  # field 31 with wire type 7: no protobuf message parses it
SERVICES = ("inference.GRPCInferenceService", "ferry.generate.v1.Generation")
SECRET = "ferrysecret:x:0:0:root:/root:/bin/bash"

PY_MODEL = '''
import numpy as np
K = {k}
SEEN = []  # instance indexes this module saw: each instance runs in a process of its own, so one


class Model:
    def initialize(self, args):
        SEEN.append(args["instance"])

    def execute(self, inputs):
        x = inputs["X"]
        return {{"Y": x + K, "SEEN": np.full((x.shape[0], 2), SEEN[0], np.int64)}}
'''
PY_CONFIG = """backend: python
max_batch_size: 4
input: [{name: X, data_type: TYPE_FP32, dims: [2]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [2]}, {name: SEEN, data_type: TYPE_INT64, dims: [2]}]
instance_group: [{count: 2, kind: KIND_CPU}]
"""


def python_model(repo, name: str, k: int) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "1" / "model.py").write_text(PY_MODEL.format(k=k))
    (repo / name / "config.yaml").write_text(PY_CONFIG)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    python_model(repo, "py_a", 1)
    python_model(repo, "py_b", 1)
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"definitely not onnx")
    (repo / "nofile" / "1").mkdir(parents=True)
    (repo / "nofile" / "config.yaml").write_text("backend: onnxruntime\n")
    (repo / "badpy" / "1").mkdir(parents=True)
    (repo / "badpy" / "1" / "model.py").write_text("raise RuntimeError(__file__)\n")  # quotes its own absolute path
    (repo / "badpy" / "config.yaml").write_text(PY_CONFIG.replace("count: 2", "count: 1"))
    secret = tmp_path_factory.mktemp("elsewhere") / "passwd"
    secret.write_text(SECRET + "\n")
    (repo / "leak" / "1").mkdir(parents=True)
    (repo / "leak" / "config.pbtxt").symlink_to(secret)  # a config that is a link to another file
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")  # hostile load/unload names reach the registry
    yield server, repo
    server.stop()


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, timeout=30, **kwargs)
        if not isinstance(result, (bytes, pb.ModelInferResponse)) and hasattr(result, "__iter__"):
            list(result)
    return info.value


# Row 4: a body that does not parse is INVALID_ARGUMENT naming the message type, for every method.
@pytest.mark.parametrize("service", SERVICES)
def test_every_method_answers_an_undecodable_body_with_invalid_argument(env, service):
    server, _ = env
    for method in descriptor_pool.Default().FindServiceByName(service).methods:
        path = f"/{service}/{method.name}"
        if method.client_streaming:
            continue  # ModelStreamInfer answers on the stream (next test)
        call = server.channel.unary_stream(path) if method.server_streaming else server.channel.unary_unary(path)
        err = rpc_error(call, BAD_BODY)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err.code(), err.details())
        assert f"request body is not a valid {method.input_type.full_name}" in err.details()


def test_an_undecodable_stream_message_is_answered_on_the_stream_which_goes_on(env):
    """As for any other bad request on ModelStreamInfer: error_message for it, the others answered."""
    server, _ = env
    good = kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, request_id="good").SerializeToString()
    call = server.channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    answers = [pb.ModelStreamInferResponse.FromString(r) for r in call(iter([BAD_BODY, good, BAD_BODY, good]), timeout=30)]
    assert [bool(a.error_message) for a in answers] == [True, False, True, False]
    assert "request body is not a valid inference.ModelInferRequest" in answers[0].error_message
    assert kserve.outputs(answers[1].infer_response)["OUTPUT0"].tolist() == [[2, 2, 2, 2]]


def test_bad_bodies_are_counted_in_a_rate_limited_line_not_a_traceback_each(env):
    server, _ = env
    call = server.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    for i in range(50):
        assert rpc_error(call, BAD_BODY + bytes([i])).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert kserve.infer(server.channel, "simple", {"INPUT0": ONE, "INPUT1": ONE})["OUTPUT1"].tolist() == [[0] * 4]
    assert "Traceback" not in server.output
    lines = [line for line in server.lines if "undecodable request bod" in line]
    # one line a minute however many bodies (tests/unit/test_malformed_bodies.py checks the exact
    # lines with a clock it controls); here: a line was written, and far fewer lines than bodies
    assert lines and len(lines) < 5, f"{len(lines)} summary lines for 50 bad bodies: {lines[:5]}"


def test_reflection_still_lists_and_describes_the_services(env):
    server, _ = env
    reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")]
    listed, described = list(reflect.ServerReflectionInfo(iter(requests)))
    assert set(SERVICES) <= {s.name for s in listed.list_services_response.service}
    assert described.file_descriptor_response.file_descriptor_proto


# Row 5: shapes are bounded per dimension; versions are ASCII digits.
@pytest.mark.parametrize("shape, words", [
    ([0, 2**62], "each must be within [0, 2147483647]"),
    ([2**40, 2**40], "each must be within"),
    ([-1, 4], "each must be within"),
    ([0, 2**31 - 1, 2**31 - 1, 2**31 - 1], "more than 2147483647 elements"),
    ([1] * 40, "at most 32"),
])
def test_absurd_shapes_are_invalid_argument_not_internal(env, shape, words):
    server, _ = env
    for raw in (True, False):
        req = pb.ModelInferRequest(model_name="simple")
        for name in ("INPUT0", "INPUT1"):
            req.inputs.add(name=name, datatype="FP32", shape=shape)
            if raw:
                req.raw_input_contents.append(b"")
        err = rpc_error(kserve.stub(server.channel).ModelInfer, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), err.details()
        assert "INPUT0" in err.details()


@pytest.mark.parametrize("version", ["²", "①", "١", "1.0", " 1", "-1", "9" * 5000])
def test_versions_are_ascii_digits_everywhere(env, version):
    server, _ = env
    api = kserve.stub(server.channel)
    calls = [(api.ModelInfer, kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, version=version)),
             (api.ModelReady, pb.ModelReadyRequest(name="simple", version=version)),
             (api.ModelMetadata, pb.ModelMetadataRequest(name="simple", version=version)),
             (api.ModelConfig, pb.ModelConfigRequest(name="simple", version=version)),
             (api.ModelStatistics, pb.ModelStatisticsRequest(name="simple", version=version))]
    for call, request in calls:
        err = rpc_error(call, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "ASCII digits" in err.details(), err.details()
        assert len(err.details()) < 300


# Row 6: a 100 KB name costs a short, precise answer.
def test_huge_names_are_echoed_truncated(env):
    server, _ = env
    huge = "n" * 100_000
    api = kserve.stub(server.channel)
    cases = [
        (kserve.request(huge, {"INPUT0": ONE}), grpc.StatusCode.NOT_FOUND),
        (kserve.request("simple", {"INPUT0": ONE, huge: ONE}), grpc.StatusCode.INVALID_ARGUMENT),
        (kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, outputs=[huge]), grpc.StatusCode.INVALID_ARGUMENT),
        (kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, **{"triton_" + huge: 1}), grpc.StatusCode.INVALID_ARGUMENT),
        (kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, priority=huge), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for request, code in cases:
        err = rpc_error(api.ModelInfer, request)
        assert err.code() == code, err.details()[:300]
        assert "chars" in err.details()  # cut, with the full length noted
        assert len(err.details()) < 1000
    for call, request in ((api.ModelReady, pb.ModelReadyRequest(name=huge)),
                          (api.ModelMetadata, pb.ModelMetadataRequest(name=huge)),
                          (api.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name=huge))):
        err = rpc_error(call, request)
        assert err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT) and len(err.details()) < 1000


# Row 7: model names are one folder of the repository; answers never show the server's paths.
@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../simple", "/etc", "x\0y", ".hidden", "__pycache__", "a\\b"])
def test_path_like_model_names_are_refused_before_the_filesystem(env, name):
    server, _ = env
    api = kserve.stub(server.channel)
    for call, request in ((api.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=name)),
                          (api.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name=name))):
        err = rpc_error(call, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "model name" in err.details(), err.details()
    names = {m.name for m in api.RepositoryIndex(pb.RepositoryIndexRequest()).models}
    assert "" not in names and name not in names
    assert api.ModelReady(pb.ModelReadyRequest(name="simple")).ready


def test_no_answer_reveals_the_repository_path(env):
    server, repo = env
    api = kserve.stub(server.channel)
    texts = [rpc_error(api.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="nope")).details()]
    for name in ("broken", "nofile", "badpy", "leak"):
        texts.append(rpc_error(api.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name=name)).details())
        texts.append(rpc_error(api.ModelInfer, kserve.request(name, {"X": ONE})).details())
    index = api.RepositoryIndex(pb.RepositoryIndexRequest()).models
    texts += [m.reason for m in index]
    reasons = {m.name: m.reason for m in index}
    assert "nofile/1/" in reasons["nofile"] and "broken/1" in reasons["broken"]
    assert "badpy/1/model.py" in reasons["badpy"]  # the module's own message, its path made relative
    for text in texts:
        for secret in {str(repo), str(repo.resolve()), str(repo.parent)}:
            assert secret not in text, text


# Row 8: a config parse error names the file, line and field, never the file's content.
def test_a_config_linked_to_another_file_does_not_leak_its_content(env):
    server, _ = env
    reason = {m.name: m.reason for m in kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models}["leak"]
    assert reason.startswith("leak/config.pbtxt: line 1, column 1: unknown field"), reason
    assert "ferrysecret" not in reason and "/bin/bash" not in reason and "root" not in reason


# Row 11: model.py is imported fresh on every load; instance indexes count within the model.
def test_python_model_reload_runs_the_code_on_disk_and_counts_instances_per_model(env):
    server, repo = env
    x = np.zeros((1, 2), np.float32)
    for name in ("py_a", "py_b"):
        out = kserve.infer(server.channel, name, {"X": x})
        assert out["Y"].tolist() == [[1, 1]] and out["SEEN"].tolist() in ([[0, 0]], [[1, 1]]), name
    python_model(repo, "py_a", 7)
    kserve.stub(server.channel).RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="py_a"), timeout=60)
    out = kserve.infer(server.channel, "py_a", {"X": x})
    assert out["Y"].tolist() == [[7, 7]] and out["SEEN"].tolist() in ([[0, 0]], [[1, 1]])  # new processes: new code
    assert kserve.infer(server.channel, "py_b", {"X": x})["Y"].tolist() == [[1, 1]]
