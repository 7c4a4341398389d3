"""Decoupled Python models: streams per second, Ferry vs Triton.

    python -m bench.decoupled [--models repeat,batched,unbatched] [--concurrency 1,16,64] [--duration 6]
                              [--before DIR] [--triton] [--no-record]

Models, one instance each:
- repeat: NVIDIA's `repeat` example's pattern: `execute` starts a thread per request and returns; the
  thread sends 4 responses 5 ms apart, then the final flag. The ideal at concurrency C is C / 20 ms.
- batched: a decoupled model whose execute costs 5 ms whatever it is given (one forward pass for the
  batch, the GIL released as ONNX Runtime or a GPU call releases it), then answers each request with
  one final response; max_batch_size 64 with dynamic_batching, so an execute gets every request waiting.
- unbatched: the same model without dynamic_batching: one request per execute (at most 200/s).

Each of C closed-loop clients keeps one ModelStreamInfer stream and sends its next request once the
previous one's final response is in. Rows: this checkout; with --before, another checkout (e.g.
`git archive 030b5b5 | tar -x -C /tmp/before`); with --triton, Triton 2.51's Python backend (the
tritonserver nvidia-pytriton bundles, bench/peers.py's venv).

Printed: completed streams/s and p50/p99 of a stream's duration (send to final response). Appended to
bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench import common
from bench.python_backend import serve, start_triton, stop
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

RESPONSES, DELAY_S = 4, 0.005

REPEAT = '''
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            threading.Thread(target=self.answer, args=(request.get_response_sender(), count), daemon=True).start()
        return None

    def answer(self, sender, count):
        for i in range(count):
            time.sleep(%r)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
''' % DELAY_S
BATCHED = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(%r)  # one forward pass for the whole batch
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()
            request.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", count)]),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
''' % DELAY_S
TENSORS = ('input [{ name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] }]\n'
           'output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }]\n'
           'instance_group [{ count: 1, kind: KIND_CPU }]\nmodel_transaction_policy { decoupled: true }\n')
MODELS = {  # name: (model.py, max_batch_size, dynamic batching, the ideal streams/s at concurrency c)
    "repeat": (REPEAT, 0, False, lambda c: c / (RESPONSES * DELAY_S)),
    "batched": (BATCHED, 64, True, lambda c: min(c, 64) / DELAY_S),
    "unbatched": (BATCHED, 64, False, lambda c: 1 / DELAY_S),
}


def build(repo: Path, models: list[str]) -> None:
    for name in models:
        source, max_batch, dynamic, _ = MODELS[name]
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        (repo / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
                                                  + TENSORS + ("dynamic_batching { }\n" if dynamic else ""))


def request(model: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model)
    r.parameters["triton_enable_empty_final_response"].bool_param = True  # the final flag comes as a response
    r.inputs.add(name="COUNT", datatype="INT32", shape=[1, 1] if MODELS[model][1] else [1])
    r.raw_input_contents.append(np.array([RESPONSES], np.int32).tobytes())
    return r


async def client(stub, model: str, until: float, durations: list[float], errors: list[str]) -> None:
    """One stream, one request at a time: the next is sent once the previous one's final response is in."""
    call = stub.ModelStreamInfer()
    try:
        while time.monotonic() < until:
            started = time.monotonic()
            await call.write(request(model))
            while True:
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    errors.append("the stream ended")
                    return
                if answer.error_message:
                    errors.append(answer.error_message)
                    break
                if answer.infer_response.parameters["triton_final_response"].bool_param:
                    durations.append(time.monotonic() - started)
                    break
    finally:
        call.cancel()


async def measure_async(address: str, model: str, concurrency: int, duration_s: float) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await asyncio.gather(*(client(stub, model, time.monotonic() + 1.0, [], []) for _ in range(concurrency)))  # warm up
        durations, errors = [], []
        start = time.monotonic()
        await asyncio.gather(*(client(stub, model, start + duration_s, durations, errors) for _ in range(concurrency)))
        wall = time.monotonic() - start
    ms = np.array(durations) * 1000 if durations else np.zeros(1)
    return {"streams/s": round(len(durations) / wall, 1), "p50 ms": round(float(np.percentile(ms, 50)), 1),
            "p99 ms": round(float(np.percentile(ms, 99)), 1), "errors": len(errors)}


def rows_for(label: str, address: str, models: list[str], concurrencies: list[int], duration_s: float) -> list[dict]:
    rows = []
    for model in models:
        for c in concurrencies:
            row = {"server": label, "model": model, "concurrency": c,
                   **asyncio.run(measure_async(address, model, c, duration_s)),
                   "ideal streams/s": round(MODELS[model][3](c), 1)}
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--before", type=Path, help="a checkout of Ferry from before the change")
    parser.add_argument("--triton", action="store_true", help="also Triton's own Python backend (bench/peers.py's "
                        "PyTriton venv, made once)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    models = args.models.split(",")
    rows, load_before = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        systems = [("ferry", common.ROOT)] + ([("ferry before", args.before.resolve())] if args.before else [])
        for i, (label, checkout) in enumerate(systems):
            repo = Path(tmp) / f"ferry{i}"
            build(repo, models)
            proc, address = serve(checkout, repo)
            try:
                rows += rows_for(label, address, models, concurrencies, args.duration)
            finally:
                stop(proc)
        if args.triton:
            build(Path(tmp) / "triton", models)
            proc, address = start_triton(Path(tmp) / "triton")
            try:
                rows += rows_for("triton 2.51 (pytriton)", address, models, concurrencies, args.duration)
            finally:
                stop(proc)
    by = {(row["server"], row["model"], row["concurrency"]): row for row in rows}
    peers = sorted({row["server"] for row in rows} - {"ferry"})
    ratios = [f"- {model} at concurrency {c}: Ferry / {peer}: "
              f"{by[('ferry', model, c)]['streams/s'] / max(by[(peer, model, c)]['streams/s'], 0.1):.2f}x streams/s"
              for model in models for c in concurrencies for peer in peers if (peer, model, c) in by]
    if "batched" in models and "unbatched" in models:
        ratios += [f"- batched / unbatched at concurrency {c}: "
                   f"{by[('ferry', 'batched', c)]['streams/s'] / max(by[('ferry', 'unbatched', c)]['streams/s'], 0.1):.2f}x "
                   "streams/s (Ferry)" for c in concurrencies]
    body = ("Decoupled Python models, one instance, closed-loop ModelStreamInfer clients: repeat (a thread per request "
            f"sends {RESPONSES} responses {DELAY_S * 1000:.0f} ms apart, then the final flag); batched (an execute costs "
            f"{DELAY_S * 1000:.0f} ms whatever it gets, one final response per request; dynamic_batching, max_batch_size "
            "64); unbatched (the same, one request per execute):\n\n"
            + common.table(rows, ["server", "model", "concurrency", "streams/s", "ideal streams/s", "p50 ms", "p99 ms",
                                  "errors"])
            + "\n\n" + "\n".join(ratios)
            + common.load_note(load_before))
    print(body)
    if not args.no_record:
        common.append_results("Decoupled Python models (bench/decoupled.py)", body)


if __name__ == "__main__":
    main()
