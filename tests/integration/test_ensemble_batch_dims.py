"""Ensembles that do not batch (max_batch_size 0) over batching and non-batching steps, and tensors with
a zero dimension through every kind of model, as Triton serves them: the ensemble adds the batch
dimension where a batching step needs one and strips a one-row batch where a non-batching step does
not (see server/runners/ensemble_shapes.py). Each ensemble answer is compared with its steps run one by
one, through tritonclient gRPC and HTTP (in a subprocess: its protobuf messages clash with Ferry's)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import builders, kserve, model_kinds
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient is not installed (it is part of the test extra)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("ensemble_shapes_calls.py")

PY_MODEL = '''
import numpy as np


class Model:
    def execute(self, inputs):
        return {{"Y": ({expression}).astype(np.float32)}}
'''


def py_config(max_batch_size: int, dims: str) -> str:
    batching = "dynamic_batching: {}\n" if max_batch_size else ""
    return (f"backend: python\nmax_batch_size: {max_batch_size}\n{batching}"
            f"input: [{{name: X, data_type: TYPE_FP32, dims: {dims}}}]\n"
            f"output: [{{name: Y, data_type: TYPE_FP32, dims: {dims}}}]\n")


def flat_ensemble(repo: Path, name: str, dims: str, steps: list[tuple[str, str, str]]) -> None:
    written = ", ".join(f'{{model_name: "{m}", input_map: {{key: "X", value: "{src}"}}, output_map: {{key: "Y", value: "{dst}"}}}}'
                        for m, src, dst in steps)
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(f"""
platform: "ensemble"
max_batch_size: 0
input [{{name: "IN", data_type: TYPE_FP32, dims: {dims}}}]
output [{{name: "OUT", data_type: TYPE_FP32, dims: {dims}}}]
ensemble_scheduling {{ step [ {written} ] }}
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.double(repo)
    model_kinds.python_model(repo, "py_n", PY_MODEL.format(expression='inputs["X"] + 1'), py_config(0, "[-1]"))
    model_kinds.python_model(repo, "py_n2", PY_MODEL.format(expression='inputs["X"] - 5'), py_config(0, "[-1, -1]"))
    model_kinds.python_model(repo, "py_b", PY_MODEL.format(expression='inputs["X"] * 3'), py_config(8, "[-1]"))
    builders.torch_affine(repo / "torch_b" / "1")
    (repo / "torch_b" / "config.yaml").write_text(builders.TORCH_AFFINE_CONFIG)
    # flat: IN [n] -> onnx_b (batching: gets [1, n]) -> py_n (not batching: gets [n]) -> py_b (gets [1, n]) -> OUT [n]
    flat_ensemble(repo, "flat", "[-1]", [("onnx_b", "IN", "a"), ("py_n", "a", "b"), ("py_b", "b", "OUT")])
    # table: IN [rows, 4] -> onnx_b (a batch of `rows`, zero included) -> py_n2 (not batching: [rows, 4]) -> OUT
    flat_ensemble(repo, "table", "[-1, 4]", [("onnx_b", "IN", "a"), ("py_n2", "a", "OUT")])
    running = RunningServer(repo)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def found(server) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), server.address, server.http_address],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


FLAT = {"three": [1, -2, 3.5], "one": [4], "empty": []}
TABLE = {"rows2": np.arange(8).reshape(2, 4), "row1": np.arange(4).reshape(1, 4), "rows0": np.zeros([0, 4])}


@pytest.mark.parametrize("door", ["grpc", "http"])
@pytest.mark.parametrize("case", sorted(FLAT))
def test_non_batching_ensemble_over_batching_and_non_batching_steps(found, door, case):
    answer = found[door][f"flat_{case}"]
    x = np.array(FLAT[case], np.float32)
    assert answer["ensemble"] == answer["by_hand"], answer  # shape and values, step by step
    assert answer["ensemble"]["shape"] == [len(x)]
    np.testing.assert_allclose(answer["ensemble"]["value"], (x * 2 + 1) * 3, rtol=1e-6)


@pytest.mark.parametrize("door", ["grpc", "http"])
@pytest.mark.parametrize("case", sorted(TABLE))
def test_non_batching_ensemble_hands_rows_to_a_batching_step(found, door, case):
    answer = found[door][f"table_{case}"]
    x = TABLE[case].astype(np.float32)
    assert answer["ensemble"] == answer["by_hand"], answer
    assert answer["ensemble"]["shape"] == list(x.shape)
    np.testing.assert_allclose(np.array(answer["ensemble"]["value"], np.float32).reshape(x.shape), x * 2 - 5, rtol=1e-6)


ZERO = {"zero_onnx_b_0x3": [0, 3], "zero_onnx_b_1x0": [1, 0], "zero_py_b_0x2": [0, 2], "zero_py_b_2x0": [2, 0],
        "zero_py_n_0": [0], "zero_torch_b_0x4": [0, 4]}


@pytest.mark.parametrize("door", ["grpc", "http"])
@pytest.mark.parametrize("case", sorted(ZERO))
def test_zero_size_tensors_through_every_kind_of_model(found, door, case):
    answer = found[door][case]
    assert answer.get("shape") == ZERO[case], answer  # an empty answer of the same shape, not an error


def test_zero_row_requests_batch_with_others(server):
    """Requests of 0, 2, 0 and 1 rows sent at once to a dynamic-batching model: each gets its own rows back."""
    stub = kserve.stub(server.channel)
    rows = [0, 2, 0, 1]
    values = [np.arange(r * 3, dtype=np.float32).reshape(r, 3) + 10 * i for i, r in enumerate(rows)]
    calls = [stub.ModelInfer.future(kserve.request("onnx_b", {"X": v}), timeout=60) for v in values]
    for call, value in zip(calls, values):
        out = kserve.outputs(call.result())["Y"]
        assert out.shape == value.shape and out.tolist() == (value * 2).tolist()
