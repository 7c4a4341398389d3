"""The KServe v2 RPCs over a real server: metadata, inference in every datatype, every error path."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.kserve import ALL_TYPES
from tests.conftest import RunningServer



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    builders.identity_all_types(repo / "types" / "1" / "model.onnx")
    builders.identity_all_types(repo / "typed" / "1" / "model.onnx", skip=("FP16",))
    builders.fragile(repo / "fragile" / "1" / "model.onnx")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"definitely not onnx")
    (repo / "badcfg" / "1").mkdir(parents=True)
    (repo / "badcfg" / "config.yaml").write_text("max_batch_size: 4\nmax_batch_sise: 8\n")
    (repo / "nofile" / "1").mkdir(parents=True)
    (repo / "nofile" / "config.yaml").write_text("backend: onnxruntime\n")
    server = RunningServer(repo)
    yield server
    server.stop()


def call_error(server, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        kserve.stub(server.channel).ModelInfer(req, timeout=30)
    return info.value


def test_server_health_metadata_and_reflection(server):
    api = kserve.stub(server.channel)
    assert api.ServerLive(pb.ServerLiveRequest()).live
    assert api.ServerReady(pb.ServerReadyRequest()).ready
    meta = api.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "ferry" and "statistics" in meta.extensions and "model_configuration" in meta.extensions
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    services = {s.name for s in reply.list_services_response.service}
    assert "inference.GRPCInferenceService" in services and "grpc.health.v1.Health" in services


def test_model_metadata_and_completed_config(server):
    api = kserve.stub(server.channel)
    meta = api.ModelMetadata(pb.ModelMetadataRequest(name="simple"))
    assert meta.platform == "onnxruntime_onnx" and list(meta.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("INPUT0", "FP32", [-1, 4]), ("INPUT1", "FP32", [-1, 4])]
    config = api.ModelConfig(pb.ModelConfigRequest(name="simple")).config
    assert config.max_batch_size == 4 and config.HasField("dynamic_batching")
    assert [list(t.dims) for t in config.output] == [[4], [4]]
    assert config.parameters["execution_provider"].string_value == "CPUExecutionProvider"
    assert api.ModelReady(pb.ModelReadyRequest(name="simple")).ready
    assert not api.ModelReady(pb.ModelReadyRequest(name="broken")).ready


def test_infer_raw_and_typed_give_same_answer(server):
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, np.float32)
    for typed in (False, True):
        out = kserve.infer(server.channel, "simple", {"INPUT0": a, "INPUT1": b}, typed=typed)
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "typed"])
def test_every_datatype_round_trips(server, typed):
    # FP16 has no typed-contents field: the protocol carries it raw only, so the typed model skips it.
    model, types = ("typed", {t: v for t, v in ALL_TYPES.items() if t != "FP16"}) if typed else ("types", ALL_TYPES)
    response = kserve.stub(server.channel).ModelInfer(
        kserve.request(model, {f"IN_{t}": v for t, v in types.items()}, typed=typed), timeout=30)
    assert all(not t.HasField("contents") for t in response.outputs)  # raw only, as tritonclient reads it
    assert {o.name: o.datatype for o in response.outputs} == {f"OUT_{t}": t for t in types}
    out = kserve.outputs(response)
    for t, value in types.items():
        assert out[f"OUT_{t}"].shape == value.shape
        assert out[f"OUT_{t}"].tolist() == value.tolist(), t


def test_fp16_cannot_travel_typed(server):
    req = kserve.request("types", {f"IN_{t}": v for t, v in ALL_TYPES.items() if t != "FP16"}, typed=True)
    req.inputs.add(name="IN_FP16", datatype="FP16", shape=[1, 3])
    err = call_error(server, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "IN_FP16" in err.details() and "raw_input_contents" in err.details()


def test_requested_output_subset_and_id_echo(server):
    a = np.ones((1, 4), np.float32)
    response = kserve.stub(server.channel).ModelInfer(
        kserve.request("simple", {"INPUT0": a, "INPUT1": a}, outputs=["OUTPUT1"], request_id="req-42"))
    assert response.id == "req-42" and response.model_name == "simple" and response.model_version == "1"
    assert [o.name for o in response.outputs] == ["OUTPUT1"] and len(response.raw_output_contents) == 1
    np.testing.assert_array_equal(kserve.outputs(response)["OUTPUT1"], np.zeros((1, 4), np.float32))


def test_message_larger_than_grpc_default_limit(server):
    x = np.random.default_rng(0).standard_normal((1, 3 * 2**20)).astype(np.float32)  # 12 MiB each way
    np.testing.assert_array_equal(kserve.infer(server.channel, "fragile", {"X": x})["Y"], x)


ONE = np.ones((1, 4), np.float32)


@pytest.mark.parametrize("case, code, words", [
    (lambda: kserve.request("nope", {"INPUT0": ONE}), grpc.StatusCode.NOT_FOUND, ["unknown model", "nope"]),
    (lambda: kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, version="7"), grpc.StatusCode.NOT_FOUND, ["version 7"]),
    (lambda: kserve.request("simple", {"INPUT0": ONE, "INPUTX": ONE}), grpc.StatusCode.INVALID_ARGUMENT, ["INPUTX", "INPUT1"]),
    (lambda: kserve.request("simple", {"INPUT0": ONE}), grpc.StatusCode.INVALID_ARGUMENT, ["missing", "INPUT1"]),
    (lambda: kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE.astype(np.float64)}), grpc.StatusCode.INVALID_ARGUMENT, ["INPUT1", "FP64", "FP32"]),
    (lambda: kserve.request("simple", {"INPUT0": np.ones((1, 5), np.float32), "INPUT1": ONE}), grpc.StatusCode.INVALID_ARGUMENT, ["INPUT0", "[1, 5]", "[-1, 4]"]),
    (lambda: kserve.request("simple", {"INPUT0": np.ones((5, 4), np.float32), "INPUT1": np.ones((5, 4), np.float32)}), grpc.StatusCode.INVALID_ARGUMENT, ["batch size 5", "max_batch_size 4"]),
    (lambda: kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE}, outputs=["NOPE"]), grpc.StatusCode.INVALID_ARGUMENT, ["NOPE"]),
    (lambda: kserve.request("broken", {"INPUT0": ONE}), grpc.StatusCode.UNAVAILABLE, ["broken", "DecodeError"]),
    (lambda: kserve.request("badcfg", {"INPUT0": ONE}), grpc.StatusCode.UNAVAILABLE, ["badcfg/config.yaml", "did you mean 'max_batch_size'"]),
], ids=["unknown-model", "unknown-version", "wrong-name", "missing-input", "wrong-dtype", "wrong-shape",
        "batch-too-large", "unknown-output", "failed-model", "bad-config"])
def test_bad_requests_get_clear_errors(server, case, code, words):
    err = call_error(server, case())
    assert err.code() == code, err.details()
    for word in words:
        assert word in err.details(), err.details()


def test_raw_size_mismatch_and_mixed_contents_are_refused(server):
    req = kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE})
    req.raw_input_contents[1] = req.raw_input_contents[1][:-4]
    err = call_error(server, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "INPUT1" in err.details() and "12 bytes" in err.details()
    mixed = kserve.request("simple", {"INPUT0": ONE, "INPUT1": ONE})
    mixed.inputs[0].contents.fp32_contents.extend([1, 1, 1, 1])
    err = call_error(server, mixed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in err.details()
    bad_bytes = kserve.request("types", {f"IN_{t}": v for t, v in ALL_TYPES.items()})
    index = [t.name for t in bad_bytes.inputs].index("IN_BYTES")
    bad_bytes.raw_input_contents[index] = b"\xff\x00\x00\x00ab"
    err = call_error(server, bad_bytes)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "IN_BYTES" in err.details()


def fragile_counts(server) -> tuple[int, int]:
    stats = kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name="fragile")).model_stats[0]
    return stats.inference_stats.fail.count, stats.inference_stats.success.count


def test_backend_exception_fails_only_its_batch(server):
    fail0, success0 = fragile_counts(server)
    bad = call_error(server, kserve.request("fragile", {"X": np.ones((1, 4), np.float32)}))
    assert bad.code() == grpc.StatusCode.INTERNAL and "Reshape" in bad.details()
    good = np.arange(6, dtype=np.float32).reshape(1, 6)
    np.testing.assert_array_equal(kserve.infer(server.channel, "fragile", {"X": good})["Y"], good)
    assert fragile_counts(server) == (fail0 + 1, success0 + 1)


def test_repository_index_shows_failures_with_reasons(server):
    api = kserve.stub(server.channel)
    rows = {m.name: m for m in api.RepositoryIndex(pb.RepositoryIndexRequest()).models}
    assert rows["simple"].state == "READY" and rows["simple"].version == "1"
    assert rows["broken"].state == "UNAVAILABLE" and "DecodeError" in rows["broken"].reason
    assert "broken/1" in rows["broken"].reason  # names the folder that holds the bad file
    assert rows["badcfg"].state == "UNAVAILABLE" and "did you mean 'max_batch_size'" in rows["badcfg"].reason
    assert "max_batch_sise" not in rows["badcfg"].reason  # the file's content is never quoted
    assert rows["nofile"].state == "UNAVAILABLE" and "model.onnx" in rows["nofile"].reason
    ready = {m.name for m in api.RepositoryIndex(pb.RepositoryIndexRequest(ready=True)).models}
    assert ready == {"simple", "types", "typed", "fragile"}
