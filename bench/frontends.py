"""Front-end processes: where one event loop saturates, and what `--frontend-processes N` does past it.

    python -m bench.frontends [--processes 1,2] [--rates 250,500,1000,2000,4000] [--concurrency 64] [--asyncio]
                              [--clients 2] [--duration 5] [--rounds 3] [--baseline /path/to/other/checkout] [--record]

Two parts, one run, on the light MLP (256-1024x3-16, batch-1 requests, a fixed 8 ms window: the model
whose cost is the gRPC side, bench/models.py):

1. Loop saturation. The bare grpc.aio handler (bench/floor_server.py) and Ferry with one process are
   offered Poisson arrivals at each rate; the server's main thread (its event loop; grpc's poller and the
   model's threads are other threads) is sampled from /proc for CPU time. Busy fraction = loop CPU / wall;
   loop cost = loop CPU / answered request; the loop is 100% busy at 1 / cost requests/s. A rate the server
   cannot keep up with (answered < 90% of offered) ends that server's sweep.
2. The sweep over N. Ferry with `--frontend-processes N` for each N, closed loop at --concurrency spread over
   --clients load-generator processes of 4 connections each (SO_REUSEPORT spreads connections; one
   connection always lands on one front end), rounds interleaved, medians kept, ratios against the first.
   The engine's main thread is sampled too: with N >= 2 it only batches and runs the link. With
   --baseline, another checkout's one-process server is run in the same rounds (the cost of this code at
   N=1: it must stay within 5%); with --asyncio, one process on asyncio's own loop (the rest run on uvloop).

The load generator needs CPU too: on a 2-core machine it competes with the server's processes, so N=2
there shows the direction, not the scaling; on a 16-core machine give it --clients 4 or more.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench import common, models
from clients.loadgen import closed_loop, open_loop

MODEL = "light"
CONFIG = "max_batch_size: 128\ninstance_group: [{count: 1, kind: KIND_CPU}]\ndynamic_batching: {max_queue_delay_microseconds: 8000}\n"
TICK = os.sysconf("SC_CLK_TCK")


def build(root: Path) -> Path:
    repo = root / "repo"
    models.light_mlp(repo / MODEL / "1" / "model.onnx")
    (repo / MODEL / "config.yaml").write_text(CONFIG)
    return repo


def payloads(count: int = 16) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [common.infer_payload(MODEL, {"x": rng.standard_normal((1, 256)).astype(np.float32)}) for _ in range(count)]


def loop_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (its event loop): utime + stime of /proc/PID/task/PID."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start(kind: str, repo: Path, processes: int = 1, root: Path | None = None,
          loop: str = "auto") -> tuple[subprocess.Popen, str]:
    if kind == "floor":
        return common.start_server([sys.executable, "-m", "bench.floor_server", "0"])
    cmd = common.ferry_command(repo, "--frontend-processes", str(processes),
                               *(("--event-loop", loop) if loop != "auto" else ()))
    if root is None:
        return common.start_server(cmd)
    # another checkout (--baseline): its own code, the same flags but the new one
    cmd = [c for c in cmd if c not in ("--frontend-processes", str(processes))]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root)})
    return _read_address(proc)


def _read_address(proc: subprocess.Popen) -> tuple[subprocess.Popen, str]:
    import re
    import threading

    address = None
    for line in proc.stdout:
        found = re.search(r"ferry: serving gRPC on (\S+)", line)
        address = found.group(1) if found else address
        if line.startswith("ferry: ready"):
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, address


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- part 1: loop saturation
def saturation(kind: str, repo: Path, rates: list[int], duration_s: float) -> list[dict]:
    proc, address = start(kind, repo)
    rows = []
    try:
        asyncio.run(closed_loop(address, payloads(), 8, requests=200, timeout_s=30))  # warm up
        for rate in rates:
            cpu0, t0 = loop_cpu_s(proc.pid), time.perf_counter()
            result = asyncio.run(open_loop(address, payloads(), rate, duration_s=duration_s, timeout_s=30))
            cpu, wall = loop_cpu_s(proc.pid) - cpu0, time.perf_counter() - t0
            s = result.summary()
            answered = s["completed"] - s["errors"]
            cost_us = cpu / answered * 1e6 if answered else float("nan")
            rows.append({"server": kind, "offered": rate, "answered/s": round(answered / wall), "loop busy": f"{cpu / wall:.0%}",
                         "loop µs/request": round(cost_us, 1), "loop saturates at": round(1e6 / cost_us) if answered else "",
                         "p99 ms": s["p99_ms"]})
            print(f"frontends: {kind} offered {rate}/s: {rows[-1]}", flush=True)
            if answered / wall < 0.9 * rate:
                break
    finally:
        stop(proc)
    return rows


# ---------------------------------------------------------------- part 2: the sweep over N
CONNECTIONS = 4  # per client process: SO_REUSEPORT spreads connections, so each client opens several


def _client(address: str, concurrency: int, duration_s: float) -> dict:
    """One load-generator process: `concurrency` callers over CONNECTIONS separate connections."""
    share = [concurrency // CONNECTIONS + (i < concurrency % CONNECTIONS) for i in range(CONNECTIONS)]
    separate = [("grpc.use_local_subchannel_pool", 1)]  # otherwise channels to one target share a connection

    async def run():
        return await asyncio.gather(*(closed_loop(address, payloads(), c, duration_s=duration_s, warmup=min(2 * c, 64),
                                                  timeout_s=30, channel_options=separate) for c in share if c))

    parts = [r.summary() | {"wall": r.wall_s} for r in asyncio.run(run())]
    return {"done": sum(p["completed"] - p["errors"] for p in parts), "errors": sum(p["errors"] for p in parts),
            "wall": max(p["wall"] for p in parts), "p99": max(p["p99_ms"] for p in parts)}


def drive(pool: ProcessPoolExecutor, address: str, concurrency: int, clients: int, duration_s: float) -> dict:
    share = [concurrency // clients + (i < concurrency % clients) for i in range(clients)]
    parts = list(pool.map(_client, [address] * clients, share, [duration_s] * clients))
    return {"rps": sum(p["done"] / p["wall"] for p in parts), "p99": max(p["p99"] for p in parts),
            "errors": sum(p["errors"] for p in parts)}


def sweep(repo: Path, systems: dict[str, tuple], args) -> dict[str, list[dict]]:
    """`systems`: name -> (front-end processes, another checkout or None[, event loop])."""
    servers = {name: start("ferry", repo, *system) for name, system in systems.items()}
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    try:
        with ProcessPoolExecutor(args.clients) as pool:
            for r in range(args.rounds):
                order = list(systems)[r % len(systems):] + list(systems)[:r % len(systems)]
                for name in order:
                    proc, address = servers[name]
                    cpu0, t0 = loop_cpu_s(proc.pid), time.perf_counter()
                    point = drive(pool, address, args.concurrency, args.clients, args.duration)
                    point["engine busy"] = (loop_cpu_s(proc.pid) - cpu0) / (time.perf_counter() - t0)
                    runs[name].append(point)
                    print(f"frontends: round {r + 1} {name}: {point['rps']:.0f} req/s, p99 {point['p99']:.1f} ms, "
                          f"engine loop busy {point['engine busy']:.0%}", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    return runs


def render(saturation_rows: list[dict], runs: dict[str, list[dict]], args) -> str:
    out = ["Loop saturation (open loop, Poisson arrivals; loop = the server's main thread):", "",
           common.table(saturation_rows, ["server", "offered", "answered/s", "loop busy", "loop µs/request",
                                          "loop saturates at", "p99 ms"]), ""]
    first = next(iter(runs))
    base = [p["rps"] for p in runs[first]]
    rows = []
    for name, points in runs.items():
        rps = [p["rps"] for p in points]
        ratios = [a / b for a, b in zip(rps, base)]
        rows.append({"server": name, "req/s (median)": round(statistics.median(rps)),
                     f"vs {first} (median of rounds)": f"{statistics.median(ratios):.3f}",
                     "p99 ms": round(statistics.median(p["p99"] for p in points), 1),
                     "engine loop busy": f"{statistics.median(p['engine busy'] for p in points):.0%}",
                     "engine loop µs/request": round(statistics.median(p["engine busy"] / p["rps"] * 1e6 for p in points), 1),
                     "errors": sum(p["errors"] for p in points), "runs": " ".join(str(round(x)) for x in rps)})
    out += [f"--frontend-processes sweep: closed loop, concurrency {args.concurrency} over {args.clients} client "
            f"processes, {args.rounds} interleaved rounds of {args.duration:g} s:", "",
            common.table(rows, ["server", "req/s (median)", f"vs {first} (median of rounds)", "p99 ms",
                                "engine loop busy", "engine loop µs/request", "errors", "runs"])]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", default="1,2", help="values of --frontend-processes to sweep (1 first: the reference)")
    p.add_argument("--rates", default="250,500,1000,2000,4000,8000", help="offered requests/s for the saturation part")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--clients", type=int, default=2, help="load-generator processes (connections) for the sweep")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another Ferry checkout whose one-process server joins the sweep")
    p.add_argument("--asyncio", action="store_true",
                   help="also run one process on asyncio's own loop (--event-loop asyncio): what uvloop buys")
    p.add_argument("--skip-saturation", action="store_true")
    p.add_argument("--record", action="store_true", help="append the tables to bench/RESULTS.md")
    args = p.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    systems = {f"N={n}": (int(n), None) for n in args.processes.split(",")}
    if args.baseline is not None:
        systems = {"baseline N=1": (1, args.baseline.resolve()), **systems}
    if args.asyncio:
        systems["N=1 asyncio"] = (1, None, "asyncio")
    with tempfile.TemporaryDirectory() as tmp:
        repo = build(Path(tmp))
        rows = [] if args.skip_saturation else [r for kind in ("floor", "ferry") for r in saturation(kind, repo, rates, args.duration)]
        runs = sweep(repo, systems, args)
    report = render(rows, runs, args)
    print(report)
    if args.record:
        common.append_results("Front-end processes (bench/frontends.py)", report)


if __name__ == "__main__":
    main()
