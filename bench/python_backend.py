"""Python models in processes of their own: what the boundary costs, and what it buys.

    python -m bench.python_backend [--concurrency 1,16,64] [--duration 5] [--before /work/main] [--no-record]

Two measurements, one run, one closed-loop load generator (clients/loadgen.py, KServe v2 gRPC):

1. add_sub (NVIDIA's example's shape: FP32 [4] in, sum and difference out, no batching, one instance)
   at each concurrency: requests/s and p99. Rows: Triton's face (`class TritonPythonModel`) and Ferry's
   (`class Model`) in model processes, and, with --before, Ferry's in-process backend as it was (the
   given checkout, e.g. main before this change, serving the `class Model` version): the process
   boundary's cost. Triton's own Python backend is not in this run (its PyTriton venv, bench/peers.py,
   could not be built here in time); the column is left for a machine that has it.
2. A light ONNX model (8 callers) alone, then while a Python model that spins ~200 ms in pure Python
   per call is kept busy by 2 callers of its own: the share of its requests/s it keeps and its p99.
   Before the model processes, the spinner held the GIL the light model's server needed.

Appended to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench import common
from clients import loadgen
from tests import builders

ADD_TRITON = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                         pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''
ADD_FERRY = '''
class Model:
    def execute(self, inputs):
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
'''
ADD_CONFIG = """backend: python
max_batch_size: 0
input: [{name: INPUT0, data_type: TYPE_FP32, dims: [4]}, {name: INPUT1, data_type: TYPE_FP32, dims: [4]}]
output: [{name: OUTPUT0, data_type: TYPE_FP32, dims: [4]}, {name: OUTPUT1, data_type: TYPE_FP32, dims: [4]}]
"""
SPIN = '''
import time


class Model:
    def execute(self, inputs):
        end = time.perf_counter() + 0.2
        n = 0
        while time.perf_counter() < end:  # pure Python: holds the GIL of whatever process runs it
            n += 1
        return {"Y": inputs["X"]}
'''
SPIN_CONFIG = """backend: python
max_batch_size: 0
input: [{name: X, data_type: TYPE_FP32, dims: [1]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [1]}]
"""


def write(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.yaml").write_text(config)


def build(repo: Path, faces: bool) -> None:
    """`faces`: both add_sub faces (this checkout); else Ferry's only (a checkout from before)."""
    write(repo, "add_ferry", ADD_FERRY, ADD_CONFIG)
    if faces:
        write(repo, "add_triton", ADD_TRITON, ADD_CONFIG)
    write(repo, "spin", SPIN, SPIN_CONFIG)
    builders.add_sub(repo / "simple" / "1" / "model.onnx")


def run(address: str, model: str, feed: dict, concurrency: int, duration_s: float) -> dict:
    payloads = [common.infer_payload(model, feed)]
    result = asyncio.run(loadgen.closed_loop(address, payloads, concurrency, duration_s=duration_s,
                                             warmup=min(2 * concurrency, 64), timeout_s=30))
    s = result.summary()
    return {"rps": round(s["throughput_rps"]), "p99_ms": round(s["p99_ms"], 2), "errors": s["errors"]}


def add_rows(label: str, address: str, models: list[str], concurrencies: list[int], duration_s: float) -> list[dict]:
    one = np.arange(4, dtype=np.float32)
    rows = []
    for model in models:
        for c in concurrencies:
            r = run(address, model, {"INPUT0": one, "INPUT1": one}, c, duration_s)
            rows.append({"server": label, "model": model, "concurrency": c, "req/s": r["rps"], "p99 ms": r["p99_ms"],
                         "errors": r["errors"]})
            print(rows[-1], flush=True)
    return rows


def spin_row(label: str, address: str, duration_s: float) -> dict:
    one = np.ones((1, 4), np.float32)
    light = {"INPUT0": one, "INPUT1": one}
    alone = run(address, "simple", light, 8, duration_s)
    stop = threading.Event()

    def spinning() -> None:
        payloads = [common.infer_payload("spin", {"X": np.ones(1, np.float32)})]
        while not stop.is_set():
            asyncio.run(loadgen.closed_loop(address, payloads, 2, duration_s=2, warmup=0, timeout_s=30))

    spinner = threading.Thread(target=spinning, daemon=True)
    spinner.start()
    time.sleep(1)  # the spinner's callers are in flight before the light model is measured
    beside = run(address, "simple", light, 8, duration_s)
    stop.set()
    spinner.join(60)
    row = {"server": label, "alone req/s": alone["rps"], "alone p99 ms": alone["p99_ms"],
           "beside req/s": beside["rps"], "beside p99 ms": beside["p99_ms"],
           "kept": round(beside["rps"] / max(alone["rps"], 1), 2),
           "p99 x": round(beside["p99_ms"] / max(alone["p99_ms"], 1e-9), 2)}
    print(row, flush=True)
    return row


def serve(checkout: Path, repo: Path):
    """`ferry serve` from `checkout` (this one, or one from before the change)."""
    proc = subprocess.Popen(common.ferry_command(repo), cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = None
    for line in proc.stdout:
        found = re.search(r"ferry: serving gRPC on (\S+)", line)
        address = found.group(1) if found else address
        if line.startswith("ferry: ready"):
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, address


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except Exception:  # noqa: BLE001 - a stuck server must not keep the bench from reporting
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--before", type=Path, help="a checkout of Ferry from before the model processes, e.g. "
                        "`git archive 4fbd783 | tar -x -C /tmp/before`")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    add, spin = [], []
    with tempfile.TemporaryDirectory() as tmp:
        systems = [("ferry, model processes", common.ROOT, True)]
        if args.before is not None:
            systems.append(("ferry before, in-process", args.before.resolve(), False))
        for label, checkout, faces in systems:
            repo = Path(tmp) / label.replace(" ", "_").replace(",", "")
            build(repo, faces)
            proc, address = serve(checkout, repo)
            try:
                add += add_rows(label, address, ["add_triton", "add_ferry"] if faces else ["add_ferry"], concurrencies,
                                args.duration)
                spin.append(spin_row(label, address, max(args.duration, 5.0)))
            finally:
                stop(proc)
    body = ("add_sub (FP32 [4], no batching, one instance), closed loop:\n\n"
            + common.table(add, ["server", "model", "concurrency", "req/s", "p99 ms", "errors"])
            + "\n\nA light ONNX model (8 callers) alone and beside a Python model spinning ~200 ms per call (2 callers):\n\n"
            + common.table(spin, ["server", "alone req/s", "alone p99 ms", "beside req/s", "beside p99 ms", "kept", "p99 x"])
            + "\n\nTriton's Python backend: not measured in this run (see bench/python_backend.py).\n")
    print(body)
    if not args.no_record:
        common.append_results("Python models in processes of their own (bench/python_backend.py)", body)


if __name__ == "__main__":
    main()
