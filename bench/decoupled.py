"""Decoupled Python models that answer from threads of their own: streams per second, Ferry vs Triton.

    python -m bench.decoupled [--concurrency 1,16,64] [--duration 6] [--before DIR] [--triton] [--no-record]

The model is NVIDIA's `repeat` example's pattern: `execute` starts a thread per request and returns;
the thread sends 4 responses 5 ms apart, then the final flag. One instance. Each of C closed-loop
clients keeps one ModelStreamInfer stream and sends its next request once the previous one's final
response is in. Rows: this checkout (the instance takes its next request once execute returns, as in
Triton); with --before, a checkout from before that change (the instance held until the final
response: one stream at a time), e.g. `git archive 030b5b5 | tar -x -C /tmp/before`; with --triton,
Triton 2.51's Python backend (the tritonserver nvidia-pytriton bundles, bench/peers.py's venv).

Printed: completed streams/s and p50/p99 of a stream's duration (send to final response); the ideal
at concurrency C is C / 20 ms. Appended to bench/RESULTS.md unless --no-record.
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

MODEL = '''
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
CONFIG = ('name: "repeat"\nbackend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
          'input [{ name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] }]\n'
          'output [{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }]\n'
          'instance_group [{ count: 1, kind: KIND_CPU }]\n')


def build(repo: Path) -> None:
    (repo / "repeat" / "1").mkdir(parents=True)
    (repo / "repeat" / "1" / "model.py").write_text(MODEL)
    (repo / "repeat" / "config.pbtxt").write_text(CONFIG)


def request() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="repeat")
    r.parameters["triton_enable_empty_final_response"].bool_param = True  # the final flag comes as a response
    r.inputs.add(name="COUNT", datatype="INT32", shape=[1])
    r.raw_input_contents.append(np.array([RESPONSES], np.int32).tobytes())
    return r


async def client(stub, until: float, durations: list[float], errors: list[str]) -> None:
    """One stream, one request at a time: the next is sent once the previous one's final response is in."""
    call = stub.ModelStreamInfer()
    try:
        while time.monotonic() < until:
            started = time.monotonic()
            await call.write(request())
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


async def measure_async(address: str, concurrency: int, duration_s: float) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await asyncio.gather(*(client(stub, time.monotonic() + 1.0, [], []) for _ in range(concurrency)))  # warm up
        durations, errors = [], []
        start = time.monotonic()
        await asyncio.gather(*(client(stub, start + duration_s, durations, errors) for _ in range(concurrency)))
        wall = time.monotonic() - start
    ms = np.array(durations) * 1000 if durations else np.zeros(1)
    return {"streams/s": round(len(durations) / wall, 1), "p50 ms": round(float(np.percentile(ms, 50)), 1),
            "p99 ms": round(float(np.percentile(ms, 99)), 1), "errors": len(errors)}


def rows_for(label: str, address: str, concurrencies: list[int], duration_s: float) -> list[dict]:
    rows = []
    for c in concurrencies:
        row = {"server": label, "concurrency": c, **asyncio.run(measure_async(address, c, duration_s)),
               "ideal streams/s": round(c / (RESPONSES * DELAY_S), 1)}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--before", type=Path, help="a checkout of Ferry from before the change")
    parser.add_argument("--triton", action="store_true", help="also Triton's own Python backend (bench/peers.py's "
                        "PyTriton venv, made once)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    rows, load_before = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        systems = [("ferry", common.ROOT)] + ([("ferry before (instance held until the final response)",
                                                args.before.resolve())] if args.before else [])
        for i, (label, checkout) in enumerate(systems):
            repo = Path(tmp) / f"ferry{i}"
            build(repo)
            proc, address = serve(checkout, repo)
            try:
                rows += rows_for(label, address, concurrencies, args.duration)
            finally:
                stop(proc)
        if args.triton:
            build(Path(tmp) / "triton")
            proc, address = start_triton(Path(tmp) / "triton")
            try:
                rows += rows_for("triton 2.51 (pytriton)", address, concurrencies, args.duration)
            finally:
                stop(proc)
    by = {(row["server"], row["concurrency"]): row for row in rows}
    ratios = [f"- concurrency {c}: Ferry / {peer}: {by[('ferry', c)]['streams/s'] / max(by[(peer, c)]['streams/s'], 0.1):.2f}x "
              f"streams/s" for c in concurrencies for peer in {row["server"] for row in rows} - {"ferry"}
              if (peer, c) in by]
    body = (f"A decoupled Python model answering from a thread per request ({RESPONSES} responses {DELAY_S * 1000:.0f} ms "
            "apart, then the final flag), one instance, closed-loop ModelStreamInfer clients:\n\n"
            + common.table(rows, ["server", "concurrency", "streams/s", "ideal streams/s", "p50 ms", "p99 ms", "errors"])
            + "\n\n" + "\n".join(sorted(ratios))
            + f"\n\nMachine load average (1 min) at the start and end of the run: {load_before:.1f}, "
              f"{os.getloadavg()[0]:.1f}. Systems ran one after another.\n")
    print(body)
    if not args.no_record:
        common.append_results("Decoupled Python models answering from threads (bench/decoupled.py)", body)


if __name__ == "__main__":
    main()
