"""Pre-processing step of the `pipeline` ensemble: RAW -> (2 * RAW, RAW + 1).

Batched: `inputs["RAW"]` is [rows, 16] holding every request of the batch; return [rows, 16] outputs.
"""
import numpy as np


class Model:
    def execute(self, inputs):
        raw = inputs["RAW"]
        return {"DOUBLED": (raw * 2).astype(np.float32), "SHIFTED": (raw + 1).astype(np.float32)}
