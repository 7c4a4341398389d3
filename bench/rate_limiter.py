"""A flooded model beside a quiet one, with and without Triton's rate limiter.

    python -m bench.rate_limiter [--rounds 5] [--seconds 6] [--flood 64] [--small 4] [--no-record]

Two ONNX models (bench/models.py's heavy encoder, one CPU instance each, dynamic batching up to 8) that
both declare `rate_limiter { resources [{name: "cores", count: 2}] }`, the small one with priority 1, the
flooded one with priority 2. Two servers on the same repository: one with `--rate-limit execution_count
--rate-limit-resource cores:2` (a batch of either model takes both cores; the small model goes first when
both wait), one without (both models' ONNX Runtime threads share the cores as the OS schedules them).
Each round, on each server: the small model alone (`--small` closed-loop clients), then the small model
while `--flood` clients flood the other. Printed: the small model's p99 and requests/s in each phase, its
p99 under the flood over its p99 alone (median over rounds; issue 52's goal for the limiter: within 2x),
and the flooded model's requests/s (what the limiter costs it). The alone phases of the two servers are
the same work: their ratio is the A/A control.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import numpy as np

from bench import common, models
from clients.loadgen import closed_loop

CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [{{ name: "x", data_type: TYPE_FP32, dims: [32, 512] }}]
output [{{ name: "y", data_type: TYPE_FP32, dims: [16] }}]
dynamic_batching {{ }}
instance_group [{{ kind: KIND_CPU, count: 1,
                  rate_limiter {{ resources [{{ name: "cores", count: 2 }}] priority: {priority} }} }}]
"""


def repository(root: Path) -> Path:
    for name, priority in (("small", 1), ("flood", 2)):
        models.heavy_encoder(root / name / "1" / "model.onnx", seed=priority)
        (root / name / "config.pbtxt").write_text(CONFIG.format(priority=priority))
    return root


async def phase(address: str, payloads: dict[str, bytes], small: int, flood: int, seconds: float) -> dict:
    """The small model's closed loop for `seconds`, with the flood running beside it when `flood` > 0."""
    runs = [closed_loop(address, [payloads["small"]], small, duration_s=seconds, warmup=4)]
    if flood:
        runs.append(closed_loop(address, [payloads["flood"]], flood, duration_s=seconds, warmup=8))
    results = await asyncio.gather(*runs)
    out = {"small_p99_ms": results[0].percentile_ms(99), "small_p50_ms": results[0].percentile_ms(50),
           "small_rps": results[0].throughput}
    if flood:
        out["flood_rps"] = results[1].throughput
    return out


def median(rows: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in rows]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--small", type=int, default=4)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    x = np.random.default_rng(0).standard_normal((1, 32, 512)).astype(np.float32)
    payloads = {name: common.infer_payload(name, {"x": x}) for name in ("small", "flood")}
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = repository(Path(tmp) / "repo")
        servers = {"limiter": common.start_server(common.ferry_command(
                       repo, "--rate-limit", "execution_count", "--rate-limit-resource", "cores:2")),
                   "no limiter": common.start_server(common.ferry_command(repo))}
        try:
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for system in order:
                    address = servers[system][1]
                    for name, flood in (("alone", 0), ("flooded", args.flood)):
                        row = asyncio.run(phase(address, payloads, args.small, flood, args.seconds))
                        runs.setdefault((system, name), []).append(row)
                        print(f"round {r + 1} {system:10s} {name:7s} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
                              flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)
    rows = []
    for system in ("limiter", "no limiter"):
        alone, flooded = runs[(system, "alone")], runs[(system, "flooded")]
        ratios = [f["small_p99_ms"] / a["small_p99_ms"] for a, f in zip(alone, flooded)]
        rows.append({"server": system, "small alone p99 ms": round(median(alone, "small_p99_ms"), 1),
                     "small flooded p99 ms": round(median(flooded, "small_p99_ms"), 1),
                     "flooded/alone p99 (median of rounds)": round(float(np.median(ratios)), 2),
                     "per round": "/".join(f"{v:.2f}" for v in ratios),
                     "small flooded req/s": round(median(flooded, "small_rps"), 1),
                     "flood req/s": round(median(flooded, "flood_rps"), 1)})
    control = [a["small_p99_ms"] / b["small_p99_ms"] for a, b in zip(runs[("limiter", "alone")], runs[("no limiter", "alone")])]
    body = (f"Two heavy-encoder ONNX models (x [32, 512], one CPU instance each, batches up to 8), both declaring "
            f"`cores: 2` (small priority 1, flood priority 2); {args.small} closed-loop clients on the small model, "
            f"{args.flood} on the flooded one, {args.seconds:.0f} s a phase, {args.rounds} interleaved rounds.\n\n"
            f"{common.table(rows, list(rows[0]))}\n\n"
            f"A/A control (the small model alone on the two servers, the same work): p99 ratio per round "
            f"{'/'.join(f'{v:.2f}' for v in control)} (median {np.median(control):.2f}).\n" + common.load_note(load_before))
    print(body)
    if not args.no_record:
        common.append_results("Rate limiter: a flooded model beside a quiet one (bench/rate_limiter.py)", body)


if __name__ == "__main__":
    main()
