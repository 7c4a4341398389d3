"""The model repository as a user lays it out: versions, policies, pbtxt, PyTorch models, shutdown."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer

X = np.arange(12, dtype=np.float32).reshape(3, 4)


def versioned(repo, name: str, versions, policy_pbtxt: str | None):
    for v in versions:
        builders.mlp(repo / name / str(v) / "model.onnx", 4, seed=v)  # weights differ per version
    if policy_pbtxt is not None:
        (repo / name / "config.pbtxt").write_text(f"version_policy: {{ {policy_pbtxt} }}\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    versioned(repo, "latest_default", [1, 2, 3], None)
    versioned(repo, "latest_two", [1, 2, 3], "latest: { num_versions: 2 }")
    versioned(repo, "every", [1, 2], "all: {}")
    versioned(repo, "pinned", [1, 2, 3], "specific: { versions: [1, 3] }")
    builders.torch_affine(repo / "torchscript" / "1")
    (repo / "torchscript" / "config.yaml").write_text(builders.TORCH_AFFINE_CONFIG)
    builders.torch_affine(repo / "exported" / "1", export=True)
    (repo / "exported" / "config.yaml").write_text(builders.TORCH_AFFINE_CONFIG)
    server = RunningServer(repo)
    yield server
    server.stop()


def index(server) -> set[tuple[str, str, str]]:
    models = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
    return {(m.name, m.version, m.state) for m in models}


def test_version_policies_select_the_right_folders(server):
    rows = index(server)
    served = lambda name: sorted(v for n, v, s in rows if n == name and s == "READY")  # noqa: E731
    assert served("latest_default") == ["3"]
    assert served("latest_two") == ["2", "3"]
    assert served("every") == ["1", "2"]
    assert served("pinned") == ["1", "3"]


def test_versions_answer_differently_and_empty_version_means_latest(server):
    answers = {v: kserve.infer(server.channel, "latest_two", {"X": X}, version=v)["Y"] for v in ("2", "3", "")}
    assert not np.array_equal(answers["2"], answers["3"])
    np.testing.assert_array_equal(answers[""], answers["3"])  # exact: one model, request and shape, twice
    with pytest.raises(grpc.RpcError) as info:
        kserve.infer(server.channel, "latest_two", {"X": X}, version="1")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("model, platform", [("torchscript", "pytorch_libtorch"), ("exported", "pytorch_export")])
def test_pytorch_models(server, model, platform):
    out = kserve.infer(server.channel, model, {"x": X})
    np.testing.assert_array_equal(out["y"], X * 2 + 1)
    np.testing.assert_array_equal(out["total"], X.sum(axis=1, keepdims=True))
    meta = kserve.stub(server.channel).ModelMetadata(pb.ModelMetadataRequest(name=model))
    assert meta.platform == platform
    config = kserve.stub(server.channel).ModelConfig(pb.ModelConfigRequest(name=model)).config
    assert config.parameters["device"].string_value == "cpu"


def test_graceful_shutdown_finishes_admitted_requests(tmp_path):
    builders.mlp(tmp_path / "slow" / "1" / "model.onnx", 4)
    # a long window keeps requests queued when the signal arrives; draining must still answer them
    (tmp_path / "slow" / "config.yaml").write_text("max_batch_size: 64\ndynamic_batching: {max_queue_delay_microseconds: 1500000}\n")
    server = RunningServer(tmp_path)
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(kserve.infer, server.channel, "slow", {"X": X[:1]}) for _ in range(8)]
        server.wait_for_metric("nv_inference_pending_request_count", 8, model="slow")
        server.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=30) for f in futures]
    assert all(r["Y"].shape == (1, 4) for r in results)
    assert server.proc.wait(30) == 0
    assert "ferry: stopped" in server.output
    with pytest.raises(grpc.RpcError):  # and nothing is accepted afterwards
        kserve.infer(server.channel, "slow", {"X": X[:1]})


TUNED = '''
platform: "onnxruntime_onnx"
max_batch_size: 8
optimization { graph { level: 1 } }
parameters { key: "execution_mode" value: { string_value: "1" } }
parameters { key: "enable_mem_arena" value: { string_value: "0" } }
parameters { key: "enable_mem_pattern" value: { string_value: "0" } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
'''


def test_triton_onnx_runtime_settings_load_and_a_bad_one_is_named(tmp_path):
    """A Triton repository's ONNX Runtime tuning loads unchanged and serves; a value Triton refuses leaves
    that model unavailable with the parameter named, and the rest of the repository serves."""
    builders.mlp(tmp_path / "tuned" / "1" / "model.onnx", 4, seed=1)
    (tmp_path / "tuned" / "config.pbtxt").write_text(TUNED)
    builders.mlp(tmp_path / "plain" / "1" / "model.onnx", 4, seed=1)
    builders.mlp(tmp_path / "bad" / "1" / "model.onnx", 4, seed=1)
    (tmp_path / "bad" / "config.pbtxt").write_text(TUNED.replace('string_value: "1" } }\nparameters { key: "enable_mem_arena"',
                                                                  'string_value: "fast" } }\nparameters { key: "enable_mem_arena"'))
    server = RunningServer(tmp_path)
    try:
        tuned, plain = (kserve.infer(server.channel, name, {"X": X})["Y"] for name in ("tuned", "plain"))
        # the same weights; other threads and graph optimizations may round differently
        np.testing.assert_allclose(tuned, plain, rtol=1e-4, atol=1e-5)
        models = {m.name: m for m in kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models}
        assert models["tuned"].state == "READY" and models["bad"].state == "UNAVAILABLE"
        assert "execution_mode" in models["bad"].reason and "fast" in models["bad"].reason
    finally:
        server.stop()
