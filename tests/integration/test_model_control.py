"""Loading, unloading and hot-reloading models while the server runs."""

from __future__ import annotations

import shutil
import time

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def index(server) -> dict[str, tuple[str, str, str]]:
    models = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
    return {m.name: (m.version, m.state, m.reason) for m in models}


def wait_for(predicate, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the repository change was never picked up"
        time.sleep(0.05)


@pytest.fixture
def repo(tmp_path):
    builders.mlp(tmp_path / "mlp" / "1" / "model.onnx", 4, seed=1)
    return tmp_path


def test_unload_and_load_through_the_rpcs(repo):
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")  # load/unload calls: explicit model control
    try:
        api = kserve.stub(server.channel)
        assert "model_repository" in api.ServerMetadata(pb.ServerMetadataRequest()).extensions
        before = kserve.infer(server.channel, "mlp", {"X": X})["Y"]
        api.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mlp"))
        assert index(server)["mlp"][1:] == ("UNAVAILABLE", "unloaded")
        with pytest.raises(grpc.RpcError) as info:
            kserve.infer(server.channel, "mlp", {"X": X})
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        builders.mlp(repo / "mlp" / "2" / "model.onnx", 4, seed=2)  # a new version appears before the reload
        api.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        assert index(server)["mlp"][:2] == ("2", "READY")
        after = kserve.infer(server.channel, "mlp", {"X": X})
        assert not np.array_equal(after["Y"], before)  # version 2 answers now
        for request, code in ((pb.RepositoryModelLoadRequest(model_name="nope"), grpc.StatusCode.NOT_FOUND),
                              (pb.RepositoryModelLoadRequest(model_name="mlp", parameters={"cfg": pb.ModelRepositoryParameter(string_param="{}")}),
                               grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as info:
                api.RepositoryModelLoad(request)
            assert info.value.code() == code
    finally:
        server.stop()


def test_a_failed_reload_keeps_the_old_version_serving(repo):
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")  # load/unload calls: explicit model control
    try:
        before = kserve.infer(server.channel, "mlp", {"X": X})["Y"]
        (repo / "mlp" / "config.yaml").write_text("max_batch_size: 4\nnot_a_field: 1\n")
        with pytest.raises(grpc.RpcError) as info:
            kserve.stub(server.channel).RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mlp"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "mlp/config.yaml: line 2: unknown field" in info.value.details()
        assert index(server)["mlp"][1] == "READY"
        # exact: the same model file, request and batch shape on the same machine answer bit for bit
        np.testing.assert_array_equal(kserve.infer(server.channel, "mlp", {"X": X})["Y"], before)
    finally:
        server.stop()


def test_polling_picks_up_new_changed_and_removed_models(repo):
    server = RunningServer(repo, "--model-control-mode", "poll", "--poll-repository-seconds", "0.1")
    try:
        builders.mlp(repo / "late" / "1" / "model.onnx", 4, seed=3)
        wait_for(lambda: index(server).get("late", ("", ""))[1] == "READY")
        assert kserve.infer(server.channel, "late", {"X": X})["Y"].shape == (2, 4)
        builders.mlp(repo / "mlp" / "2" / "model.onnx", 4, seed=4)
        wait_for(lambda: index(server)["mlp"][:2] == ("2", "READY"))
        shutil.rmtree(repo / "late")
        wait_for(lambda: index(server)["late"][1] == "UNAVAILABLE")
        with pytest.raises(grpc.RpcError) as info:
            kserve.infer(server.channel, "late", {"X": X})
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()
