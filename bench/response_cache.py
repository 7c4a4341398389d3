"""Response cache benchmark: what a hit saves and what a miss costs, against the same model without the cache.

    python -m bench.response_cache [--rounds 3] [--requests 1000] [--concurrency 8] [--no-record]

One server (`--cache-config local,size=512MiB`) holds the heavy encoder (bench/models.py) twice: `plain`
and `cached` (`response_cache: {enable: true}`). Each round, interleaved, closed loop: `plain` with
distinct inputs; `cached` with distinct inputs (every request a miss: its 64 KiB input hashed, its
answer copied in); `cached` with one input repeated (every request after the first a hit). Ratios are
taken round by round against `plain`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench import common, models
from clients.loadgen import closed_loop

CONFIG = """max_batch_size: 16
instance_group: [{count: 1, kind: KIND_CPU}]
input: [{name: x, data_type: TYPE_FP32, dims: [32, 512]}]
output: [{name: y, data_type: TYPE_FP32, dims: [16]}]
dynamic_batching: {}
"""
CACHE_BYTES = 512 * 2**20


def repository(root: Path) -> Path:
    for name, extra in (("plain", ""), ("cached", "response_cache: {enable: true}\n")):
        (root / name / "1").mkdir(parents=True)
        models.heavy_encoder(root / name / "1" / "model.onnx")
        (root / name / "config.yaml").write_text(CONFIG + extra)
    return root


def payloads(model: str, count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [common.infer_payload(model, {"x": rng.standard_normal((1, 32, 512), dtype=np.float32)}) for _ in range(count)]


def run(address: str, load: list[bytes], concurrency: int, requests: int) -> tuple[float, float]:
    result = asyncio.run(closed_loop(address, load, concurrency, requests=requests, timeout_s=60))
    if result.errors:
        raise RuntimeError(str(result.errors))
    return result.throughput, result.percentile_ms(50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000, help="requests per point per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {"plain": [], "miss": [], "hit": []}
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = common.start_server(common.ferry_command(repository(Path(tmp)), "--cache-config",
                                                                 f"local,size={CACHE_BYTES}"))
        try:
            run(address, payloads("plain", 50, 99), args.concurrency, 200)  # warm-up
            for r in range(args.rounds):
                seed = 1000 * (r + 1)  # fresh inputs every round, so the misses stay misses
                figures["plain"].append(run(address, payloads("plain", args.requests, seed), args.concurrency, args.requests))
                figures["miss"].append(run(address, payloads("cached", args.requests, seed + 1), args.concurrency, args.requests))
                figures["hit"].append(run(address, payloads("cached", 1, seed + 2), args.concurrency, args.requests))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    rows = []
    for name, label in (("plain", "no cache"), ("miss", "cache, every request a miss"), ("hit", "cache, every request a hit")):
        rps = [f[0] for f in figures[name]]
        p50 = [f[1] for f in figures[name]]
        vs = [a[0] / b[0] for a, b in zip(figures[name], figures["plain"])]
        rows.append({"model": label, "req/s": f"{statistics.median(rps):.0f}", "p50 ms": f"{statistics.median(p50):.2f}",
                     "req/s vs no cache": f"{statistics.median(vs):.2f} [{min(vs):.2f}-{max(vs):.2f}]"})
    report = "\n".join([
        f"Heavy encoder (64 KiB input), closed loop at {args.concurrency} callers, {args.requests} requests per point, "
        f"{args.rounds} interleaved rounds; medians (ratios round by round, [min-max]).", "",
        common.table(rows, ["model", "req/s", "p50 ms", "req/s vs no cache"])])
    print(report)
    if not args.no_record:
        common.append_results("Response cache (bench/response_cache.py)", report)


if __name__ == "__main__":
    main()
