"""Decoupled: for each element i of IN, wait DELAY[i] ms and send one response (OUT = IN[i], IDX = i);
then wait WAIT ms and finish. `execute` is a generator: every dict it yields is sent at once, and
returning ends the request (0 yields is a valid answer)."""
import time

import numpy as np


class Model:
    def execute(self, inputs):
        values, delays = inputs["IN"], inputs["DELAY"]
        if delays.shape != values.shape:
            raise ValueError(f"DELAY has shape {list(delays.shape)}; it must match IN {list(values.shape)}")
        for i, value in enumerate(values):
            time.sleep(int(delays[i]) / 1000)
            yield {"OUT": np.array([value], np.int32), "IDX": np.array([i], np.uint32)}
        time.sleep(int(inputs["WAIT"][0]) / 1000)
