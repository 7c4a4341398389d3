"""ONNX models the benchmarks build on the fly (seeded random weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _weights(rng, name, shape):
    return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)


def _save(nodes, inputs, outputs, initializers, path: Path) -> Path:
    graph = helper.make_graph(nodes, path.parent.parent.name, inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def light_mlp(path: Path, seed: int = 0) -> Path:
    """x [-1, 256] -> three 1024-wide Gemm+Relu -> y [-1, 16]: per-request overhead dominates."""
    rng = np.random.default_rng(seed)
    sizes = [256, 1024, 1024, 1024]
    inits, nodes, prev = [], [], "x"
    for i in range(3):
        inits += [_weights(rng, f"W{i}", (sizes[i], sizes[i + 1])), numpy_helper.from_array(np.zeros(sizes[i + 1], np.float32), f"B{i}")]
        nodes += [helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [f"g{i}"]), helper.make_node("Relu", [f"g{i}"], [f"r{i}"])]
        prev = f"r{i}"
    inits.append(_weights(rng, "Wout", (1024, 16)))
    nodes.append(helper.make_node("MatMul", [prev, "Wout"], ["y"]))
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits, path)


def heavy_encoder(path: Path, seed: int = 0) -> Path:
    """x [-1, 32, 512] -> two token-wise 512->2048->512 blocks -> mean over tokens -> y [-1, 16]."""
    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    for i in range(2):
        inits += [_weights(rng, f"Up{i}", (512, 2048)), _weights(rng, f"Down{i}", (2048, 512))]
        nodes += [helper.make_node("MatMul", [prev, f"Up{i}"], [f"u{i}"]), helper.make_node("Relu", [f"u{i}"], [f"a{i}"]),
                  helper.make_node("MatMul", [f"a{i}", f"Down{i}"], [f"d{i}"])]
        prev = f"d{i}"
    inits.append(_weights(rng, "Head", (512, 16)))
    nodes += [helper.make_node("ReduceMean", [prev], ["pooled"], axes=[1], keepdims=0),
              helper.make_node("MatMul", ["pooled", "Head"], ["y"])]
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32, 512])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits, path)
