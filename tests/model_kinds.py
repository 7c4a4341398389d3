"""Model folders for the stateful and composed kinds (ensembles, decoupled, batched python, sequences)."""

from __future__ import annotations

from pathlib import Path

STEP_MODEL = '''
import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["X"]
        if {fail_negative} and (x < 0).any():
            raise ValueError("negative input")
        return {{"Y": ({expression}).astype(np.float32)}}
'''

STEP_CONFIG = """
backend: python
max_batch_size: 8
input: [{name: X, data_type: TYPE_FP32, dims: [4]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [4]}]
dynamic_batching: {}
"""

ROWS_MODEL = '''
import numpy as np


class Model:
    def execute(self, inputs):
        x = inputs["X"]  # every request of the batch, joined along dim 0
        return {"Y": (x * 2).astype(np.float32), "ROWS": np.full((len(x), 1), len(x), np.int32)}
'''

ROWS_CONFIG = """
backend: python
max_batch_size: 4
input: [{name: X, data_type: TYPE_FP32, dims: [4]}]
output:
  - {name: Y, data_type: TYPE_FP32, dims: [4]}
  - {name: ROWS, data_type: TYPE_INT32, dims: [1]}
# A batch is cut when 4 requests are queued; the window is long so 4 concurrent requests always make one.
dynamic_batching: {max_queue_delay_microseconds: 30000000}
instance_group: [{count: 1, kind: KIND_CPU}]
"""


def python_model(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.yaml").write_text(config)


def chain(repo: Path) -> None:
    """`chain` = add_one -> fragile_triple (fails on a negative value) -> minus_two, all X -> Y [4]."""
    for name, expression, fail in (("add_one", "x + 1", False), ("fragile_triple", "x * 3", True),
                                   ("minus_two", "x - 2", False)):
        python_model(repo, name, STEP_MODEL.format(expression=expression, fail_negative=fail), STEP_CONFIG)
    steps = ", ".join(
        f'{{model_name: "{model}", input_map: {{key: "X", value: "{src}"}}, output_map: {{key: "Y", value: "{dst}"}}}}'
        for model, src, dst in (("add_one", "IN", "a"), ("fragile_triple", "a", "b"), ("minus_two", "b", "OUT")))
    (repo / "chain" / "1").mkdir(parents=True)
    (repo / "chain" / "config.pbtxt").write_text(f"""
platform: "ensemble"
max_batch_size: 8
input [{{name: "IN", data_type: TYPE_FP32, dims: [4]}}]
output [{{name: "OUT", data_type: TYPE_FP32, dims: [4]}}]
ensemble_scheduling {{ step [ {steps} ] }}
""")


def ensemble(repo: Path, name: str, steps: list[tuple[str, dict[str, str], str]], output: str, extra: str = "") -> None:
    """An ensemble over X [2] FP32 answering `output` [2]. `steps`: (model, {step input: ensemble tensor},
    ensemble tensor its Y goes to), in config order; `extra`: more config text."""
    written = ", ".join(
        f'{{model_name: "{model}", '
        + ", ".join(f'input_map: {{key: "{k}", value: "{v}"}}' for k, v in inputs.items())
        + f', output_map: {{key: "Y", value: "{out}"}}}}'
        for model, inputs, out in steps)
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(f"""
platform: "ensemble"
max_batch_size: 8
input [{{name: "X", data_type: TYPE_FP32, dims: [2]}}]
output [{{name: "{output}", data_type: TYPE_FP32, dims: [2]}}]
ensemble_scheduling {{ step [ {written} ] }}
{extra}""")


def rows(repo: Path) -> None:
    """`rows`: a batched python model that reports how many rows its call received."""
    python_model(repo, "rows", ROWS_MODEL, ROWS_CONFIG)


ACCUMULATE_MODEL = '''
import numpy as np


class Model:
    """OUTPUT = the sum of INPUT over the sequence so far, kept in implicit state; CORR echoes CORRID."""

    def execute(self, inputs):
        start = inputs["START"].astype(bool)  # [rows, 1]
        total = np.where(start, 0, inputs["ACC_IN"]) + inputs["INPUT"]
        out = {"OUTPUT": total.astype(np.int32), "ACC_OUT": total.astype(np.int32)}
        if "CORR" in self.outputs:
            out["CORR"] = inputs["CORRID"].astype(object if self.text else np.uint64)
        return out

    def initialize(self, args):
        self.outputs = {o["name"] for o in args["config"]["output"]}
        self.text = any(o["name"] == "CORR" and o["data_type"] == "TYPE_STRING" for o in args["config"]["output"])
'''


def accumulate(repo: Path, name: str, strategy: str, corrid: str = "TYPE_UINT64", idle_us: int = 60_000_000) -> None:
    """A stateful python model (sequence_batching, implicit state, START/READY/CORRID controls)."""
    corr_out = "CORRID" if corrid else ""
    python_model(repo, name, ACCUMULATE_MODEL, f"""
backend: python
max_batch_size: 2
input: [{{name: INPUT, data_type: TYPE_INT32, dims: [1]}}]
output:
  - {{name: OUTPUT, data_type: TYPE_INT32, dims: [1]}}
  - {{name: CORR, data_type: {corrid}, dims: [1]}}
sequence_batching:
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  control_input:
    - {{name: START, control: [{{kind: CONTROL_SEQUENCE_START, int32_false_true: [0, 1]}}]}}
    - {{name: READY, control: [{{kind: CONTROL_SEQUENCE_READY, int32_false_true: [0, 1]}}]}}
    - {{name: {corr_out}, control: [{{kind: CONTROL_SEQUENCE_CORRID, data_type: {corrid}}}]}}
  state: [{{input_name: ACC_IN, output_name: ACC_OUT, data_type: TYPE_INT32, dims: [1]}}]
instance_group: [{{count: 1, kind: KIND_CPU}}]
""")
