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


def rows(repo: Path) -> None:
    """`rows`: a batched python model that reports how many rows its call received."""
    python_model(repo, "rows", ROWS_MODEL, ROWS_CONFIG)
