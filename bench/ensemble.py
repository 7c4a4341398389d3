"""Ensemble fork benchmark: does a request through two independent steps cost its slower branch or the sum?

    python -m bench.ensemble [--rounds 5] [--requests 300] [--concurrency 1,4] [--no-record]

One server holds two encoders (bench/models.py heavy_encoder, seeds 0 and 1, one ONNX Runtime thread
each, so two can run at once on two cores) and an ensemble `fork` that feeds one input to both and
answers both outputs. Each round calls `left` alone, `right` alone and `fork`, closed loop at each
concurrency, interleaved. Ratios, per round then the median: fork / (left + right) is about 1 when
the steps run one after the other and falls toward fork / max(left, right) = 1 when they overlap; the
second ratio is what the ensemble's own hop costs on top of its slower branch.
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

BRANCH_CONFIG = """max_batch_size: 16
instance_group: [{count: 1, kind: KIND_CPU}]
parameters: {intra_op_thread_count: {string_value: "1"}}
input: [{name: x, data_type: TYPE_FP32, dims: [32, 512]}]
output: [{name: y, data_type: TYPE_FP32, dims: [16]}]
dynamic_batching: {}
"""
FORK_CONFIG = """platform: "ensemble"
max_batch_size: 16
input [{name: "X", data_type: TYPE_FP32, dims: [32, 512]}]
output [{name: "L", data_type: TYPE_FP32, dims: [16]}, {name: "R", data_type: TYPE_FP32, dims: [16]}]
ensemble_scheduling { step [
  {model_name: "left", input_map: {key: "x", value: "X"}, output_map: {key: "y", value: "L"}},
  {model_name: "right", input_map: {key: "x", value: "X"}, output_map: {key: "y", value: "R"}}
] }
"""
TARGETS = ("left", "right", "fork")


def repository(root: Path) -> Path:
    for seed, name in enumerate(("left", "right")):
        (root / name / "1").mkdir(parents=True)
        models.heavy_encoder(root / name / "1" / "model.onnx", seed=seed)
        (root / name / "config.yaml").write_text(BRANCH_CONFIG)
    (root / "fork" / "1").mkdir(parents=True)
    (root / "fork" / "config.pbtxt").write_text(FORK_CONFIG)
    return root


def p50_ms(address: str, model: str, concurrency: int, requests: int) -> float:
    x = np.random.default_rng(0).standard_normal((1, 32, 512), dtype=np.float32)
    name = "X" if model == "fork" else "x"
    result = asyncio.run(closed_loop(address, [common.infer_payload(model, {name: x})], concurrency,
                                     requests=requests, timeout_s=60, warmup=20))
    if result.errors:
        raise RuntimeError(f"{model}: {result.errors}")
    return result.percentile_ms(50)


def measure(address: str, concurrency: int, rounds: int, requests: int) -> dict:
    per_round = []
    for _ in range(rounds):
        p50 = {model: p50_ms(address, model, concurrency, requests) for model in TARGETS}
        per_round.append(p50 | {"vs_sum": p50["fork"] / (p50["left"] + p50["right"]),
                                "vs_max": p50["fork"] / max(p50["left"], p50["right"])})
    row = {"concurrency": concurrency}
    for key in (*TARGETS, "vs_sum", "vs_max"):
        values = [r[key] for r in per_round]
        digits = 2 if key.startswith("vs") else 1
        row[key] = f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="requests per target per round")
    parser.add_argument("--concurrency", default="1,4", help="closed-loop callers, comma-separated")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = common.start_server(common.ferry_command(repository(Path(tmp))))
        try:
            rows = [measure(address, int(c), args.rounds, args.requests) for c in args.concurrency.split(",")]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    columns = ["concurrency", "left", "right", "fork", "vs_sum", "vs_max"]
    report = "\n".join([
        f"Two heavy encoders (one ONNX Runtime thread each) and an ensemble `fork` feeding both one input; "
        f"p50 latency in ms, median [min-max] of {args.rounds} interleaved rounds of {args.requests} requests "
        "per target; vs_sum = fork / (left + right), vs_max = fork / max(left, right), taken round by round.",
        "", common.table(rows, columns)])
    print(report)
    if not args.no_record:
        common.append_results("Ensemble fork (bench/ensemble.py)", report)


if __name__ == "__main__":
    main()
