"""Triton's Python-based backends (`ferry serve --backend-directory DIR`): one `DIR/<name>/model.py`
serves every model whose config says `backend: "<name>"`, each model with its own config, files and
processes, as if the model.py were in the model's version folder. Without the flag, the same repository
is refused with a message that names it. NVIDIA's tritonclient runs in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:  # never imported here: its protobufs clash with ours
    pytest.skip(reason="tritonclient[grpc] is not installed (test extra)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("python_based_backends_calls.py")

# The backend: OUT = IN * the factor in the model's own <version>/factor.json; ARGS tells what the model saw.
BACKEND = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        names = {t["name"] for t in config.as_dict()["input"]}
        if "IN" not in names:
            config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [1, -1]})
            config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [1, -1]})
            config.add_output({"name": "ARGS", "data_type": "TYPE_STRING", "dims": [1, 1]})
        return config

    def initialize(self, args):
        with open(os.path.join(pb_utils.get_model_dir(), "factor.json")) as f:
            self.factor = json.load(f)["factor"]
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        seen = {k: args[k] for k in ("model_repository", "model_version", "model_name", "model_instance_name")}
        self.seen = json.dumps({**seen, "pid": os.getpid(), "model_dir": pb_utils.get_model_dir()})

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if self.decoupled:
                sender = request.get_response_sender()
                for value in data[0]:
                    out = pb_utils.Tensor("OUT", np.array([[value * self.factor]], np.float32))
                    sender.send(pb_utils.InferenceResponse([out]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            args = np.array([[self.seen.encode()]] * data.shape[0], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", (data * self.factor).astype(np.float32)), pb_utils.Tensor("ARGS", args)]))
        return None if self.decoupled else responses
'''

TRIPLE = '''backend: "scale"
runtime: "model.py"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "ARGS" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
'''

STREAM = '''backend: "scale"
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1, -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]
'''


def _repository(root: Path) -> tuple[Path, Path]:
    backends, repo = root / "backends", root / "models"
    (backends / "scale").mkdir(parents=True)
    (backends / "scale" / "model.py").write_text(BACKEND)
    for model, config, factors in (("double", 'backend: "scale"\n', {1: 2.0, 2: 20.0}), ("triple", TRIPLE, {1: 3.0}),
                                   ("stream", STREAM, {1: 5.0})):
        (repo / model).mkdir(parents=True)
        (repo / model / "config.pbtxt").write_text(config)
        for version, factor in factors.items():
            (repo / model / str(version)).mkdir()
            (repo / model / str(version) / "factor.json").write_text(json.dumps({"factor": factor}))
    return backends, repo


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("pbb")
    backends, repo = _repository(root)
    server = RunningServer(repo, "--backend-directory", str(backends), "--model-control-mode", "explicit")
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), server.address], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr + server.output
        yield repo, json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop()


def test_one_backend_model_py_serves_models_with_their_own_configs_and_files(served):
    _, out = served
    assert out["ready"] == [True, True, True]
    assert out["double_1"]["out"][0] == pytest.approx([2.0, 4.0, 6.0])
    assert out["double_2"]["out"][0] == pytest.approx([20.0, 40.0, 60.0])  # each version reads its own folder
    assert out["triple"]["out"][0] == pytest.approx([3.0, 6.0])


def test_the_model_py_gets_each_models_args_and_folders_not_the_backends(served):
    repo, out = served
    for key, model, version in (("double_1", "double", "1"), ("double_2", "double", "2"), ("triple", "triple", "1")):
        args = out[key]["args"]
        assert Path(args["model_repository"]) == repo / model
        assert Path(args["model_dir"]) == repo / model / version
        assert (args["model_name"], args["model_version"]) == (model, version)
    assert out["double_1"]["args"]["model_instance_name"] == "double_0_0"
    # each model (and version) runs in processes of its own
    assert len({out[key]["args"]["pid"] for key in ("double_1", "double_2", "triple")}) == 3


def test_the_config_keeps_the_backends_name_and_says_which_runtime(served):
    _, out = served
    double, triple = out["config_double"], out["config_triple"]
    assert (double["backend"], double["runtime"]) == ("scale", "model.py")
    assert [t["name"] for t in double["input"]] == ["IN"]  # completed by the backend's auto_complete_config
    assert (triple["backend"], triple["max_batch_size"]) == ("scale", 4)
    assert triple["instance_group"][0]["count"] == 2


def test_a_python_based_backend_may_be_decoupled(served):
    _, out = served
    assert out["stream"] == [[[5.0]], [[10.0]]]


def test_without_the_flag_the_backends_code_is_not_run_and_the_refusal_names_the_flag(tmp_path):
    _, repo = _repository(tmp_path)
    server = RunningServer(repo)
    try:
        assert "unknown backend 'scale'" in server.output
        assert "--backend-directory" in server.output
    finally:
        server.stop()


def test_a_backend_name_that_leaves_the_directory_is_refused(tmp_path):
    backends, repo = _repository(tmp_path)
    (repo / "double" / "config.pbtxt").write_text('backend: "../backends/scale"\n')
    server = RunningServer(repo, "--backend-directory", str(backends))
    try:
        assert "backend '../backends/scale' is not a folder name" in server.output
        assert "ferry: ready" in server.output
    finally:
        server.stop()
