"""Request rescheduling (iterative sequences): a Python model that works step by step, Ferry vs Triton.

    python -m bench.rescheduling [--concurrency 16,64] [--duration 8] [--triton] [--no-record]

The model is a toy decoder: each request asks for 4-64 steps (mixed, the same cycle of requests for
every system); a step of a batch is one [B, 512] x [512, 512] matmul plus a tanh for its B requests, so
a step costs little more for 8 requests than for one, as a real decoder's does. Three ways to serve it,
one closed-loop load generator (clients/loadgen.py, KServe v2 gRPC):

- iterative: `sequence_batching { iterative_sequence: true }`, max_batch_size 8: each execute runs one
  step for every request in it and reschedules the unfinished ones; a request's next step joins
  whatever waits (continuous batching in Python).
- static: dynamic batching, max_batch_size 8: one execute runs all the steps of the requests it got,
  as many as the longest of them needs; short requests wait for long ones.
- with --triton, Triton 2.51's own Python backend (the tritonserver nvidia-pytriton bundles, from
  bench/peers.py's venv) serving the same iterative model.

Printed per system and concurrency: requests/s, steps/s, p50/p99 latency, and requests per execute
(ModelStatistics' inference_count / execution_count over the measured run). Appended to
bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import grpc
import numpy as np

from bench import common
from bench.python_backend import serve, start_triton, stop
from clients import loadgen

STEPS = [4, 64, 8, 32, 16, 4, 48, 12, 24, 6]  # the cycle of requests' step counts (mean 21.8)

MODEL = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

WIDTH = 1024


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.iterative = bool(config.get("sequence_batching", {}).get("iterative_sequence"))
        self.weights = np.random.default_rng(0).standard_normal((WIDTH, WIDTH), dtype=np.float32) / WIDTH ** 0.5
        self.live = {}  # correlation id -> (state row, steps left)

    def step(self, states):
        return np.tanh(states @ self.weights)

    def execute(self, requests):
        return self.iterate(requests) if self.iterative else self.all_steps(requests)

    def iterate(self, requests):
        # Triton's sequence batcher fills a batch's idle slots with null requests (correlation id 0): skipped
        real = [request for request in requests if request.correlation_id()]
        rows = []
        for request in real:
            cid = request.correlation_id()
            if cid not in self.live:
                wanted = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy().flat[0])
                self.live[cid] = (np.full(WIDTH, 0.01, np.float32), wanted)
            rows.append(self.live[cid][0])
        states = dict(zip(map(id, real), self.step(np.stack(rows)))) if real else {}
        responses = []
        for request in requests:
            cid, state = request.correlation_id(), states.get(id(request))
            if state is None:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros((1, 8), np.float32))]))
                continue
            left = self.live[cid][1] - 1
            if left > 0:
                self.live[cid] = (state, left)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
            else:
                del self.live[cid]
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", state[None, :8].copy())]))
        return responses

    def all_steps(self, requests):
        wanted = [int(pb_utils.get_input_tensor_by_name(r, "STEPS").as_numpy().flat[0]) for r in requests]
        states, outputs = np.full((len(requests), WIDTH), 0.01, np.float32), [None] * len(requests)
        for step in range(1, max(wanted) + 1):
            states = self.step(states)
            for i, n in enumerate(wanted):
                if n == step:
                    outputs[i] = states[i, :8].copy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out[None])]) for out in outputs]
'''
CONFIG = ('backend: "python"\nmax_batch_size: 8\n'
          'input [{ name: "STEPS", data_type: TYPE_INT32, dims: [ 1 ] }]\n'
          'output [{ name: "OUT", data_type: TYPE_FP32, dims: [ 8 ] }]\n'
          'instance_group [{ kind: KIND_CPU }]\n')
ITERATIVE = "sequence_batching { iterative_sequence: true }\n"
STATIC = "dynamic_batching { }\n"
ITERATIVE_FERRY, STATIC_FERRY = "ferry, iterative (rescheduling)", "ferry, static (all steps in one execute)"
ITERATIVE_TRITON = "triton 2.51 (pytriton), iterative"


def build(repo: Path, models: dict[str, str]) -> None:
    for name, extra in models.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL)
        (repo / name / "config.pbtxt").write_text(f'name: "{name}"\n{CONFIG}{extra}')


def measure(label: str, address: str, model: str, concurrency: int, duration_s: float) -> dict:
    payloads = [common.infer_payload(model, {"STEPS": np.array([[n]], np.int32)}) for n in STEPS]
    channel = grpc.insecure_channel(address)
    try:
        asyncio.run(loadgen.closed_loop(address, payloads, concurrency, requests=2 * concurrency, timeout_s=120))
        before = common.model_counts(channel, model)
        result = asyncio.run(loadgen.closed_loop(address, payloads, concurrency, duration_s=duration_s, timeout_s=120))
        after = common.model_counts(channel, model)
    finally:
        channel.close()
    s = result.summary()
    runs, executes = after[0] - before[0], after[1] - before[1]
    row = {"system": label, "concurrency": concurrency, "req/s": round(s["throughput_rps"], 1),
           "steps/s": round(s["throughput_rps"] * sum(STEPS) / len(STEPS)), "p50 ms": round(s["p50_ms"], 1),
           "p99 ms": round(s["p99_ms"], 1), "requests per execute": round(runs / max(executes, 1), 2),
           "errors": s["errors"]}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--triton", action="store_true", help="also Triton's own Python backend (bench/peers.py's "
                        "PyTriton venv, made once)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rows, load_before = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp) / "ferry", {"iterative": ITERATIVE, "static": STATIC})
        proc, address = serve(common.ROOT, Path(tmp) / "ferry")
        try:
            for c in concurrencies:
                rows.append(measure(ITERATIVE_FERRY, address, "iterative", c, args.duration))
                rows.append(measure(STATIC_FERRY, address, "static", c, args.duration))
        finally:
            stop(proc)
        if args.triton:
            build(Path(tmp) / "triton", {"iterative": ITERATIVE})
            proc, address = start_triton(Path(tmp) / "triton")
            try:
                for c in concurrencies:
                    rows.append(measure(ITERATIVE_TRITON, address, "iterative", c, args.duration))
            finally:
                stop(proc)
    ratios, by = [], {(row["system"], row["concurrency"]): row for row in rows}
    for c in concurrencies:
        ferry = by.get((ITERATIVE_FERRY, c))
        for other, name in ((STATIC_FERRY, "static batching"), (ITERATIVE_TRITON, "Triton's iterative")):
            if ferry and (other, c) in by:
                peer = by[(other, c)]
                ratios.append(f"- concurrency {c}: Ferry iterative / {name}: {ferry['req/s'] / peer['req/s']:.2f}x "
                              f"requests/s, p99 {ferry['p99 ms'] / peer['p99 ms']:.2f}x")
    body = (f"A toy decoder in Python, requests of {min(STEPS)}-{max(STEPS)} steps (mean "
            f"{sum(STEPS) / len(STEPS):.1f}), max_batch_size 8, one instance, closed loop:\n\n"
            + common.table(rows, ["system", "concurrency", "req/s", "steps/s", "p50 ms", "p99 ms",
                                  "requests per execute", "errors"])
            + "\n\n" + "\n".join(ratios)
            + ("" if args.triton else "\n\nTriton's Python backend: not measured in this run (--triton).")
            + common.load_note(load_before))
    print(body)
    if not args.no_record:
        common.append_results("Request rescheduling, iterative sequences (bench/rescheduling.py)", body)


if __name__ == "__main__":
    main()
