"""A bad request batched beside good ones fails alone, for every backend kind.

Each model below fails on one request's data only (an out-of-range index for ONNX Runtime, a
negative value for TorchScript and the python backend). Sixteen concurrent requests fill one batch
(max_batch_size 16, a window far longer than the test), one of them poisoned: the batch fails, Ferry
splits it until the poisoned request is alone, and the fifteen others get their own answers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper

from tests import builders, kserve
from tests.conftest import RunningServer

BATCH = 16
WINDOW = f"max_batch_size: {BATCH}\ndynamic_batching: {{max_queue_delay_microseconds: 60000000}}\n"
TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)

RAISING_MODEL = '''
import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["X"]
        if (x < 0).any():
            raise ValueError("negative input")
        return {"Y": x * 2}
'''


def gather_model(path: Path) -> None:
    """IDX [batch, 1] INT64 -> Y = TABLE[IDX]: ONNX Runtime refuses an index outside the table."""
    table = helper.make_tensor("T", TensorProto.FLOAT, TABLE.shape, TABLE.ravel())
    builders.save_onnx([helper.make_node("Gather", ["T", "IDX"], ["Y"], axis=0)],
                       [builders.tensor("IDX", TensorProto.INT64, ["batch", 1])],
                       [builders.tensor("Y", TensorProto.FLOAT, ["batch", 1, 4])], path, [table])


def string_identity(path: Path) -> None:
    """IN [batch, n] STRING -> OUT: ONNX Runtime reads strings as text."""
    builders.save_onnx([helper.make_node("Identity", ["IN"], ["OUT"])],
                       [builders.tensor("IN", TensorProto.STRING, ["batch", "n"])],
                       [builders.tensor("OUT", TensorProto.STRING, ["batch", "n"])], path)


def raising_torchscript(folder: Path) -> None:
    import torch

    class Raising(torch.nn.Module):
        def forward(self, x):
            if bool((x < 0).any()):
                raise RuntimeError("negative input")
            return x * 2

    folder.mkdir(parents=True, exist_ok=True)
    torch.jit.script(Raising()).save(str(folder / "model.pt"))


IO = "input: [{name: X, data_type: TYPE_FP32, dims: [2]}]\noutput: [{name: Y, data_type: TYPE_FP32, dims: [2]}]\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    gather_model(repo / "gather" / "1" / "model.onnx")
    (repo / "gather" / "config.yaml").write_text(WINDOW)
    raising_torchscript(repo / "torch" / "1")
    (repo / "torch" / "config.yaml").write_text("backend: pytorch\n" + WINDOW + IO)
    (repo / "python" / "1").mkdir(parents=True)
    (repo / "python" / "1" / "model.py").write_text(RAISING_MODEL)
    (repo / "python" / "config.yaml").write_text("backend: python\n" + WINDOW + IO)
    string_identity(repo / "strings" / "1" / "model.onnx")
    (repo / "strings" / "config.yaml").write_text(
        "max_batch_size: 16\ndynamic_batching: {max_queue_delay_microseconds: 5000}\n")
    server = RunningServer(repo)
    yield server
    server.stop()


def call(server, model: str, inputs: dict[str, np.ndarray]):
    try:
        return kserve.infer(server.channel, model, inputs)
    except grpc.RpcError as exc:
        return exc


CASES = {
    # model: (good input for request i, the poisoned input, expected output of a good input)
    "gather": (lambda i: {"IDX": np.array([[i % 10]], np.int64)}, {"IDX": np.array([[99]], np.int64)},
               lambda x: TABLE[x["IDX"][:, 0]][:, None, :]),
    "torch": (lambda i: {"X": np.full((1, 2), i, np.float32)}, {"X": np.full((1, 2), -1, np.float32)},
              lambda x: x["X"] * 2),
    "python": (lambda i: {"X": np.full((1, 2), i, np.float32)}, {"X": np.full((1, 2), -1, np.float32)},
               lambda x: x["X"] * 2),
}


@pytest.mark.parametrize("model", list(CASES))
def test_a_poisoned_request_fails_alone_and_its_batch_neighbours_are_answered(server, model):
    good, poison, expected = CASES[model]
    inputs = [good(i) for i in range(BATCH - 1)]
    inputs.insert(5, poison)
    with ThreadPoolExecutor(BATCH) as pool:
        results = list(pool.map(lambda x: call(server, model, x), inputs))
    for x, got in zip(inputs, results):
        if x is poison:
            assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.INTERNAL, got
        else:
            assert not isinstance(got, grpc.RpcError), got.details()
            np.testing.assert_array_equal(got["Y"], expected(x))
    # one batch of 16 failed; its halves were re-run down to the poisoned request: 2 runs per level
    assert server.metric("ferry_batch_reruns", model=model) == 2 * 4
    assert server.metric("nv_inference_request_failure", model=model, reason="BACKEND") == 1
    assert server.metric("nv_inference_request_success", model=model) == BATCH - 1


def test_invalid_utf8_for_a_text_model_is_refused_at_decode_and_never_reaches_a_batch(server):
    """ONNX Runtime reads BYTES as text. Five requests with invalid UTF-8 among 300 good ones: each bad
    one is INVALID_ARGUMENT at decode (before it can join a batch), every good one is answered."""
    good = [np.array([[f"ferry {i}".encode(), "été".encode()]], dtype=object) for i in range(300)]
    bad = [np.array([[b"ok", b"\xff\xfe" + bytes([i])]], dtype=object) for i in range(5)]
    inputs = good[:]
    for k, x in enumerate(bad):
        inputs.insert(60 * k + 7, x)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda x: call(server, "strings", {"IN": x}), inputs))
    for x, got in zip(inputs, results):
        if any(x is b for b in bad):
            assert isinstance(got, grpc.RpcError) and got.code() == grpc.StatusCode.INVALID_ARGUMENT, got
            assert "'IN' element 1 is not valid UTF-8" in got.details()
        else:
            assert not isinstance(got, grpc.RpcError), got.details()
            assert got["OUT"].tolist() == x.tolist()
    assert server.metric("ferry_batch_reruns", model="strings") == 0  # no batch ever failed
    assert server.metric("nv_inference_request_success", model="strings") == 300
