"""Python models in processes of their own: what the boundary costs, and what it buys.

    python -m bench.python_backend [--concurrency 1,16,64] [--duration 5] [--before DIR] [--triton] [--no-record]

Two measurements, one run, one closed-loop load generator (clients/loadgen.py, KServe v2 gRPC):

1. add_sub (NVIDIA's example's shape: FP32 [4] in, sum and difference out, no batching, one instance)
   at each concurrency: requests/s and p99. Rows: Triton's face (`class TritonPythonModel`) and Ferry's
   (`class Model`) in model processes, and, with --before, Ferry's in-process backend as it was (the
   given checkout, e.g. main before this change, serving the `class Model` version): the process
   boundary's cost; with --triton, Triton 2.51's own Python backend (the tritonserver nvidia-pytriton
   bundles, from bench/peers.py's venv) serving the same `TritonPythonModel`.
   The floor (bench/floor_server.py, a bare grpc.aio handler answering a fixed output) at the same
   concurrencies: the most any Python gRPC server answers on this machine, Ferry included.
2. A light model (8 callers: Ferry's ONNX `simple`, and the Python add_sub on every server) alone, then
   while a Python model that spins ~200 ms in pure Python per call is kept busy by 2 callers of its
   own: the share of its requests/s it keeps and its p99. Ferry's default (FERRY_PROCESS_NICE `auto`)
   lowers the spinner's priority once it has kept a core busy for a second; a second row pins it at
   the server's priority (FERRY_PROCESS_NICE 0), as every model process ran before.
   Before the model processes, the spinner held the GIL the light model's server needed.

Appended to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
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
# The same Triton model with requests batched into one execute (each request still answered alone).
BATCHED_CONFIG = ADD_CONFIG.replace("max_batch_size: 0", "max_batch_size: 64") + "dynamic_batching: {}\n"
FLOOR = "floor (bare grpc.aio handler)"
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
SPIN_TRITON = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        end = time.perf_counter() + 0.2
        n = 0
        while time.perf_counter() < end:
            n += 1
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
'''
PBTXT = {
    "add_triton": ('input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] }, '
                   '{ name: "INPUT1", data_type: TYPE_FP32, dims: [ 4 ] }]\n'
                   'output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }, '
                   '{ name: "OUTPUT1", data_type: TYPE_FP32, dims: [ 4 ] }]\n'),
    "spin": 'input [{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }]\noutput [{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }]\n',
}
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
        write(repo, "add_batched", ADD_TRITON, BATCHED_CONFIG)
    write(repo, "spin", SPIN, SPIN_CONFIG)
    if faces:
        write(repo, "spin_pinned", SPIN, SPIN_CONFIG + "parameters: {FERRY_PROCESS_NICE: {string_value: '0'}}\n")
    builders.add_sub(repo / "simple" / "1" / "model.onnx")


def build_triton(repo: Path) -> None:
    """The same two Python models for Triton's own Python backend (config.pbtxt, instance on the CPU)."""
    for name, source, batching in (("add_triton", ADD_TRITON, 0), ("add_batched", ADD_TRITON, 64),
                                   ("spin", SPIN_TRITON, 0)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        extra = "dynamic_batching { }\n" if batching else ""
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: {batching}\n{PBTXT[name.replace("batched", "triton")]}'
            f'instance_group [{{ kind: KIND_CPU }}]\n{extra}')


def start_triton(repo: Path):
    """tritonserver 2.51 as nvidia-pytriton bundles it (bench/peers.py's venv), serving `repo` with its
    Python backend. Its stub runs the first `python3` on PATH (the venv's, with NumPy 1.26: with NumPy 2
    this stub answers empty outputs) and needs that interpreter's libpython first on the library path."""
    from bench import peers

    python = peers.pytriton_python()
    tritonserver = python.parents[1] / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "pytriton" / "tritonserver"
    stub = tritonserver / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():  # PyTriton copies the stub for its Python version there when it starts a server
        shutil.copy(tritonserver / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" /
                    stub.name, stub)
    port = peers.free_port()
    env = peers.triton_environment(python)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen([str(tritonserver / "bin" / "tritonserver"), "--model-repository", str(repo),
                             "--backend-directory", str(tritonserver / "backends"), "--grpc-port", str(port),
                             "--http-port", str(peers.free_port()), "--metrics-port", str(peers.free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    peers.wait_for_lines(proc, [r"Started GRPCInferenceService"], 300)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, f"127.0.0.1:{port}"


def run(address: str, model: str, feed: dict, concurrency: int, duration_s: float) -> dict:
    payloads = [common.infer_payload(model, feed)]
    result = asyncio.run(loadgen.closed_loop(address, payloads, concurrency, duration_s=duration_s,
                                             warmup=min(2 * concurrency, 64), timeout_s=30))
    s = result.summary()
    return {"rps": round(s["throughput_rps"]), "p99_ms": round(s["p99_ms"], 2), "errors": s["errors"]}


def add_rows(label: str, address: str, models: list[str], concurrencies: list[int], duration_s: float) -> list[dict]:
    rows = []
    for model in models:
        one = np.arange(4, dtype=np.float32).reshape((1, 4) if model == "add_batched" else 4)
        for c in concurrencies:
            r = run(address, model, {"INPUT0": one, "INPUT1": one}, c, duration_s)
            rows.append({"server": label, "model": model, "concurrency": c, "req/s": r["rps"], "p99 ms": r["p99_ms"],
                         "errors": r["errors"]})
            print(rows[-1], flush=True)
    return rows


def spin_row(label: str, address: str, light_model: str, duration_s: float, spinner_model: str = "spin") -> dict:
    one = np.ones((1, 4) if light_model == "simple" else 4, np.float32)
    light = {"INPUT0": one, "INPUT1": one}
    alone = run(address, light_model, light, 8, duration_s)
    stop = threading.Event()

    def spinning() -> None:
        payloads = [common.infer_payload(spinner_model, {"X": np.ones(1, np.float32)})]
        while not stop.is_set():
            asyncio.run(loadgen.closed_loop(address, payloads, 2, duration_s=2, warmup=0, timeout_s=30))

    spinner = threading.Thread(target=spinning, daemon=True)
    spinner.start()
    time.sleep(3)  # the spinner's callers are in flight (and it has been judged) before the light model is measured
    beside = run(address, light_model, light, 8, duration_s)
    stop.set()
    spinner.join(60)
    row = {"server": label, "light model": light_model, "alone req/s": alone["rps"], "alone p99 ms": alone["p99_ms"],
           "beside req/s": beside["rps"], "beside p99 ms": beside["p99_ms"],
           "kept": round(beside["rps"] / max(alone["rps"], 1), 2),
           "p99 x": round(beside["p99_ms"] / max(alone["p99_ms"], 1e-9), 2)}
    print(row, flush=True)
    return row


def floor_note(add: list[dict]) -> str:
    """Each system's add_sub requests/s as a share of the floor's at the same concurrency: a Python front door
    cannot pass 1.0, so against Triton's C++ one the floor says what is reachable on this machine at all."""
    floor = {r["concurrency"]: r["req/s"] for r in add if r["server"] == FLOOR}
    lines = [f"- {r['server']}, {r['model']} at {r['concurrency']}: {r['req/s'] / floor[r['concurrency']]:.2f} of the "
             "floor's requests/s" for r in add if r["server"] != FLOOR and r["concurrency"] in floor and floor[r["concurrency"]]]
    return "\n\n" + "\n".join(lines) if lines else ""


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
    parser.add_argument("--triton", action="store_true", help="also Triton's own Python backend (bench/peers.py's "
                        "PyTriton venv, made once)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    add, spin = [], []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        systems = [("ferry, model processes", common.ROOT, True)]
        if args.before is not None:
            systems.append(("ferry before, in-process", args.before.resolve(), False))
        for label, checkout, faces in systems:
            repo = Path(tmp) / label.replace(" ", "_").replace(",", "")
            build(repo, faces)
            proc, address = serve(checkout, repo)
            try:
                add += add_rows(label, address, ["add_triton", "add_batched", "add_ferry"] if faces else ["add_ferry"],
                                concurrencies,
                                args.duration)
                for light in ("simple", "add_triton" if faces else "add_ferry"):
                    spin.append(spin_row(label, address, light, max(args.duration, 5.0)))
                    if faces:
                        spin.append(spin_row(f"{label}, spinner pinned (FERRY_PROCESS_NICE 0)", address, light,
                                             max(args.duration, 5.0), "spin_pinned"))
            finally:
                stop(proc)
        proc, address = common.start_server([sys.executable, "-m", "bench.floor_server", "0"])
        try:  # the bare grpc.aio handler: what any Python gRPC server can answer here, model or not
            add += add_rows(FLOOR, address, ["add_triton"], concurrencies, args.duration)
        finally:
            stop(proc)
        if args.triton:
            build_triton(Path(tmp) / "triton")
            proc, address = start_triton(Path(tmp) / "triton")
            try:
                add += add_rows("triton 2.51 (pytriton)", address, ["add_triton", "add_batched"], concurrencies,
                                args.duration)
                spin.append(spin_row("triton 2.51 (pytriton)", address, "add_triton", max(args.duration, 5.0)))
            finally:
                stop(proc)
    body = ("add_sub (FP32 [4], one instance; add_batched: max_batch_size 64 with dynamic batching, requests still "
            "answered one by one), closed loop; the floor is bench/floor_server.py, a bare grpc.aio handler that "
            "answers the same requests with a fixed output (no model, no scheduling):\n\n"
            + common.table(add, ["server", "model", "concurrency", "req/s", "p99 ms", "errors"])
            + floor_note(add)
            + "\n\nA light ONNX model (8 callers) alone and beside a Python model spinning ~200 ms per call (2 callers):\n\n"
            + common.table(spin, ["server", "light model", "alone req/s", "alone p99 ms", "beside req/s", "beside p99 ms", "kept", "p99 x"])
            + ("" if args.triton else "\n\nTriton's Python backend: not measured in this run (--triton).")
            + common.load_note(load_before, "Systems ran one after another, not interleaved: on a shared machine "
                                            "compare within a row (alone / beside) more than across systems."))
    print(body)
    if not args.no_record:
        common.append_results("Python models in processes of their own (bench/python_backend.py)", body)


if __name__ == "__main__":
    main()
