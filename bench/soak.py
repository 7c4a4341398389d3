"""Soak: hostile and excessive traffic against one server, and what it left behind.

A batching server is only as trustworthy as its worst neighbour. This script sends, to one real
server on 127.0.0.1 (every loop bounded in count and time):

1. fuzzed bodies: random bytes, mutated valid requests and structurally random ModelInferRequests;
   every answer's status is counted (INTERNAL and UNKNOWN mean a Ferry bug: the target is 0);
2. poisoned batches: good requests batched beside invalid UTF-8 (string model), zero-length
   requests and bad sampling parameters (generation); a good request failed by a neighbour is a bug;
3. overload: an open loop at 10x the measured capacity of a model with a bounded queue (refusals,
   admitted p99, peak memory);
4. cancelled streams: generation streams cancelled after their first token; the KV blocks in use
   must come back to 0.

It prints the figures and appends them to bench/RESULTS.md (unless --no-record).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from bench import common, models
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
GOOD_CODES = {grpc.StatusCode.OK}
BUG_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

LIGHT_CONFIG = """max_batch_size: 64
dynamic_batching: {max_queue_delay_microseconds: 2000, default_queue_policy: {max_queue_size: 256}}
"""
# Overload target: one instance, no batching, a queue of 64: its capacity (tens of requests/s) is
# what a client on the same two cores can exceed tenfold without becoming the bottleneck itself.
SLOW_QUEUE = 64
SLOW_CONFIG = f"""max_batch_size: 1
dynamic_batching: {{default_queue_policy: {{max_queue_size: {SLOW_QUEUE}}}}}
parameters: {{intra_op_thread_count: {{string_value: "1"}}}}
"""  # one core for the model, one for the server's loop and the client
STRINGS_CONFIG = """max_batch_size: 16
dynamic_batching: {max_queue_delay_microseconds: 5000}
input [{name: "IN", data_type: TYPE_STRING, dims: [-1]}]
output [{name: "OUT", data_type: TYPE_STRING, dims: [-1]}]
"""


# ------------------------------------------------------------------ the repository
def build_repository(root: Path) -> Path:
    models.light_mlp(root / "light" / "1" / "model.onnx")
    (root / "light" / "config.yaml").write_text(LIGHT_CONFIG)
    models.wide_mlp(root / "slow" / "1" / "model.onnx")
    (root / "slow" / "config.yaml").write_text(SLOW_CONFIG)
    models.string_identity(root / "strings" / "1" / "model.onnx")
    (root / "strings" / "config.pbtxt").write_text(STRINGS_CONFIG)
    models.random_llama(root / "llm" / "1", vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    (root / "llm" / "config.yaml").write_text(
        'backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 512, max_num_seqs: 32}\n')
    return root


# ------------------------------------------------------------------ the server's side
class Server:
    def __init__(self, repo: Path):
        lines: list[str] = []
        cmd = common.ferry_command(repo)
        cmd[cmd.index("--metrics-port") + 1] = "0"
        self.proc, self.address = common.start_server(cmd, lines=lines)
        self.metrics_url = re.search(r"serving metrics on (\S+)", "".join(lines)).group(1)

    def memory_mb(self, field: str = "VmRSS") -> float:
        """The server's resident memory now (VmRSS) or at its peak so far (VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metric(self, name: str, **labels: str) -> float:
        page = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total = 0.0
        for line in page.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def call(channel: grpc.aio.Channel, body: bytes, timeout_s: float = 30) -> tuple[grpc.StatusCode, bytes]:
    method = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
    try:
        return grpc.StatusCode.OK, await method(body, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), b""


async def bounded(jobs, concurrency: int):
    """Run coroutine factories with at most `concurrency` in flight; results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job):
        async with gate:
            return await job()

    return await asyncio.gather(*(one(j) for j in jobs))


# ------------------------------------------------------------------ 1. fuzzing
def infer_request(model: str, inputs: dict[str, np.ndarray], version: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    for name, array in inputs.items():
        if array.dtype == object:
            datatype = "BYTES"
            raw = b"".join(len(v).to_bytes(4, "little") + v for v in array.reshape(-1))
        else:
            datatype = {np.float32: "FP32", np.int64: "INT64"}[array.dtype.type]
            raw = array.tobytes()
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(raw)
    return request


def valid_bodies(rng: np.random.Generator) -> list[bytes]:
    light = infer_request("light", {"x": rng.standard_normal((1, 256)).astype(np.float32)})
    strings = infer_request("strings", {"IN": np.array([[b"ferry", b"boat"]], dtype=object)})
    return [light.SerializeToString(), strings.SerializeToString()]


def random_structured(r: random.Random) -> bytes:
    names = ["light", "strings", "llm", "nope", "", "x" * r.choice([1, 300, 100_000]), "../light", "²", "light\x00"]
    versions = ["", "1", "2", "0", "-1", "²", "①", "١", "99999999999999999999", "abc"]
    datatypes = ["FP32", "INT64", "BYTES", "FP16", "BOOL", "UINT8", "FOO", ""]
    request = pb.ModelInferRequest(model_name=r.choice(names), model_version=r.choice(versions), id=str(r.random()))
    for _ in range(r.choice([0, 1, 1, 2, 3])):
        shape = [r.choice([0, 1, 2, 16, 256, -1, 2**31, 2**62, 2**63 - 1]) for _ in range(r.choice([0, 1, 2, 3]))]
        tensor = request.inputs.add(name=r.choice(["x", "IN", "text_input", "y", ""]), datatype=r.choice(datatypes),
                                    shape=shape)
        if r.random() < 0.2:
            tensor.contents.fp32_contents.extend([r.random() for _ in range(r.choice([0, 1, 256]))])
            if r.random() < 0.3:
                tensor.contents.bytes_contents.append(b"\xff\xfe")
        else:
            size = r.choice([0, 1, 4, 1024, 4096, r.randrange(0, 5000)])
            request.raw_input_contents.append(r.randbytes(size))
    for key in r.sample(["priority", "timeout", "cost", "binary_data", "triton_x", "sequence_id"], r.choice([0, 1, 2])):
        value = request.parameters[key]
        kind = r.choice(["int64_param", "string_param", "bool_param", "double_param", "uint64_param"])
        setattr(value, kind, {"int64_param": r.choice([-1, 0, 1, 2**62]), "string_param": "hot", "bool_param": True,
                              "double_param": r.choice([float("nan"), float("inf"), -1.0, 3.5]),
                              "uint64_param": 2**64 - 1}[kind])
    for _ in range(r.choice([0, 0, 1])):
        request.outputs.add(name=r.choice(["y", "OUT", "nope", "x" * 1000]))
    return request.SerializeToString()


def mutate(r: random.Random, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(r.choice([1, 2, 8])):
        how = r.random()
        if how < 0.4 and data:
            data[r.randrange(len(data))] = r.randrange(256)
        elif how < 0.7:
            data = data[: r.randrange(len(data) + 1)]
        else:
            at = r.randrange(len(data) + 1)
            data[at:at] = r.randbytes(r.choice([1, 5, 40]))
    return bytes(data)


def fuzz_bodies(count: int, seed: int) -> list[bytes]:
    r, rng = random.Random(seed), np.random.default_rng(seed)
    valid = valid_bodies(rng)
    bodies = []
    for _ in range(count):
        kind = r.random()
        if kind < 0.3:
            bodies.append(r.randbytes(r.choice([0, 1, 7, 64, 512, r.randrange(2048)])))
        elif kind < 0.6:
            bodies.append(mutate(r, r.choice(valid)))
        else:
            bodies.append(random_structured(r))
    return bodies


async def fuzz(server: Server, count: int, seed: int) -> dict:
    bodies = fuzz_bodies(count, seed)
    async with grpc.aio.insecure_channel(server.address) as channel:
        codes = await bounded([lambda b=b: call(channel, b) for b in bodies], 64)
        alive = (await call(channel, valid_bodies(np.random.default_rng(0))[0]))[0]
    statuses = collections.Counter(code.name for code, _ in codes)
    bugs = sum(statuses.get(c.name, 0) for c in BUG_CODES)
    return {"fuzzed": count, "statuses": dict(statuses.most_common()), "bugs": bugs, "alive_after": alive.name}


# ------------------------------------------------------------------ 2. poisoned batches
async def poisoned_batches(server: Server, rounds: int) -> dict:
    """Good requests beside bad ones in the same batches; every good one must succeed."""
    good = infer_request("strings", {"IN": np.array([[b"good", b"row"]], dtype=object)}).SerializeToString()
    bad_utf8 = infer_request("strings", {"IN": np.array([[b"\xff\xfe", b"row"]], dtype=object)}).SerializeToString()
    empty = infer_request("strings", {"IN": np.empty((1, 0), dtype=object)}).SerializeToString()
    good_failed = bad_statuses = 0
    statuses: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(server.address) as channel:
        for i in range(rounds):
            bodies = [good] * 60 + [bad_utf8] + [empty]
            random.Random(i).shuffle(bodies)
            codes = await bounded([lambda b=b: call(channel, b) for b in bodies], 62)
            for body, (code, _) in zip(bodies, codes):
                if body is bad_utf8:
                    statuses[code.name] += 1
                    bad_statuses += code in BUG_CODES
                elif code != grpc.StatusCode.OK:
                    good_failed += 1
        generation = await poisoned_generation(channel)
    return {"infer_good_failed": good_failed, "infer_bad_statuses": dict(statuses), "infer_bad_as_bug": bad_statuses,
            **generation}


async def poisoned_generation(channel) -> dict:
    stub = gen_grpc.GenerationStub(channel)
    prompt = gen.TokenIds(ids=[5, 6, 7, 8])

    async def run(sampling: gen.SamplingParams) -> str:
        try:
            async for _ in stub.Generate(gen.GenerateRequest(model_name="llm", token_ids=prompt, sampling=sampling),
                                         timeout=120):
                pass
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    goods = [run(gen.SamplingParams(max_tokens=32, temperature=1.0, seed=i)) for i in range(8)]
    bads = [run(gen.SamplingParams(max_tokens=32, temperature=t)) for t in (float("nan"), 1e-40, float("inf"))]
    results = await asyncio.gather(*goods, *bads)
    return {"generation_good_failed": sum(r != "OK" for r in results[:8]),
            "generation_bad_statuses": dict(collections.Counter(results[8:]))}


# ------------------------------------------------------------------ 3. overload
def slow_body() -> bytes:
    x = np.random.default_rng(3).standard_normal((1, 4096)).astype(np.float32)
    return infer_request("slow", {"x": x}).SerializeToString()


async def capacity(server: Server, seconds: float, concurrency: int = 8) -> float:
    """Closed loop: requests/s the slow model answers with a few callers always waiting."""
    body, done = slow_body(), 0
    async with grpc.aio.insecure_channel(server.address) as channel:
        stop = time.monotonic() + seconds

        async def worker():
            nonlocal done
            while time.monotonic() < stop:
                code, _ = await call(channel, body)  # awaited first: `done += await ...` loses updates
                done += code == grpc.StatusCode.OK

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds


async def overload(server: Server, rate: float, seconds: float) -> dict:
    """Open loop: requests start on a schedule whatever the server does (bounded by `seconds`)."""
    body = slow_body()
    latencies, refusal_ms, statuses = [], [], collections.Counter()
    rss_before = server.memory_mb()
    async with grpc.aio.insecure_channel(server.address) as channel:
        async def one():
            start = time.perf_counter()
            code, _ = await call(channel, body, timeout_s=120)
            statuses[code.name] += 1
            (latencies if code == grpc.StatusCode.OK else refusal_ms).append(time.perf_counter() - start)

        tasks, start, sent = [], time.monotonic(), 0
        while (elapsed := time.monotonic() - start) < seconds:
            while sent < int(elapsed * rate):
                tasks.append(asyncio.ensure_future(one()))
                sent += 1
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
    lat = np.array(latencies or [float("nan")]) * 1e3
    refused = np.array(refusal_ms or [float("nan")]) * 1e3
    return {"offered_rps": round(sent / seconds), "admitted_ok": len(latencies),
            "refused_unavailable": statuses.get("UNAVAILABLE", 0), "statuses": dict(statuses.most_common()),
            "admitted_p50_ms": round(float(np.percentile(lat, 50)), 1),
            "admitted_p99_ms": round(float(np.percentile(lat, 99)), 1),
            "refusal_p99_ms": round(float(np.percentile(refused, 99)), 1),
            "rss_before_mb": round(rss_before), "peak_rss_mb": round(server.memory_mb("VmHWM"))}


# ------------------------------------------------------------------ 4. cancelled streams
async def cancelled_streams(server: Server, count: int) -> dict:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = gen_grpc.GenerationStub(channel)

        async def one(i: int):
            call_ = stub.Generate(gen.GenerateRequest(
                model_name="llm", token_ids=gen.TokenIds(ids=[3 + i % 100, 4, 5, 6, 7]),
                sampling=gen.SamplingParams(max_tokens=200, ignore_eos=True)), timeout=120)
            async for _ in call_:
                break
            call_.cancel()

        await bounded([lambda i=i: one(i) for i in range(count)], 32)
    deadline = time.monotonic() + 60
    while (used := server.metric("ferry_kv_blocks_used", model="llm")) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return {"cancelled_streams": count, "kv_blocks_used_after": used,
            "cancelled_counted": server.metric("nv_inference_request_failure", model="llm", reason="CANCELED")}


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz", type=int, default=20_000, help="fuzzed requests")
    parser.add_argument("--poison-rounds", type=int, default=20, help="rounds of 60 good + 2 bad requests")
    parser.add_argument("--overload-seconds", type=float, default=30)
    parser.add_argument("--overload-factor", type=float, default=10)
    parser.add_argument("--streams", type=int, default=1000, help="generation streams cancelled after a token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(build_repository(Path(tmp)))
        try:
            rss_start = server.memory_mb()
            fuzzed = asyncio.run(fuzz(server, args.fuzz, args.seed))
            print("fuzz:", json.dumps(fuzzed), flush=True)
            poisoned = asyncio.run(poisoned_batches(server, args.poison_rounds))
            print("poison:", json.dumps(poisoned), flush=True)
            cap = asyncio.run(capacity(server, 5))
            over = asyncio.run(overload(server, cap * args.overload_factor, args.overload_seconds))
            over["capacity_rps"] = round(cap)
            print("overload:", json.dumps(over), flush=True)
            streams = asyncio.run(cancelled_streams(server, args.streams))
            print("streams:", json.dumps(streams), flush=True)
            rss_end = server.memory_mb()
        finally:
            server.stop()
    print(f"RSS: {rss_start:.0f} MB at start, {rss_end:.0f} MB at the end")
    if args.no_record:
        return
    body = "\n".join([
        f"Fuzzed requests: {fuzzed['fuzzed']}; statuses {fuzzed['statuses']}; INTERNAL+UNKNOWN: {fuzzed['bugs']}; "
        f"a good request afterwards: {fuzzed['alive_after']}",
        f"Poisoned batches: {args.poison_rounds} rounds of 60 good + 1 invalid UTF-8 + 1 zero-length request: good "
        f"failed {poisoned['infer_good_failed']}, the bad ones answered {poisoned['infer_bad_statuses']}; generation, "
        f"8 good streams beside temperature NaN/1e-40/inf: good failed {poisoned['generation_good_failed']}, bad "
        f"answered {poisoned['generation_bad_statuses']}",
        f"Overload at {args.overload_factor:g}x capacity ({over['capacity_rps']} req/s measured, "
        f"{over['offered_rps']} req/s offered for {args.overload_seconds:g} s to one instance of bench.models.wide_mlp, "
        f"queue bounded at {SLOW_QUEUE}): admitted {over['admitted_ok']}, refused UNAVAILABLE "
        f"{over['refused_unavailable']} (p99 {over['refusal_p99_ms']} ms to the refusal), statuses {over['statuses']}, "
        f"admitted p50 {over['admitted_p50_ms']} ms / p99 {over['admitted_p99_ms']} ms, RSS {over['rss_before_mb']} MB "
        f"before, peak {over['peak_rss_mb']} MB",
        f"Cancelled streams: {streams['cancelled_streams']}, KV blocks in use afterwards: "
        f"{streams['kv_blocks_used_after']:g}, counted CANCELED: {streams['cancelled_counted']:g}",
        f"Server RSS: {rss_start:.0f} MB at start, {rss_end:.0f} MB at the end",
    ])
    common.append_results("Soak (bench/soak.py)", body)


if __name__ == "__main__":
    main()
