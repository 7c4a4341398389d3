"""Tiny, seeded models and model folders that tests build on the fly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ONNX_TYPES = {
    "BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8, "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32, "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16, "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def save_onnx(nodes, inputs, outputs, path: Path, initializers=()) -> Path:
    graph = helper.make_graph(nodes, path.parent.parent.name or "model", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def tensor(name: str, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def add_sub(path: Path, width: int = 4) -> Path:
    """INPUT0, INPUT1 [batch, width] FP32 -> OUTPUT0 = a + b, OUTPUT1 = a - b (Triton's 'simple')."""
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]
    ins = [tensor(n, TensorProto.FLOAT, ["batch", width]) for n in ("INPUT0", "INPUT1")]
    outs = [tensor(n, TensorProto.FLOAT, ["batch", width]) for n in ("OUTPUT0", "OUTPUT1")]
    return save_onnx(nodes, ins, outs, path)


def double(repo: Path, name: str = "onnx_b") -> Path:
    """`name`: ONNX, X [batch, n] FP32 -> Y = 2X, batching (max_batch_size 8, dims [-1])."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    path = save_onnx([helper.make_node("Mul", ["X", "two"], ["Y"])], [tensor("X", TensorProto.FLOAT, ["batch", "n"])],
                     [tensor("Y", TensorProto.FLOAT, ["batch", "n"])], repo / name / "1" / "model.onnx", [two])
    (repo / name / "config.pbtxt").write_text(
        'backend: "onnxruntime"\nmax_batch_size: 8\ndynamic_batching {}\n'
        'input [{name: "X", data_type: TYPE_FP32, dims: [-1]}]\noutput [{name: "Y", data_type: TYPE_FP32, dims: [-1]}]\n')
    return path


def identity_all_types(path: Path, skip: tuple[str, ...] = ()) -> Path:
    """IN_<TYPE> [batch, n] -> OUT_<TYPE>, one pair per KServe datatype numpy can hold."""
    types = {t: e for t, e in ONNX_TYPES.items() if t not in skip}
    nodes = [helper.make_node("Identity", [f"IN_{t}"], [f"OUT_{t}"]) for t in types]
    ins = [tensor(f"IN_{t}", e, ["batch", "n"]) for t, e in types.items()]
    outs = [tensor(f"OUT_{t}", e, ["batch", "n"]) for t, e in types.items()]
    return save_onnx(nodes, ins, outs, path)


def fragile(path: Path) -> Path:
    """X [batch, n] FP32 -> Y = X, but ONNX Runtime fails when the element count is not a multiple of 3."""
    shape3 = helper.make_tensor("shape3", TensorProto.INT64, [2], [-1, 3])
    nodes = [helper.make_node("Reshape", ["X", "shape3"], ["X3"]),
             helper.make_node("Shape", ["X"], ["xshape"]),
             helper.make_node("Reshape", ["X3", "xshape"], ["Y"])]
    return save_onnx(nodes, [tensor("X", TensorProto.FLOAT, ["batch", "n"])],
                     [tensor("Y", TensorProto.FLOAT, ["batch", "n"])], path, [shape3])


def mlp(path: Path, width: int = 16, seed: int = 0) -> Path:
    """X [batch, width] -> Y = relu(X W + b): a real computation whose rows are independent."""
    rng = np.random.default_rng(seed)
    w = helper.make_tensor("W", TensorProto.FLOAT, [width, width], rng.standard_normal((width, width)).astype(np.float32).ravel())
    b = helper.make_tensor("B", TensorProto.FLOAT, [width], rng.standard_normal(width).astype(np.float32))
    nodes = [helper.make_node("Gemm", ["X", "W", "B"], ["H"]), helper.make_node("Relu", ["H"], ["Y"])]
    return save_onnx(nodes, [tensor("X", TensorProto.FLOAT, ["batch", width])],
                     [tensor("Y", TensorProto.FLOAT, ["batch", width])], path, [w, b])


def torch_affine(folder: Path, export: bool = False) -> Path:
    """x [batch, 4] FP32 -> (2x + 1, sum over dim 1): TorchScript `model.pt` or torch.export `model.pt2`."""
    import torch

    class Affine(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1, x.sum(dim=1, keepdim=True)

    folder.mkdir(parents=True, exist_ok=True)
    if export:
        batch = torch.export.Dim("batch", min=1, max=1024)
        program = torch.export.export(Affine(), (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
        path = folder / "model.pt2"
        torch.export.save(program, str(path))
    else:
        path = folder / "model.pt"
        torch.jit.script(Affine()).save(str(path))
    return path


TORCH_AFFINE_CONFIG = """
max_batch_size: 8
dynamic_batching: {max_queue_delay_microseconds: 2000}
input: [{name: x, data_type: TYPE_FP32, dims: [4]}]
output:
  - {name: y, data_type: TYPE_FP32, dims: [4]}
  - {name: total, data_type: TYPE_FP32, dims: [1]}
"""


GATED_MODEL = '''
"""Test model: Y = X. An execution holding a negative value first touches `<gate>.running`, then waits
until the gate file exists; every execution reports its turn (0, 1, 2, ...)."""
import itertools, os, threading, time
import numpy as np

TURN = itertools.count()
PARTIES = int(os.environ.get("FERRY_TEST_BARRIER", "2"))


def meet(folder):
    """Pass only while PARTIES executions run at once: each leaves a mark in `folder` and waits for the
    others' (instances are processes of their own, so no in-process barrier can span them)."""
    open(os.path.join(folder, f"{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}"), "w").close()
    deadline = time.monotonic() + 120  # a generous bound: the other execution may start late on a busy machine
    while len(os.listdir(folder)) < PARTIES:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(os.listdir(folder))} of {PARTIES} executions ran at the same time")
        time.sleep(0.002)


class Model:
    def initialize(self, args):
        params = args["config"].get("parameters", {})
        self.gate = params.get("gate", {}).get("string_value")
        self.barrier = params.get("barrier", {}).get("string_value")
        self.hold_s = float(params.get("hold_s", {}).get("string_value", 30))

    def execute(self, inputs):
        if self.barrier:
            meet(self.barrier)  # raises unless two instances run at the same time
        x = inputs["X"]
        if self.gate and (x < 0).any():
            open(self.gate + ".running", "w").close()
            deadline = time.monotonic() + self.hold_s  # a forgotten gate does not hold the test's server forever
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.002)
        turn = np.full((x.shape[0], 1), next(TURN), np.int64)
        return {"Y": x, "TURN": turn}
'''


def gated_model(repo: Path, name: str, extra_yaml: str = "", gate: Path | None = None, barrier: bool = False,
                max_batch_size: int = 8, hold_s: float = 30) -> Path:
    """A python-backend model whose executions block until `gate` exists (tests open it when ready), or
    `hold_s` has passed: a test whose assertion depends on the hold lasting opens the gate itself and
    sets `hold_s` far beyond any slow machine's run."""
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(GATED_MODEL)
    params = {}
    if gate is not None:
        params["gate"] = str(gate)
        params["hold_s"] = str(hold_s)
    if barrier:
        meeting = repo.parent / f"{name}.barrier"  # a folder both instances' processes see
        meeting.mkdir(exist_ok=True)
        params["barrier"] = str(meeting)
    lines = ["backend: python", f"max_batch_size: {max_batch_size}",
             "input: [{name: X, data_type: TYPE_FP32, dims: [2]}]",
             "output: [{name: Y, data_type: TYPE_FP32, dims: [2]}, {name: TURN, data_type: TYPE_INT64, dims: [1]}]"]
    if params:
        lines.append("parameters: {" + ", ".join(f"{k}: {{string_value: '{v}'}}" for k, v in params.items()) + "}")
    (folder / "config.yaml").write_text("\n".join(lines) + "\n" + extra_yaml)
    return folder


def padded_sum(path: Path) -> Path:
    """A variable-length model whose answers depend on each row's true length, so padding that leaks shows.

    X [batch, L, 2] FP32, LENGTHS [batch, 1] INT64 and MASK [batch, L] FP32 (both filled by the server) ->
    SUM [batch, 2] (X summed over the first LENGTHS positions), MEAN [batch, 2] (X averaged under MASK),
    Y [batch, L, 2] = 2X + 1 (per position, sliced back by the server), LEN [batch, 1] = LENGTHS.
    """
    consts = [helper.make_tensor(n, TensorProto.INT64, v.shape, v) for n, v in (
        ("zero", np.array(0)), ("one", np.array(1)), ("ax0", np.array([0])), ("ax1", np.array([1])),
        ("ax2", np.array([2])))]
    consts += [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("onef", TensorProto.FLOAT, [], [1.0])]
    nodes = [
        helper.make_node("Shape", ["X"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["L"]),
        helper.make_node("Range", ["zero", "L", "one"], ["pos"]),  # [L]
        helper.make_node("Unsqueeze", ["pos", "ax0"], ["pos_row"]),  # [1, L]
        helper.make_node("Less", ["pos_row", "LENGTHS"], ["valid"]),  # [batch, L]
        helper.make_node("Cast", ["valid"], ["validf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["validf", "ax2"], ["valid3"]),  # [batch, L, 1]
        helper.make_node("Mul", ["X", "valid3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "ax1"], ["SUM"], keepdims=0),
        helper.make_node("Unsqueeze", ["MASK", "ax2"], ["mask3"]),
        helper.make_node("Mul", ["X", "mask3"], ["under_mask"]),
        helper.make_node("ReduceSum", ["under_mask", "ax1"], ["mask_total"], keepdims=0),
        helper.make_node("ReduceSum", ["MASK", "ax1"], ["mask_count"], keepdims=1),
        helper.make_node("Div", ["mask_total", "mask_count"], ["MEAN"]),
        helper.make_node("Mul", ["X", "two"], ["x2"]),
        helper.make_node("Add", ["x2", "onef"], ["Y"]),
        helper.make_node("Identity", ["LENGTHS"], ["LEN"]),
    ]
    ins = [tensor("X", TensorProto.FLOAT, ["batch", "L", 2]), tensor("LENGTHS", TensorProto.INT64, ["batch", 1]),
           tensor("MASK", TensorProto.FLOAT, ["batch", "L"])]
    outs = [tensor("SUM", TensorProto.FLOAT, ["batch", 2]), tensor("MEAN", TensorProto.FLOAT, ["batch", 2]),
            tensor("Y", TensorProto.FLOAT, ["batch", "L", 2]), tensor("LEN", TensorProto.INT64, ["batch", 1])]
    return save_onnx(nodes, ins, outs, path, consts)


PADDED_SUM_CONFIG = """
max_batch_size: 4
input:
  - {name: X, data_type: TYPE_FP32, dims: [-1, 2], variable_length: true, padding_value: 1000,
     lengths_input: LENGTHS, mask_input: MASK}
  - {name: LENGTHS, data_type: TYPE_INT64, dims: [1]}
  - {name: MASK, data_type: TYPE_FP32, dims: [-1]}
output:
  - {name: SUM, data_type: TYPE_FP32, dims: [2]}
  - {name: MEAN, data_type: TYPE_FP32, dims: [2]}
  - {name: Y, data_type: TYPE_FP32, dims: [-1, 2], variable_length: true}
  - {name: LEN, data_type: TYPE_INT64, dims: [1]}
"""


DENSENET_WEIGHTS = np.arange(30, dtype=np.float32).reshape(10, 3) % 7 - 3  # [classes, channels], fixed


def densenet_like(repo: Path, name: str = "densenet_onnx", batching: bool = False) -> Path:
    """Triton's densenet_onnx quickstart, in miniature: data_0 [3, 4, 4] -> fc6_1 [10] scores, the model
    file shaped [1, 3, 4, 4] -> [1, 10, 1, 1] and the config bridging them with `reshape`, as Triton's
    own config.pbtxt does; labels in densenet_labels.txt. Scores = DENSENET_WEIGHTS @ channel means."""
    batch = "N" if batching else 1
    weights = helper.make_tensor("W", TensorProto.FLOAT, [10, 3, 1, 1], DENSENET_WEIGHTS.reshape(-1).tolist())
    nodes = [helper.make_node("GlobalAveragePool", ["data_0"], ["pooled"]),
             helper.make_node("Conv", ["pooled", "W"], ["fc6_1"])]
    save_onnx(nodes, [tensor("data_0", TensorProto.FLOAT, [batch, 3, 4, 4])],
              [tensor("fc6_1", TensorProto.FLOAT, [batch, 10, 1, 1])], repo / name / "1" / "model.onnx", [weights])
    input_reshape = "" if batching else "reshape { shape: [ 1, 3, 4, 4 ] }"
    output_shape = "10, 1, 1" if batching else "1, 10, 1, 1"
    (repo / name / "config.pbtxt").write_text(f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {4 if batching else 0}
input [ {{ name: "data_0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 4, 4 ] {input_reshape} }} ]
output [ {{ name: "fc6_1" data_type: TYPE_FP32 dims: [ 10 ] reshape {{ shape: [ {output_shape} ] }}
            label_filename: "densenet_labels.txt" }} ]
""")
    (repo / name / "densenet_labels.txt").write_text("".join(f"CLASS_{i}\n" for i in range(10)))
    return repo / name


def script_models(repo: Path) -> None:
    """What tests/integration/tritonclient_calls.py calls: `simple` (add/sub), `echo` (BYTES identity) and
    `broken` (a file ONNX Runtime cannot read, so the model fails to load)."""
    add_sub(repo / "simple" / "1" / "model.onnx")
    save_onnx([helper.make_node("Identity", ["TEXT"], ["TEXT_OUT"])],
              [tensor("TEXT", TensorProto.STRING, ["batch", 2])],
              [tensor("TEXT_OUT", TensorProto.STRING, ["batch", 2])], repo / "echo" / "1" / "model.onnx")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"junk")
