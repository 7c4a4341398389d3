"""Post-processing step of the `pipeline` ensemble: (SUM, DIFF) -> SUM * DIFF, row by row, batched."""
import numpy as np


class Model:
    def execute(self, inputs):
        return {"RESULT": (inputs["SUM"] * inputs["DIFF"]).astype(np.float32)}
