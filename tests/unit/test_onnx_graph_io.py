"""An ONNX model's inputs and outputs are read from its file once per version of the file: on-demand
model control loads a model again each time it comes back, and parsing the weights just for the
signature was a quarter of each load. A file that changes is read again."""

from __future__ import annotations

import os

from onnx import TensorProto, helper

from protos import model_config_pb2 as mc
from server.backends import onnx_runtime
from tests import builders


def relu(path, width: int) -> None:
    builders.save_onnx([helper.make_node("Relu", ["X"], ["Y"])], [builders.tensor("X", TensorProto.FLOAT, ["batch", width])],
                       [builders.tensor("Y", TensorProto.FLOAT, ["batch", width])], path)


def completed(path) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m")
    onnx_runtime.OnnxRuntimeBackend.complete_config(config, path, 8)
    return config


def test_the_signature_is_read_once_per_version_of_the_file(tmp_path):
    path = tmp_path / "model.onnx"
    relu(path, 4)
    first = completed(path)
    assert [(t.name, list(t.dims)) for t in first.input] == [("X", [4])] and first.max_batch_size == 8
    misses = onnx_runtime._graph_io.cache_info().misses
    assert completed(path) == first
    assert onnx_runtime._graph_io.cache_info().misses == misses  # the second load did not parse the file
    relu(path, 6)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a new version, even within the clock's tick
    assert [list(t.dims) for t in completed(path).input] == [[6]]
