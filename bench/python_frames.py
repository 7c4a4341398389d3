"""What one EXEC and its DONE cost to encode and decode between the server and a model process.

    python -m bench.python_frames [--rounds 7] [--number 20000]

NVIDIA's add_sub request (two FP32 [4] inputs, inline) and its reply (two outputs), framed as the
server and the model process frame them: before, NamedTuple records pickled as they were (the class
looked up by name, and a Python call each, on both ends); now, plain tuples (server/backends/python/
protocol.py), with the records rebuilt where the model process reads them. Interleaved rounds, the
median per round trip (EXEC out and in, DONE out and in) in microseconds of one core.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import timeit

import numpy as np

from bench import common
from server.backends.python import protocol as p
from server.ipc import tensors as ipc_tensors


def frames():
    a = np.arange(4, dtype=np.float32)
    tin = [ipc_tensors.put(n, a, None, None) for n in ("INPUT0", "INPUT1")]
    tout = [ipc_tensors.put(n, a, None, None) for n in ("OUTPUT0", "OUTPUT1")]
    request = p.Request("1", tin, ("OUTPUT0", "OUTPUT1"), {}, 0, 0)
    reply = p.Reply(tout, None, None)

    def before() -> str:
        exec_ = pickle.loads(pickle.dumps((p.EXEC, 7, [request], []), protocol=5))
        name = exec_[2][0].inputs[0].name
        done = pickle.loads(pickle.dumps((p.DONE, 7, [reply], []), protocol=5))
        return name + done[2][0].outputs[0].name

    def after() -> str:
        sent = ("1", [tuple(t) for t in tin], ("OUTPUT0", "OUTPUT1"), {}, 0, 0)  # as backend._request makes it
        exec_ = pickle.loads(pickle.dumps((p.EXEC, 7, [sent], []), protocol=5))
        name = p.record(p.Request, exec_[2][0]).inputs[0][0]  # as child._request reads it
        back = p.Reply([tuple(t) for t in tout], None, None)
        done = pickle.loads(pickle.dumps((p.DONE, 7, [tuple(back)], []), protocol=5))
        outputs, error, parameters = done[2][0]
        return name + outputs[0][0]

    return before, after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    before, after = frames()
    runs = {"NamedTuple records (before)": [], "plain tuples (now)": []}
    for _ in range(args.rounds):
        for name, fn in zip(runs, (before, after)):
            runs[name].append(timeit.timeit(fn, number=args.number) / args.number * 1e6)
    rows = [{"frames": name, "us per EXEC + DONE (median)": round(statistics.median(v), 1),
             "rounds": " ".join(f"{x:.1f}" for x in v)} for name, v in runs.items()]
    ratio = statistics.median(a / b for a, b in zip(*runs.values()))
    text = common.table(rows, ["frames", "us per EXEC + DONE (median)", "rounds"]) + \
        f"\n\nbefore / now, round by round (median): {ratio:.2f}x"
    print(text)
    if not args.no_record:
        common.append_results("Python-model frames (bench/python_frames.py)", text)


if __name__ == "__main__":
    main()
