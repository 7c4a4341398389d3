"""Stateful: OUTPUT = INPUT + the sequence's previous OUTPUT (0 at START).

Batched over sequences: row r of every array belongs to one sequence; START[r] says it begins now,
ACC_IN[r] is the state the server kept from that sequence's previous request.
"""
import numpy as np


class Model:
    def execute(self, inputs):
        total = np.where(inputs["START"].astype(bool), 0, inputs["ACC_IN"]) + inputs["INPUT"]
        return {"OUTPUT": total.astype(np.int32), "ACC_OUT": total.astype(np.int32)}
