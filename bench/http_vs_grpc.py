"""HTTP vs gRPC front doors, side by side in one run: same server process, same model, same concurrency.

    python -m bench.http_vs_grpc [--concurrency 1,16] [--duration 2] [--rounds 3] [--streams 8]

One `ferry serve` (gRPC and HTTP on 127.0.0.1, both from the same event loop and runners) serves
  * KServe v2 infer of bench/models.py's light MLP (x [1, 256] -> y [1, 16]), closed loop:
    gRPC ModelInfer vs HTTP POST /v2/models/mlp/infer with Triton's binary tensor extension;
  * generation on a tiny random Llama, `--streams` concurrent streams, closed loop, the same token-id
    prompts and exactly `--max-tokens` tokens each (ignore_eos): gRPC Generate (server streaming) vs
    OpenAI POST /v1/completions with stream=true (server-sent events, usage in the last chunk).

Load generators, chosen so neither door pays for its client: both are one asyncio loop in this
process, requests built once before the run and sent as bytes. gRPC: grpc.aio through a generic stub
(clients/loadgen.py, no protobuf work per infer call; Generate responses are decoded to count tokens).
HTTP: aiohttp with a keep-alive pool of one connection per caller and its C HTTP parser; infer answers
are read whole but not decoded, SSE chunks are parsed as JSON (the same work as decoding a protobuf).
tritonclient.http was not used: its gevent pool would be a different client architecture from grpc.aio.

Rounds are interleaved (gRPC then HTTP, then HTTP then gRPC, ...) so a shared machine's drift hits both
doors alike; medians over rounds are reported with every run listed, and the ratio HTTP/gRPC. The run
is bounded: (concurrencies x 2 doors x rounds) infer points of --duration seconds, plus 2 x rounds
generation runs of --streams x --requests-per-stream streams. Appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import numpy as np

from bench import common, models
from clients import loadgen
from protos import generate_pb2 as gen
from protos import grpc_service_pb2 as pb

INFER_MODEL, LLM_MODEL = "mlp", "llama"
VOCAB = 2048


# ---------------------------------------------------------------- the model repository
def build_repository(root: Path) -> None:
    models.light_mlp(root / INFER_MODEL / "1" / "model.onnx")
    (root / INFER_MODEL / "config.yaml").write_text("max_batch_size: 128\ninstance_group: [{count: 1, kind: KIND_CPU}]\n")
    models.random_llama(root / LLM_MODEL / "1", vocab=VOCAB, hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)
    (root / LLM_MODEL / "config.yaml").write_text(
        "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 512, max_num_seqs: 32, "
        "max_num_batched_tokens: 1024, max_model_len: 512}\n")


def start(root: Path) -> tuple[object, str, str]:
    lines: list[str] = []
    proc, grpc_address = common.start_server(common.ferry_command(root), lines=lines)
    http = re.search(r"ferry: serving HTTP on (\S+)", "".join(lines))
    if http is None:
        proc.kill()
        raise RuntimeError("the server did not print its HTTP address")
    return proc, grpc_address, f"http://{http.group(1)}"


# ---------------------------------------------------------------- infer over HTTP (binary extension)
def binary_infer_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """Triton's binary tensor extension: a JSON header, then the raw tensor bytes; the output asked for
    as binary too, as tritonclient.http does by default."""
    header = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return header + x.tobytes(), headers


def decode_binary_answer(data: bytes, header_length: int) -> np.ndarray:
    header = json.loads(data[:header_length])
    out = header["outputs"][0]
    return np.frombuffer(data[header_length:], np.float32).reshape(out["shape"])


async def http_closed_loop(url: str, body: bytes, headers: dict, concurrency: int, duration_s: float,
                           warmup: int = 20) -> loadgen.RunResult:
    """`concurrency` callers on their own keep-alive connections, each posting as soon as its last answer is read."""
    tally = loadgen._Tally()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def post(record: bool) -> None:
            start = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                ok = response.status == 200
            if not record:
                return
            if ok:
                tally.latencies.append(time.perf_counter() - start)
            else:
                tally.errors[str(response.status)] = tally.errors.get(str(response.status), 0) + 1

        await asyncio.gather(*(post(False) for _ in range(warmup)))
        stop_at = 0.0

        async def caller() -> None:
            while time.perf_counter() < stop_at:
                await post(True)

        with loadgen._still_heap():
            cpu0, t0 = time.process_time(), time.perf_counter()
            stop_at = t0 + duration_s
            await asyncio.gather(*(caller() for _ in range(concurrency)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return tally.result(wall, cpu, len(tally.latencies), False, concurrency=concurrency)


def infer_point(door: str, grpc_address: str, http_url: str, x: np.ndarray, concurrency: int, duration_s: float) -> dict:
    if door == "gRPC":
        payload = common.infer_payload(INFER_MODEL, {"x": x})
        result = asyncio.run(loadgen.closed_loop(grpc_address, [payload], concurrency, duration_s=duration_s, warmup=20))
    else:
        body, headers = binary_infer_body(x)
        result = asyncio.run(http_closed_loop(f"{http_url}/v2/models/{INFER_MODEL}/infer", body, headers, concurrency, duration_s))
    s = result.summary()
    return {"rps": s["throughput_rps"], "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "errors": s["errors"],
            "client_cpu": s["client_cpu_share"]}


def check_same_answer(grpc_address: str, http_url: str, x: np.ndarray) -> None:
    """Both doors must compute the same thing before their speeds are compared."""
    import urllib.request

    from protos import grpc_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(grpc_address) as channel:
        request = pb.ModelInferRequest.FromString(common.infer_payload(INFER_MODEL, {"x": x}))
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    by_grpc = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(tuple(reply.outputs[0].shape))
    body, headers = binary_infer_body(x)
    call = urllib.request.Request(f"{http_url}/v2/models/{INFER_MODEL}/infer", data=body, headers=headers)
    with urllib.request.urlopen(call, timeout=30) as answer:
        by_http = decode_binary_answer(answer.read(), int(answer.headers["Inference-Header-Content-Length"]))
    if not np.array_equal(by_grpc, by_http):
        raise RuntimeError("gRPC and HTTP answered differently")


# ---------------------------------------------------------------- generation
def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=length).tolist() for _ in range(count)]


def grpc_generate(address: str, jobs: list[list[int]], streams: int, max_tokens: int) -> loadgen.RunResult:
    payloads = [gen.GenerateRequest(model_name=LLM_MODEL, token_ids=gen.TokenIds(ids=p),
                                    sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True)).SerializeToString()
                for p in jobs]
    return asyncio.run(loadgen.closed_loop(address, payloads, streams, requests=len(jobs), method_path=loadgen.GENERATE,
                                           streaming=True, timeout_s=300))


async def _sse_completion(session, url: str, prompt: list[int], max_tokens: int, tally) -> None:
    body = {"model": LLM_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, usage = [], None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            tally.errors[str(response.status)] = tally.errors.get(str(response.status), 0) + 1
            await response.read()
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    tally.latencies.append(time.perf_counter() - start)
    tokens = usage["completion_tokens"] if usage else len(stamps)
    tally.output_tokens += tokens
    if stamps:
        tally.ttft.append(stamps[0] - start)
        tally.itl.extend(np.diff(stamps).tolist())
        if tokens > 1:
            tally.tpot.append((stamps[-1] - stamps[0]) / (tokens - 1))


async def _http_generate(url: str, jobs: list[list[int]], streams: int, max_tokens: int) -> loadgen.RunResult:
    tally = loadgen._Tally()
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        queue = list(jobs)

        async def caller() -> None:
            while queue:
                await _sse_completion(session, url, queue.pop(), max_tokens, tally)

        with loadgen._still_heap():
            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(streams)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return tally.result(wall, cpu, len(jobs), True, concurrency=streams)


def generate_point(door: str, grpc_address: str, http_url: str, jobs, streams: int, max_tokens: int) -> dict:
    if door == "gRPC":
        result = grpc_generate(grpc_address, jobs, streams, max_tokens)
    else:
        result = asyncio.run(_http_generate(f"{http_url}/v1/completions", jobs, streams, max_tokens))
    expected = len(jobs) * max_tokens
    if result.errors or result.output_tokens != expected:
        raise RuntimeError(f"{door} generation: errors {result.errors}, {result.output_tokens} tokens of {expected}")
    s = result.summary()
    return {"tok_s": s["output_tokens_per_s"], "ttft_p50_ms": s["ttft_p50_ms"],
            "ttft_p99_ms": round(result.percentile_ms(99, result.ttft_s), 1), "itl_p50_ms": s["itl_p50_ms"],
            "client_cpu": s["client_cpu_share"]}


# ---------------------------------------------------------------- rounds, medians, report
def interleaved(rounds: int, measure) -> dict[str, list[dict]]:
    """`measure(door)` `rounds` times per door, the order flipped every round."""
    runs: dict[str, list[dict]] = {"gRPC": [], "HTTP": []}
    for i in range(rounds):
        for door in (("gRPC", "HTTP") if i % 2 == 0 else ("HTTP", "gRPC")):
            runs[door].append(measure(door))
            print(door, runs[door][-1], flush=True)
    return runs


def median_row(runs: list[dict], key: str, **labels) -> dict:
    """Median of every figure over the rounds (each on its own); `runs` lists `key` of every round."""
    row = dict(labels)
    for name in runs[0]:
        row[name] = round(float(np.median([r[name] for r in runs])), 3 if name == "client_cpu" else 1)
    row["runs"] = "/".join(f"{r[key]:.0f}" for r in runs)
    return row


def ratio(rows: list[dict], name: str, **match) -> float:
    pick = {r["door"]: r[name] for r in rows if all(r.get(k) == v for k, v in match.items())}
    return pick["HTTP"] / pick["gRPC"] if pick.get("gRPC") else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16", help="infer callers per point, comma-separated")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per infer point")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per door; medians are reported")
    parser.add_argument("--streams", type=int, default=8, help="concurrent generation streams")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    jobs = prompts(args.streams * args.requests_per_stream, args.prompt_tokens)
    infer_rows, gen_rows = [], []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        build_repository(Path(tmp))
        proc, grpc_address, http_url = start(Path(tmp))
        try:
            check_same_answer(grpc_address, http_url, x)
            for c in concurrencies:
                runs = interleaved(args.rounds, lambda door, c=c: infer_point(door, grpc_address, http_url, x, c, args.duration))
                infer_rows += [median_row(r, "rps", door=door, concurrency=c) for door, r in runs.items()]
            generate_point("gRPC", grpc_address, http_url, jobs[: args.streams], args.streams, args.max_tokens)  # warm up
            generate_point("HTTP", grpc_address, http_url, jobs[: args.streams], args.streams, args.max_tokens)
            runs = interleaved(args.rounds, lambda door: generate_point(door, grpc_address, http_url, jobs, args.streams,
                                                                        args.max_tokens))
            gen_rows = [median_row(r, "tok_s", door=door, streams=args.streams) for door, r in runs.items()]
        finally:
            proc.terminate()
            proc.wait()
    report = render(infer_rows, gen_rows, concurrencies, args, time.perf_counter() - began)
    print(report)
    if not args.no_record:
        common.append_results("HTTP vs gRPC front doors (bench/http_vs_grpc.py)", report)


def render(infer_rows: list[dict], gen_rows: list[dict], concurrencies: list[int], args, took_s: float) -> str:
    gen_label = "gRPC Generate stream vs OpenAI /v1/completions stream"
    lines = [
        f"One server, gRPC and HTTP on 127.0.0.1; {args.rounds} interleaved rounds per door, medians (every round's "
        f"figure in `runs`); whole run {took_s:.0f} s. Load generators: grpc.aio raw bytes (clients/loadgen.py) vs "
        "aiohttp keep-alive, both one asyncio loop in the bench process, requests built before the run.", "",
        f"KServe v2 infer, light MLP (x [1, 256] FP32 -> y [1, 16]), closed loop, {args.duration:g} s per point; "
        "HTTP uses Triton's binary tensor extension for input and output:", "",
        common.table(infer_rows, ["door", "concurrency", "rps", "p50_ms", "p99_ms", "errors", "client_cpu", "runs"]), "",
        f"Generation ({gen_label}), random Llama (4 layers, hidden 256, vocab {VOCAB}, float32 on the CPU), "
        f"{args.streams} concurrent streams, {args.streams * args.requests_per_stream} requests of {args.prompt_tokens} "
        f"prompt tokens and exactly {args.max_tokens} output tokens (ignore_eos), greedy:", "",
        common.table(gen_rows, ["door", "streams", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "client_cpu", "runs"]), "",
        "Ratios HTTP/gRPC (medians of this run):",
    ]
    for c in concurrencies:
        lines.append(f"- infer, concurrency {c}: requests/s {ratio(infer_rows, 'rps', concurrency=c):.2f}x, "
                     f"p99 {ratio(infer_rows, 'p99_ms', concurrency=c):.2f}x")
    lines.append(f"- generation: tokens/s {ratio(gen_rows, 'tok_s'):.2f}x, time to first token p50 "
                 f"{ratio(gen_rows, 'ttft_p50_ms'):.2f}x, p99 {ratio(gen_rows, 'ttft_p99_ms'):.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
