"""Dynamic batching benchmark: how close Ferry gets to the raw backend and to the bare gRPC floor.

    python -m bench.dynamic_batching [--duration 2] [--concurrency 1,8,32,64,128] [--control]

One run measures, on this machine:
  * raw ONNX Runtime throughput in-process at batch sizes 1..128 (the limit a server can approach),
  * the Python gRPC floor (bench/floor_server.py: decode, fixed answer, no scheduling),
  * Ferry, closed loop with batch-1 requests, under no batching, fixed windows and the adaptive window,
for a light MLP (server overhead dominates) and a heavy encoder (compute dominates). Each point is run
--repeat times with the policies interleaved and the median kept (column `runs` lists all of them).
Both references (raw and floor) are re-measured all through the run, next to the points they are
compared with (see Limits). It prints a table and the ratios, and appends both to bench/RESULTS.md.

The verdict per point (margin_table): the adaptive window within 0.97x of the best fixed window, and its p99
within its latency target where that is within reach: where the bare floor's own p99 at that concurrency is
within the target (a closed loop of c clients waits c / throughput on average, so at 128 clients no server
here keeps every request under 50 ms). `--control`: the adaptive window a second time, as its own model, in
every round: what the ratio of two identical configurations does on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort

from bench import common, models
from clients.loadgen import closed_loop
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
MODELS = {
    # name: (builder, input name, row shape, adaptive latency target ms)
    "light": (models.light_mlp, "x", (256,), 50),
    "heavy": (models.heavy_encoder, "x", (32, 512), 500),
}
# How each model is deployed, the same for every policy: one instance using every core. (One
# single-threaded instance per core was tried for the heavy encoder: within noise at concurrency 64,
# a third fewer requests/s at concurrency 1, where one request no longer gets both cores.)
INSTANCES = {
    "light": "instance_group: [{count: 1, kind: KIND_CPU}]\n",
    "heavy": "instance_group: [{count: 1, kind: KIND_CPU}]\n",
}
POLICIES = {
    # No scheduling block: the config declares no inputs, so (as Triton's auto-complete) the model batches
    # dynamically with no delay: a batch is whatever is queued when an instance frees up.
    "no delay": "",
    "fixed 0.5ms": "dynamic_batching: {max_queue_delay_microseconds: 500}\n",
    "fixed 2ms": "dynamic_batching: {max_queue_delay_microseconds: 2000}\n",
    "fixed 8ms": "dynamic_batching: {max_queue_delay_microseconds: 8000}\n",
    "adaptive": "dynamic_batching: {latency_target_ms: TARGET}\n",
}
CONTROL = "adaptive again"  # --control: the adaptive window a second time, its own model


def session(path: Path, threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def raw_throughput(path: Path, row_shape: tuple, seconds: float) -> dict[int, float]:
    """Rows per second of ONNX Runtime alone, per batch size (same session options as the server): the
    better of one session using every core and one single-threaded session per core run side by side,
    so the limit is the machine's whichever way the server is deployed."""
    cores = os.cpu_count() or 1
    one = _raw_rates([session(path)], row_shape, seconds)
    per_core = _raw_rates([session(path, threads=1) for _ in range(cores)], row_shape, seconds) if cores > 1 else one
    return {size: max(one[size], per_core[size]) for size in BATCH_SIZES}


def _raw_rates(sessions: list[ort.InferenceSession], row_shape: tuple, seconds: float) -> dict[int, float]:
    rng = np.random.default_rng(0)
    rates = {}
    for size in BATCH_SIZES:
        x = rng.standard_normal((size, *row_shape)).astype(np.float32)
        runs = [0] * len(sessions)
        for sess in sessions:
            sess.run(None, {"x": x})
        start = time.perf_counter()
        threads = [threading.Thread(target=_run_for, args=(sess, {"x": x}, start + seconds, runs, i))
                   for i, sess in enumerate(sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates[size] = sum(runs) * size / (time.perf_counter() - start)
    return rates


def _run_for(sess: ort.InferenceSession, feed: dict, until: float, runs: list[int], slot: int) -> None:
    while time.perf_counter() < until:  # ONNX Runtime releases the GIL while it computes
        sess.run(None, feed)
        runs[slot] += 1


def raw_at(rates: dict[int, float], batch: float) -> float:
    sizes = sorted(rates)
    return float(np.interp(batch, sizes, [rates[s] for s in sizes]))


def build_repository(root: Path, raw_dir: Path) -> None:
    for family, (builder, _, _, target) in MODELS.items():
        for policy, text in POLICIES.items():
            name = model_name(family, policy)
            builder(root / name / "1" / "model.onnx")
            (root / name / "config.yaml").write_text(
                "max_batch_size: 128\n" + INSTANCES[family] + text.replace("TARGET", str(target)))
        builder(raw_dir / f"{family}.onnx")


def model_name(family: str, policy: str) -> str:
    return f"{family}_" + policy.replace(" ", "_").replace(".", "p")


def drive(address: str, payload: bytes, concurrency: int, duration_s: float):
    return asyncio.run(closed_loop(address, [payload], concurrency, duration_s=duration_s, warmup=20))


class Limits:
    """The two references Ferry is measured against, re-measured all through the run: a shared
    machine drifts by 10-20% within minutes, so a reference taken once at the start would turn that
    drift into a ratio. Raw ONNX Runtime is measured before every concurrency block of its model; the
    floor server is driven inside every round, next to the policies. Medians are reported."""

    def __init__(self, raw_dir: Path, floor_address: str):
        self.raw_dir, self.floor_address = raw_dir, floor_address
        self.raw_runs: dict[str, list[dict[int, float]]] = {family: [] for family in MODELS}
        self.floor_runs: dict[int, list[float]] = {}
        self.floor_p99s: dict[int, list[float]] = {}
        self._floor_payload = common.infer_payload("floor", {"x": np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)})

    def measure_raw(self, family: str) -> None:
        self.raw_runs[family].append(raw_throughput(self.raw_dir / f"{family}.onnx", MODELS[family][2], 0.25))

    def measure_floor(self, concurrency: int, duration_s: float) -> None:
        result = drive(self.floor_address, self._floor_payload, concurrency, duration_s)
        self.floor_runs.setdefault(concurrency, []).append(result.throughput)
        self.floor_p99s.setdefault(concurrency, []).append(result.percentile_ms(99))

    def raw(self, family: str) -> dict[int, float]:
        return {size: float(np.median([run[size] for run in self.raw_runs[family]])) for size in BATCH_SIZES}

    def floor(self) -> dict[int, float]:
        return {c: float(np.median(runs)) for c, runs in self.floor_runs.items()}

    def floor_p99(self) -> dict[int, float]:
        return {c: float(np.median(runs)) for c, runs in self.floor_p99s.items()}


def measure(address: str, limits: Limits, concurrencies: list[int], duration_s: float, repeat: int) -> list[dict]:
    """Every (policy, concurrency) point `repeat` times, policies interleaved within each round so slow
    drifts of a shared machine hit them alike; the row kept is the run with the median throughput."""
    rows = []
    channel = grpc.insecure_channel(address)
    rng = np.random.default_rng(1)
    for family, (_, input_name, row_shape, target) in MODELS.items():
        x = rng.standard_normal((1, *row_shape)).astype(np.float32)
        for c in concurrencies:
            limits.measure_raw(family)
            runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
            for _ in range(repeat):
                if family == "light":
                    limits.measure_floor(c, duration_s)
                for policy in POLICIES:
                    name = model_name(family, policy)
                    before, time_before = common.model_counts(channel, name), server_time(channel, name)
                    result = drive(address, common.infer_payload(name, {input_name: x}), c, duration_s)
                    after, time_after = common.model_counts(channel, name), server_time(channel, name)
                    executed = max(after[1] - before[1], 1)
                    answered = max(time_after[0] - time_before[0], 1)
                    runs[policy].append({"model": family, "policy": policy + (f" ({target} ms)" if policy.startswith("adaptive") else ""),
                                         **result.summary(), "mean_batch": round((after[0] - before[0]) / executed, 2),
                                         "server_ms": round((time_after[1] - time_before[1]) / answered / 1e6, 2)})
            for found in runs.values():
                found.sort(key=lambda r: r["throughput_rps"])
                rows.append({**found[len(found) // 2], "runs": "/".join(f"{r['throughput_rps']:.0f}" for r in found)})
                print(rows[-1], flush=True)
    channel.close()
    return rows


def server_time(channel, model: str) -> tuple[int, int]:
    """(requests answered, their total queue + compute ns) from ModelStatistics: the part of a request's
    latency that the batching window governs (its latency target is for this), the rest being the
    front end and the client."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0].inference_stats
    spent = stats.queue.ns + stats.compute_input.ns + stats.compute_infer.ns + stats.compute_output.ns
    return stats.success.count, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measured point")
    parser.add_argument("--repeat", type=int, default=3, help="runs per point; the median is kept")
    parser.add_argument("--concurrency", default="1,8,32,64,128")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--models", default=",".join(MODELS), help="subset of: " + ", ".join(MODELS))
    parser.add_argument("--policies", default=",".join(POLICIES), help="subset of: " + ", ".join(POLICIES))
    parser.add_argument("--control", action="store_true", help="serve the adaptive window twice (an A/A ratio)")
    args = parser.parse_args()
    for name in set(MODELS) - set(args.models.split(",")):
        del MODELS[name]
    for name in set(POLICIES) - set(args.policies.split(",")):
        del POLICIES[name]
    if args.control and "adaptive" in POLICIES:
        POLICIES[CONTROL] = POLICIES["adaptive"]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root, raw_dir = Path(tmp) / "repository", Path(tmp) / "raw"
        raw_dir.mkdir(parents=True)
        build_repository(root, raw_dir)
        floor_proc, floor_address = common.start_server([common.sys.executable, "-m", "bench.floor_server"])
        proc, address = common.start_server(common.ferry_command(root))
        try:
            limits = Limits(raw_dir, floor_address)
            rows = measure(address, limits, concurrencies, args.duration, args.repeat)
        finally:
            for p in (proc, floor_proc):
                p.terminate()
                p.wait()
    report = render(rows, limits, concurrencies)
    print(report)
    if not args.no_record:
        common.append_results("Dynamic batching (bench/dynamic_batching.py)", report)


def render(rows: list[dict], limits: Limits, concurrencies: list[int]) -> str:
    raw = {family: limits.raw(family) for family in MODELS}
    floor = limits.floor()
    for row in rows:
        row["vs_raw"] = round(row["throughput_rps"] / raw_at(raw[row["model"]], row["mean_batch"]), 2)
        if row["model"] == "light":
            row["vs_floor"] = round(row["throughput_rps"] / floor[row["concurrency"]], 2)
    columns = ["model", "policy", "concurrency", "throughput_rps", "p50_ms", "p90_ms", "p99_ms", "server_ms", "mean_batch",
               "vs_raw", "vs_floor", "client_cpu_share", "errors", "runs"]
    parts = [
        "Raw ONNX Runtime, rows/s by batch size (median of the measurements spread over the run, min-max): " + "; ".join(
            f"{f}: " + ", ".join(f"{b}: {r:.0f} ({min(run[b] for run in limits.raw_runs[f]):.0f}-"
                                 f"{max(run[b] for run in limits.raw_runs[f]):.0f})" for b, r in v.items())
            for f, v in raw.items()),
        "Python gRPC floor, requests/s by concurrency (median of the runs, all listed): " + ", ".join(
            f"{c}: {v:.0f} ({'/'.join(f'{x:.0f}' for x in sorted(limits.floor_runs[c]))})" for c, v in floor.items()),
        "Python gRPC floor, p99 ms by concurrency (median of the runs): " + ", ".join(
            f"{c}: {v:.1f}" for c, v in limits.floor_p99().items()),
        "Deployment (every policy alike): " + "; ".join(
            f"{f}: " + INSTANCES[f].replace("\n", " ").strip() for f in raw),
        "", common.table(rows, columns), "",
    ]
    c = 64 if 64 in concurrencies else concurrencies[-1]
    for family in MODELS:
        if (pair := best_fixed_and_adaptive(rows, family, c)) is None:
            continue
        best, adaptive = pair
        key = "vs_raw" if family == "heavy" else "vs_floor"
        parts.append(f"- {family}, concurrency {c}: adaptive {key} = {adaptive[key]}, best fixed window "
                     f"({best['policy']}) {key} = {best[key]}")
    parts += ["", margin_table(rows, concurrencies, limits.floor_p99())]
    return "\n".join(parts)


def best_fixed_and_adaptive(rows: list[dict], family: str, concurrency: int) -> tuple[dict, dict] | None:
    """The fixed window with the most requests/s at this point and the adaptive row; None if either is missing."""
    at = [r for r in rows if r["model"] == family and r["concurrency"] == concurrency]
    fixed = [r for r in at if r["policy"].startswith("fixed")]
    adaptive = [r for r in at if r["policy"].startswith("adaptive") and not r["policy"].startswith(CONTROL)]
    if not fixed or not adaptive:
        return None
    return max(fixed, key=lambda r: r["throughput_rps"]), adaptive[0]


def margin_table(rows: list[dict], concurrencies: list[int], floor_p99: dict[int, float] | None = None) -> str:
    """Adaptive against the best fixed window of the same run, per model and concurrency (target: 0.97 or
    more everywhere, p99 within the adaptive window's latency target where the bare floor's p99 is: see the
    module's docstring). `runs` shows each adaptive round over the best fixed median: where it straddles 1,
    the gap is within the machine's noise (and the best of four fixed medians is itself biased upwards by
    that noise); the control column (--control) is the same for the adaptive window's second copy."""
    floor_p99 = floor_p99 or {}
    lines = ["| model | concurrency | best fixed | adaptive / best fixed (req/s) | runs / best fixed | control / best fixed "
             "| adaptive p99 ms | floor p99 ms | server ms (mean queue + compute) | target ms | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for family, (_, _, _, target) in MODELS.items():
        for conc in concurrencies:
            if (pair := best_fixed_and_adaptive(rows, family, conc)) is None:
                continue
            best, mine = pair
            top = max(best["throughput_rps"], 1e-9)
            ratio = mine["throughput_rps"] / top
            control = [r for r in rows if r["model"] == family and r["concurrency"] == conc and r["policy"].startswith(CONTROL)]
            floor = floor_p99.get(conc) if family == "light" else None
            lines.append(f"| {family} | {conc} | {best['policy']} | {ratio:.3f} | {_over(mine, top)} "
                         f"| {_over(control[0], top) if control else 'n/a'} | {mine['p99_ms']} "
                         f"| {'n/a' if floor is None else f'{floor:.1f}'} | {mine['server_ms']} | {target} "
                         f"| {verdict(ratio, mine['p99_ms'], target, floor)} |")
    return "\n".join(lines)

def _over(row: dict, top: float) -> str:
    return "/".join(f"{float(v) / top:.2f}" for v in row["runs"].split("/"))


def verdict(ratio: float, p99_ms: float, target_ms: float, floor_p99_ms: float | None) -> str:
    """ok: within 0.97x of the best fixed window, and p99 within the target unless even the bare floor's p99
    is over it (then the target is out of reach for any server here, and only the throughput is judged)."""
    if ratio < 0.97:
        return "MISS (req/s)"
    if p99_ms <= target_ms:
        return "ok"
    if floor_p99_ms is not None and floor_p99_ms > target_ms:
        return f"ok (p99 out of reach: the floor's is {floor_p99_ms:.0f} ms)"
    return "MISS (p99)"


if __name__ == "__main__":
    main()
