"""Cost-aware batching benchmark: FIFO dynamic batching vs `binpack` on bimodal request lengths.

    python -m bench.binpack [--rates 250,325,400] [--requests 3000] [--no-record]

One server holds the same attention encoder (bench/models.py token_encoder, cost grows with length)
twice: `fifo` pads every batch to its longest member (dynamic batching over a variable-length input)
and `binpack` batches within learned cost buckets under a padded-token budget. Traffic: Poisson
arrivals at a fixed rate, 90% short requests (12-20 tokens) and 10% long ones (480-512 tokens),
sent as two independent Poisson streams (0.9 and 0.1 of the rate), which is the same process as one
stream whose requests are short with probability 0.9. Both models get the same warm-up and the same
traffic (same seeds). It reports p50/p99 latency of short and of long requests, throughput, mean
batch size and padding waste (from the server's own counters), and appends the table to RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench import common, models
from clients.loadgen import RunResult, open_loop

SHORT, LONG = (12, 20), (480, 512)  # token ranges
LONG_SHARE = 0.1
CONFIG = """max_batch_size: 16
instance_group: [{count: 1, kind: KIND_CPU}]
parameters: {intra_op_thread_count: {string_value: "1"}}
input:
  - {name: ids, data_type: TYPE_INT64, dims: [-1], variable_length: true, lengths_input: lengths}
  - {name: lengths, data_type: TYPE_INT64, dims: [1]}
output: [{name: y, data_type: TYPE_FP32, dims: [16]}]
dynamic_batching: {}
"""
POLICIES = {
    "fifo": "",
    "binpack": "binpack_batching: {max_batch_cost: 1024}\n",  # at most 2 long rows per batch
}


def payloads(model: str, tokens: tuple[int, int], count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [common.infer_payload(model, {"ids": rng.integers(0, 1000, (1, rng.integers(tokens[0], tokens[1] + 1)))})
            for _ in range(count)]


async def traffic(address: str, model: str, rate: float, requests: int, seed: int) -> tuple[RunResult, RunResult]:
    longs = round(requests * LONG_SHARE)
    return await asyncio.gather(
        open_loop(address, payloads(model, SHORT, 64, seed), rate * (1 - LONG_SHARE), requests - longs, seed=seed),
        open_loop(address, payloads(model, LONG, 16, seed + 1), rate * LONG_SHARE, longs, seed=seed + 1))


def counters(metrics_url: str, model: str) -> dict[str, float]:
    """The server's padding counters and bucket boundaries for one model."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found = {"bounds": []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name in ("ferry_padding_elements", "ferry_computed_elements"):
                found[sample.name] = sample.value
            elif sample.name == "ferry_bucket_upper_cost" and sample.value != float("inf"):
                found["bounds"].append(sample.value)
    return found


def measure(address: str, metrics_url: str, model: str, rate: float, requests: int) -> dict:
    channel = grpc.insecure_channel(address)
    asyncio.run(traffic(address, model, rate, 300, seed=7))  # warm-up: batch times measured, boundaries learned
    before, counts0 = counters(metrics_url, model), common.model_counts(channel, model)
    short, long = asyncio.run(traffic(address, model, rate, requests, seed=1))
    after, counts1 = counters(metrics_url, model), common.model_counts(channel, model)
    channel.close()
    computed = after["ferry_computed_elements"] - before["ferry_computed_elements"]
    padded = after["ferry_padding_elements"] - before["ferry_padding_elements"]
    completed = short.completed + long.completed
    return {
        "policy": model, "rate_rps": rate, "completed": completed,
        "errors": sum(short.errors.values()) + sum(long.errors.values()),
        "throughput_rps": round(completed / max(short.wall_s, long.wall_s), 1),
        "short_p50_ms": round(short.percentile_ms(50), 2), "short_p99_ms": round(short.percentile_ms(99), 2),
        "long_p50_ms": round(long.percentile_ms(50), 2), "long_p99_ms": round(long.percentile_ms(99), 2),
        "mean_batch": round((counts1[0] - counts0[0]) / max(counts1[1] - counts0[1], 1), 2),
        "padding_waste": round(padded / computed, 3) if computed else 0.0,
        "boundaries": ", ".join(f"{b:g}" for b in after["bounds"]) or "-",
    }


def render(rows: list[dict], rates: list[float]) -> str:
    columns = ["policy", "rate_rps", "completed", "errors", "throughput_rps", "short_p50_ms", "short_p99_ms",
               "long_p50_ms", "long_p99_ms", "mean_batch", "padding_waste", "boundaries"]
    parts = [f"Traffic: Poisson, {1 - LONG_SHARE:.0%} of requests {SHORT[0]}-{SHORT[1]} tokens, {LONG_SHARE:.0%} "
             f"{LONG[0]}-{LONG[1]} tokens; model: attention encoder (2 layers, width 64), 1 instance, 1 ORT thread, "
             "max_batch_size 16; binpack: learned boundaries, max_batch_cost 1024 tokens.", "",
             common.table(rows, columns), ""]
    for rate in rates:
        fifo, binpack = (next(r for r in rows if r["policy"] == p and r["rate_rps"] == rate) for p in POLICIES)
        ratio = fifo["short_p99_ms"] / binpack["short_p99_ms"]
        throughput = binpack["throughput_rps"] / fifo["throughput_rps"]
        met = "met" if ratio >= 3 and throughput >= 0.98 else "NOT met"
        parts.append(f"- {rate:g} req/s: short p99 FIFO / binpack = {ratio:.1f}x, throughput binpack / FIFO = "
                     f"{throughput:.2f} (target >= 3x with throughput no lower: {met})")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="250,325,400", help="arrival rates, requests/s")
    parser.add_argument("--requests", type=int, default=3000, help="requests per measured run")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, extra in POLICIES.items():
            models.token_encoder(root / name / "1" / "model.onnx")
            (root / name / "config.yaml").write_text(CONFIG + extra)
        lines: list[str] = []
        proc, address = common.start_server(common.ferry_command(root, "--metrics-port", "0"), lines=lines)
        metrics_url = next(line.split()[-1] for line in lines if "serving metrics on" in line)
        try:
            for rate in rates:
                for name in POLICIES:
                    rows.append(measure(address, metrics_url, name, rate, args.requests))
                    print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait()
    report = render(rows, rates)
    print(report)
    if not args.no_record:
        common.append_results("Cost-aware batching (bench/binpack.py)", report)


if __name__ == "__main__":
    main()
