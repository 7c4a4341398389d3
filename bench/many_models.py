"""Many models under a memory budget: on-demand loading with LRU eviction against every model loaded.

    python -m bench.many_models [--models 50] [--resident 10] [--rate 150] [--seconds 20] [--no-record]

A repository of `--models` ONNX models (Y = X W, W a 1024 x 1024 float32 weight: 4 MiB each). First every
model is loaded (`--model-control-mode none`): the baseline. The budget holds `--resident` times one model's footprint as
an on-demand server measures it loading that model alone (`ferry_model_memory_bytes`). Then the same repository under `--model-control-mode on_demand` with that budget. Both get the same open
loop: `--rate` requests/s for `--seconds`, each to a model drawn from a Zipf distribution (s = 1.1) over the
models, the same seeded sequence for both. Printed: requests/s, p50/p99 of the 10 hottest models, p99 of
the rest (the tail, where most loads happen), evictions per minute, and the server's peak RSS against the
budget plus its own baseline (RSS once ready, before any model loaded) plus 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from onnx import TensorProto, helper

from bench import common
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

WIDTH = 1024
HOT = 10


def repository(root: Path, count: int, arena: bool = True) -> Path:
    from tests import builders  # the tests' ONNX helpers: the same tiny-model builder

    for i in range(count):
        w = np.random.default_rng(i).standard_normal((WIDTH, WIDTH)).astype(np.float32)
        builders.save_onnx([helper.make_node("MatMul", ["X", "W"], ["Y"])],
                           [builders.tensor("X", TensorProto.FLOAT, ["batch", WIDTH])],
                           [builders.tensor("Y", TensorProto.FLOAT, ["batch", WIDTH])], root / f"m{i:02d}" / "1" / "model.onnx",
                           [helper.make_tensor("W", TensorProto.FLOAT, [WIDTH, WIDTH], w.ravel())])
        (root / f"m{i:02d}" / "config.yaml").write_text(
            "max_batch_size: 8\ninstance_group: [{count: 1, kind: KIND_CPU}]\n"
            + ("" if arena else "parameters: {enable_mem_arena: {string_value: '0'}}\n"))
    return root


def zipf_weights(models: int, s: float = 1.1) -> np.ndarray:
    weights = 1.0 / np.arange(1, models + 1) ** s
    return weights / weights.sum()


def oracle_cold_share(models: int, resident: int) -> float:
    """The share of the hottest HOT models' requests that find their model cold even under an oracle that
    knows every rate: it keeps the `resident - 1` most requested models and loads the rest into the last
    slot (a load needs one). Where this passes 1%, the hot p99 must include a load."""
    p = zipf_weights(models)
    return float(p[max(resident - 1, 0):HOT].sum() / p[:HOT].sum())


def zipf_sequence(count: int, models: int, seed: int = 0, s: float = 1.1) -> list[int]:
    return np.random.default_rng(seed).choice(models, size=count, p=zipf_weights(models, s)).tolist()


class PeakRss:
    """Polls a process's resident memory every 20 ms; `peak` is the largest seen."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def now(self) -> int:
        text = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.now())
            except (OSError, AttributeError):
                return

    def stop(self) -> None:
        self._stop.set()


def metric_sum(url: str, name: str) -> float:
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    labels = "" if "{" in name else r"(?:\{[^}]*\})?"
    return sum(float(v) for v in re.findall(rf"^{name}{labels} (\S+)$", page, re.M))


async def open_loop(address: str, sequence: list[int], rate: float) -> list[tuple[int, float, bool]]:
    """(model, latency s, ok) per request, sent on a fixed schedule whatever the answers do."""
    x = np.ones((1, WIDTH), np.float32)
    payloads = {}
    results: list[tuple[int, float, bool]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(model: int) -> None:
            request = payloads.get(model)
            if request is None:
                request = payloads[model] = pb.ModelInferRequest.FromString(common.infer_payload(f"m{model:02d}", {"X": x}))
            began = time.perf_counter()
            try:
                await stub.ModelInfer(request, timeout=60)
                results.append((model, time.perf_counter() - began, True))
            except grpc.aio.AioRpcError:
                results.append((model, time.perf_counter() - began, False))

        start, tasks = time.perf_counter(), []
        for i, model in enumerate(sequence):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(model)))
        await asyncio.gather(*tasks)
    return results


def summary(results, seconds: float) -> dict:
    def pct(values, q):
        return round(float(np.percentile(values, q)) * 1000, 2) if values else None

    hot = [lat for m, lat, ok in results if ok and m < HOT]
    tail = [lat for m, lat, ok in results if ok and m >= HOT]
    return {"rps": round(sum(ok for *_, ok in results) / seconds, 1), "errors": sum(not ok for *_, ok in results),
            "hot_p50_ms": pct(hot, 50), "hot_p99_ms": pct(hot, 99), "tail_p99_ms": pct(tail, 99)}


def run_system(repo: Path, extra: list[str], sequence: list[int], rate: float, seconds: float) -> tuple[dict, dict]:
    lines: list[str] = []
    cmd = common.ferry_command(repo, *extra)
    cmd[cmd.index("--metrics-port") + 1] = "0"
    proc, address = common.start_server(cmd, timeout_s=600, lines=lines)
    metrics = re.search(r"serving metrics on (\S+)", "".join(lines)).group(1)
    try:
        rss = PeakRss(proc.pid)
        baseline = rss.now()
        began = time.perf_counter()
        results = asyncio.run(open_loop(address, sequence, rate))
        elapsed = time.perf_counter() - began
        rss.stop()
        info = {"baseline_rss": baseline, "peak_rss": rss.peak, "elapsed": elapsed,
                "model_bytes": metric_sum(metrics, "ferry_model_memory_bytes") or 0.0,
                "evictions": metric_sum(metrics, "ferry_model_evictions_total"),
                "loads": metric_sum(metrics, "ferry_model_loads_total"),
                "load_seconds": metric_sum(metrics, "ferry_model_load_duration_seconds_total"),
                "hot_loads": sum(metric_sum(metrics, f'ferry_model_loads_total\\{{model="m{i:02d}"[^}}]*\\}}') for i in range(HOT)),
                "hot_evictions": sum(metric_sum(metrics, f'ferry_model_evictions_total\\{{model="m{i:02d}",reason="[a-z_]+"\\}}')
                                     for i in range(HOT)),
                "sizes": [float(v) for v in re.findall(r'^ferry_model_memory_bytes\{[^}]*\} (\S+)$',
                                                       urllib.request.urlopen(metrics, timeout=10).read().decode(), re.M)]}
        return summary(results, elapsed), info
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=50)
    parser.add_argument("--resident", type=int, default=10)
    parser.add_argument("--rate", type=float, default=150)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--no-arena", action="store_true", help="the models' configs turn ONNX Runtime's CPU arena off "
                        "(enable_mem_arena: '0', as in Triton)")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    sequence = zipf_sequence(int(args.rate * args.seconds), args.models)
    with tempfile.TemporaryDirectory() as tmp:
        repo = repository(Path(tmp) / "repo", args.models, arena=not args.no_arena)
        # three loads one after another, each measured alone: the budget holds `--resident` of their median
        _, alone = run_system(repo, ["--model-control-mode", "on_demand"], [0, 1, 2], 2, 1.5)
        one_model = float(np.median(alone["sizes"]))
        budget = int(args.resident * one_model)
        loaded, loaded_info = run_system(repo, [], sequence, args.rate, args.seconds)
        demand, demand_info = run_system(repo, ["--model-control-mode", "on_demand", "--model-memory-budget", str(budget)],
                                         sequence, args.rate, args.seconds)
    minutes = demand_info["elapsed"] / 60
    hot_requests = sum(m < HOT for m in sequence)
    bound = (budget + demand_info["baseline_rss"]) * 1.1
    rows = [{"system": "all loaded", **loaded, "peak_rss_mib": round(loaded_info["peak_rss"] / 2**20, 1)},
            {"system": f"on_demand, budget {budget / 2**20:.0f} MiB", **demand,
             "peak_rss_mib": round(demand_info["peak_rss"] / 2**20, 1)}]
    columns = ["system", "rps", "hot_p50_ms", "hot_p99_ms", "tail_p99_ms", "errors", "peak_rss_mib"]
    ratios = (f"on_demand / all loaded: requests/s {demand['rps'] / loaded['rps']:.2f}, hot p50 "
              f"{demand['hot_p50_ms'] / loaded['hot_p50_ms']:.2f}, hot p99 {demand['hot_p99_ms'] / loaded['hot_p99_ms']:.2f}")
    body = (f"{args.models} models (4 MiB weight each{', ONNX Runtime CPU arena off' if args.no_arena else ''}, footprint measured alone "
            f"{one_model / 2**20:.1f} MiB; loaded all at once at start-up they measure up to "
            f"{max(loaded_info['sizes'], default=0) / 2**20:.1f} MiB, each load's figure holding some of the others'), budget for {args.resident}; open loop {args.rate:.0f} req/s "
            f"for {args.seconds:.0f} s, Zipf s=1.1 (same sequence for both).\n\n{common.table(rows, columns)}\n\n{ratios}\n\n"
            f"on_demand: {demand_info['loads']:.0f} loads ({1e3 * demand_info['load_seconds'] / max(demand_info['loads'], 1):.1f} ms "
            f"each on average, {demand_info['load_seconds']:.1f} s of loading in {demand_info['elapsed']:.0f} s), "
            f"{demand_info['evictions'] / minutes:.0f} evictions per minute "
            f"({demand_info['hot_evictions']:.0f} of them of the hottest {HOT}, whose {demand_info['hot_loads']:.0f} loads made "
            f"at least {100 * demand_info['hot_loads'] / max(hot_requests, 1):.1f}% of their {hot_requests} requests wait; an "
            f"oracle keeping the {args.resident - 1} most requested resident and loading the rest into the last slot would "
            f"make {100 * oracle_cold_share(args.models, args.resident):.1f}% wait); "
            f"tail p99 (models outside the hottest {HOT}, where the loads happen) {demand['tail_p99_ms']} ms. Peak RSS "
            f"{demand_info['peak_rss'] / 2**20:.1f} MiB against budget + baseline ({demand_info['baseline_rss'] / 2**20:.1f} MiB) "
            f"+ 10% = {bound / 2**20:.1f} MiB: {'within' if demand_info['peak_rss'] <= bound else 'ABOVE'}."
            + common.load_note(load_before))
    print(body)
    if not args.no_record:
        common.append_results("Many models under a memory budget (bench/many_models.py)", body)


if __name__ == "__main__":
    main()
