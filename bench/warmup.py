"""model_warmup benchmark: what the first request after a load costs, with and without a warmup sample.

    python -m bench.warmup [--rounds 8] [--kind KIND_CPU|KIND_GPU] [--no-record]

One server holds the heavy encoder (bench/models.py) twice: `cold` (no warmup) and `warm` (a sample
of batch 1, the shape the benchmark sends, run twice per instance at load). Each round reloads both
(RepositoryModelLoad: a new load, as a deploy or a hot reload makes one), then times each model's
first request and the median of its next 20. Ratios per round, then the median: first / steady for each model, and cold's first / warm's
first (what warmup saves the first client). bench/cuda_check.py runs this on the GPU (check 8).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import common, models

SAMPLE = ("model_warmup: [{name: one, batch_size: 1, count: 2, inputs: {x: {data_type: TYPE_FP32, "
          "dims: [32, 512], random_data: true}}}]\n")


def repository(root: Path, kind: str) -> Path:
    for name, extra in (("cold", ""), ("warm", SAMPLE)):
        (root / name / "1").mkdir(parents=True)
        models.heavy_encoder(root / name / "1" / "model.onnx")
        (root / name / "config.yaml").write_text(
            f"max_batch_size: 8\ninstance_group: [{{count: 1, kind: {kind}}}]\ndynamic_batching: {{}}\n{extra}")
    return root


def first_and_steady(client, model: str, x: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(first request ms, median of the next 20 ms, the answer) right after `model` was (re)loaded."""
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        answer = client.infer(model, {"x": x})["y"]
        times.append((time.perf_counter() - t0) * 1000)
    return times[0], statistics.median(times[1:]), answer


def measure(root: Path, kind: str, rounds: int) -> tuple[dict, bool]:
    """Per-round figures and whether the two models always answered alike."""
    from clients.client import InferenceClient

    x = np.random.default_rng(1).standard_normal((1, 32, 512), dtype=np.float32)
    # reloads need explicit model control (off by default)
    command = common.ferry_command(repository(root, kind), "--model-control-mode", "explicit", "--load-model", "*")
    proc, address = common.start_server(command, timeout_s=600)
    rows: dict[str, list[float]] = {"cold first / steady": [], "warm first / steady": [], "cold first / warm first": [],
                                    "cold first ms": [], "warm first ms": []}
    same = True
    try:
        with InferenceClient(address, timeout_s=300) as client:
            for r in range(rounds):
                if r:  # round 0 times the server's own start; later rounds each reload both models first
                    for name in ("cold", "warm"):
                        client.load_model(name)
                cold, cold_steady, cold_y = first_and_steady(client, "cold", x)
                warm, warm_steady, warm_y = first_and_steady(client, "warm", x)
                same = same and bool(np.allclose(cold_y, warm_y, rtol=1e-3, atol=1e-4))
                for key, value in (("cold first / steady", cold / cold_steady), ("warm first / steady", warm / warm_steady),
                                   ("cold first / warm first", cold / warm), ("cold first ms", cold), ("warm first ms", warm)):
                    rows[key].append(value)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows, same


def summary(rows: dict[str, list[float]]) -> str:
    return "; ".join(f"{key} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for key, v in rows.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kind", default="KIND_CPU", choices=("KIND_CPU", "KIND_GPU"))
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows, same = measure(Path(tmp), args.kind, args.rounds)
    report = (f"Heavy encoder, {args.kind}, {args.rounds} loads of each model (the server's start, then reloads); "
              f"median [min-max] over loads: {summary(rows)}; answers alike: {same}")
    print(report)
    if not args.no_record:
        common.append_results("model_warmup (bench/warmup.py)", report)


if __name__ == "__main__":
    main()
