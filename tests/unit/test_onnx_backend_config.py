"""What the ONNX Runtime backend reads from a model's file and config.

An ONNX model's inputs and outputs are read from its file once per version of the file: on-demand
model control loads a model again each time it comes back, and parsing the weights just for the
signature was a quarter of each load. A file that changes is read again. A Triton config's session
settings reach the session, and values Triton refuses are refused."""

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


def triton_tuned(tmp_path, **parameters) -> tuple[mc.ModelConfig, object]:
    path = tmp_path / "model.onnx"
    relu(path, 4)
    config = mc.ModelConfig(name="m")
    for key, value in parameters.items():
        config.parameters[key.replace("__", ".")].string_value = value
    onnx_runtime.OnnxRuntimeBackend.complete_config(config, path, 8)
    return config, path


def test_triton_session_settings_reach_the_session(tmp_path):
    """A Triton repository's ONNX Runtime settings, as Triton's backend reads them, reach the session
    that serves the model, and it still answers right."""
    import numpy as np

    from server.backends.base import Device

    config, path = triton_tuned(tmp_path, execution_mode="1", enable_mem_arena="0", enable_mem_pattern="false")
    config.optimization.graph.level = -1
    backend = onnx_runtime.OnnxRuntimeBackend(config, path, Device("cpu"))
    backend.load()
    used = backend.session.get_session_options()
    assert used.execution_mode == onnx_runtime.ort.ExecutionMode.ORT_PARALLEL
    assert used.enable_cpu_mem_arena is False and used.enable_mem_pattern is False
    assert used.graph_optimization_level == onnx_runtime.ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    np.testing.assert_array_equal(backend.execute({"X": x})["Y"], np.maximum(x, 0))
    config, path = triton_tuned(tmp_path, memory__enable_memory_arena_shrinkage="cpu:0")  # needs the arena: on
    shrinking = onnx_runtime.OnnxRuntimeBackend(config, path, Device("cpu"))
    shrinking.load()
    assert shrinking._run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"
    np.testing.assert_array_equal(shrinking.execute({"X": x})["Y"], np.maximum(x, 0))
    defaults = onnx_runtime.session_options(mc.ModelConfig(name="m"))
    assert defaults.enable_cpu_mem_arena is True and defaults.execution_mode == onnx_runtime.ort.ExecutionMode.ORT_SEQUENTIAL
    assert defaults.graph_optimization_level == onnx_runtime.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    config.optimization.graph.level = 2
    assert onnx_runtime.session_options(config).graph_optimization_level == onnx_runtime.ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def test_values_triton_refuses_are_refused_naming_the_parameter(tmp_path):
    import pytest

    from server.errors import ConfigError

    for key, value in (("execution_mode", "2"), ("enable_mem_arena", "maybe"), ("enable_mem_pattern", "")):
        config, _ = triton_tuned(tmp_path, **{key: value})
        with pytest.raises(ConfigError, match=key):
            onnx_runtime.session_options(config)
    # shrinking the CPU arena while turning it off fails every run in ONNX Runtime: refused at load instead
    config, _ = triton_tuned(tmp_path, enable_mem_arena="0", memory__enable_memory_arena_shrinkage="cpu:0")
    with pytest.raises(ConfigError, match="enable_mem_arena"):
        onnx_runtime.run_options(config)
