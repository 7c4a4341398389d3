"""BF16 tensors through a Python model, as Triton serves them (qa/L0_backend_python python_test.py test_bf16):
two bytes an element on the wire, the model reaches them through DLPack as torch.bfloat16, and
`as_numpy` refuses them, since numpy has no bfloat16 of its own. tritonclient runs in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc,http] is not installed (it is part of the test extra)", allow_module_level=True)

_CONFIG = """
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_BF16, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_BF16, dims: [ 2 ] },
         { name: "SEEN", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""

# Doubles X in torch and says what it saw: the torch dtype, the refusal of as_numpy, Triton's datatype numbers.
_MODEL = textwrap.dedent('''
    import json

    import numpy as np
    import torch
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "X")
                t = torch.utils.dlpack.from_dlpack(x.to_dlpack())
                y = pb_utils.Tensor.from_dlpack("Y", torch.utils.dlpack.to_dlpack(t * 2))
                try:
                    x.as_numpy()
                    refusal = None
                except pb_utils.TritonModelException as exc:
                    refusal = str(exc)
                seen = {"torch": str(t.dtype), "as_numpy": refusal, "x": x.triton_dtype(), "y": y.triton_dtype(),
                        "shape": y.shape()}
                note = pb_utils.Tensor("SEEN", np.array([[json.dumps(seen).encode()]] * t.shape[0], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse([y, note]))
            return responses
''')


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "bf16_double" / "1").mkdir(parents=True)
    (repo / "bf16_double" / "config.pbtxt").write_text(_CONFIG)
    (repo / "bf16_double" / "1" / "model.py").write_text(_MODEL)
    server = RunningServer(repo)
    try:
        script = Path(__file__).with_name("python_bf16_calls.py")
        done = subprocess.run([sys.executable, str(script), server.address, server.http_address],
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr + "".join(server.lines)
        yield server, json.loads(done.stdout)
    finally:
        server.stop()


_DOUBLED = [[3.0, -4.5], [0.015625, 2e38]]


def _close(got, want) -> bool:
    return all(abs(g - w) <= 1e-2 * abs(w) for row_g, row_w in zip(got, want) for g, w in zip(row_g, row_w))


def test_the_model_gets_torch_bfloat16_through_dlpack_and_as_numpy_refuses(calls):
    _, calls = calls
    seen = calls["http_binary"]["seen"]
    assert seen["torch"] == "torch.bfloat16"
    assert "tensor dtype is bf16 and cannot be converted to numpy" in seen["as_numpy"].lower()
    assert seen["x"] == seen["y"] == 14  # TRITONSERVER_TYPE_BF16
    assert seen["shape"] == [1, 2] or seen["shape"] == [2, 2]


def test_bf16_comes_back_as_bf16_over_http_binary_and_grpc(calls):
    _, calls = calls
    for answer in (calls["http_binary"], calls["grpc"]):
        assert answer["datatype"] == "BF16"
        assert answer["dtype"] == "bfloat16"
        assert _close(answer["values"], _DOUBLED)


def test_a_bf16_output_asked_for_as_json_comes_as_numbers(calls):
    _, calls = calls
    answer = calls["http_json"]
    assert answer["datatype"] == "BF16"
    assert _close([answer["values"][:2], answer["values"][2:]], _DOUBLED)


def test_bf16_raw_bytes_must_be_two_per_element_and_typed_contents_are_refused(calls):
    server, _ = calls
    stub = kserve.stub(server.channel)
    short = pb.ModelInferRequest(model_name="bf16_double", raw_input_contents=[b"\0" * 6])
    short.inputs.add(name="X", datatype="BF16", shape=[2, 2])
    typed = pb.ModelInferRequest(model_name="bf16_double")
    typed.inputs.add(name="X", datatype="BF16", shape=[1, 2]).contents.fp32_contents.extend([1.0, 2.0])
    for request, words in ((short, "Expected 8, got 6"), (typed, "BF16 can only be sent as raw_input_contents")):
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in caught.value.details()
