"""Server CPU per request on the light model (or a Python model): Ferry against the bare grpc.aio handler, same run.

    python -m bench.hotpath [--requests 6000] [--rounds 5] [--concurrency 64] [--window-us 1000]
                            [--max-batch 128] [--baseline COMMIT] [--hop] [--hop-model] [--adaptive-ms 50] [--python]
                            [--profile 20] [--profile-out FILE]
                            [--no-record]

On an overhead-bound model Ferry's throughput is set by the CPU its event loop spends per request, so
that is what this measures, and not requests/s: CPU seconds per served request do not move when other
work shares the machine, where a throughput figure does. Both servers stay up for the whole run; each
round drives a fixed number of batch-1 requests (clients/loadgen.py closed loop, the same bytes to
both) at the given concurrency and reads, before and after, the server's CPU time: the whole process
(/proc/<pid>/stat, every thread: gRPC's, the instance's, ONNX Runtime's) and its main thread, the
event loop (/proc/<pid>/task/<pid>/schedstat, ns). The floor is bench/floor_server.py: decode the
input into a view, answer a fixed output, nothing else. Rounds alternate which server goes first;
reported: medians over rounds, and Ferry/floor taken round by round.

What Ferry does per batch (one wake-up, one executor hop, the model itself) is shared by the batch's
requests, so the figure depends on the batch sizes formed; the mean executed batch of each round
(ModelStatistics, inference_count / execution_count) is printed beside it.

`--baseline COMMIT`: a third server, Ferry as of that commit (exported with `git archive`), in the same
rounds: a before/after of a change. Because the batch sizes formed move with the speed of each server,
`--concurrency 8 --max-batch 8 --window-us 100000` (every batch exactly 8, cut by its eighth arrival)
compares the code's cost per request and per batch without that feedback.

`--hop`: a third server, the floor behind a batching hop (bench/floor_server.py --batched: a future per
request, a worker thread, one hand-back per batch): how much of Ferry's cost above the floor any batching
server pays, and how much is Ferry's own code.

`--hop-model`: a further server, that hop with the light MLP run on each batch's rows in its thread
(bench/floor_server.py --model): the smallest batching server doing Ferry's work. The floor answers without
running the model; on a 2-core machine the model's CPU is taken from the event loop and the load generator
both, so this, not the floor, is what Ferry's requests/s can reach with nothing of its own.

`--adaptive-ms T`: a third server, Ferry behind the adaptive window (latency target T ms) instead of the
fixed one, in the same rounds (and, with --profile, profiled too): what the adaptive window costs. With
--baseline, the baseline commit serves the adaptive window too.

`--python`: NVIDIA's add_sub (a Triton-API Python model, max_batch_size 0, one instance, run in a model
process of its own) instead of the light MLP: what a Python model's request costs the loop, the model
process's round trip included (its CPU is counted in "whole process").

`--profile N`: afterwards, serve Ferry under cProfile (main thread: the event loop), drive the same
load once, and print the N functions with the most own time, per request.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench import common, models, peers
from clients import loadgen

FERRY, FLOOR, BASELINE, HOP, ADAPTIVE = "Ferry", "floor", "Ferry baseline", "floor + batching hop", "Ferry adaptive"
MODEL_HOP = "floor + batching hop + model"
ADAPTIVE_BASELINE = "Ferry adaptive baseline"
FERRIES = (FERRY, BASELINE, ADAPTIVE, ADAPTIVE_BASELINE)
MODEL = "light"


def build(root: Path, window_us: int, max_batch: int, target_ms: int = 0, python: bool = False) -> Path:
    """The light MLP (bench/models.py) behind a fixed batching window (or, with `target_ms`, the adaptive
    window holding that latency target), one instance, as bench/peers.py serves it; with `python`,
    NVIDIA's add_sub as a Triton-API Python model instead."""
    repo = root / ("repo" if not target_ms else "repo-adaptive")
    if python:
        from bench import python_backend

        python_backend.write(repo, MODEL, python_backend.ADD_TRITON, python_backend.ADD_CONFIG)
        return repo
    models.light_mlp(repo / MODEL / "1" / "model.onnx")
    window = f"latency_target_ms: {target_ms}" if target_ms else f"max_queue_delay_microseconds: {window_us}"
    (repo / MODEL / "config.yaml").write_text(
        f"max_batch_size: {max_batch}\ninstance_group: [{{count: 1, kind: KIND_CPU}}]\n"
        f"dynamic_batching: {{{window}}}\n")
    return repo


def payloads(count: int = 16, python: bool = False) -> list[bytes]:
    rng = np.random.default_rng(0)
    if python:
        return [common.infer_payload(MODEL, {"INPUT0": rng.standard_normal(4).astype(np.float32),
                                             "INPUT1": rng.standard_normal(4).astype(np.float32)}) for _ in range(count)]
    return [common.infer_payload(MODEL, {"x": rng.standard_normal((1, 256)).astype(np.float32)}) for _ in range(count)]


def cpu_ns(pid: int) -> tuple[int, int]:
    """(whole process and the processes it started, main thread) CPU time so far, in ns. Children count:
    a Python model's process works for the server's requests."""
    ticks = sum(_ticks(p) for p in [pid, *_children(pid)])
    process = ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    main = int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])
    return process, main


def _ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone since it was listed
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def counts(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        return common.model_counts(channel, MODEL)


def drive(address: str, load: list[bytes], concurrency: int, requests: int) -> float:
    """Requests/s of the run (its own figure: it moves with whatever else the machine runs)."""
    result = asyncio.run(loadgen.closed_loop(address, load, concurrency, requests=requests, timeout_s=60))
    if result.errors:
        raise RuntimeError(f"requests failed: {result.errors}")
    return result.throughput


def run_once(pid: int, address: str, load: list[bytes], concurrency: int, requests: int, batches: bool) -> dict:
    before_counts = counts(address) if batches else (0, 0)
    process0, main0 = cpu_ns(pid)
    rps = drive(address, load, concurrency, requests)
    process1, main1 = cpu_ns(pid)
    row = {"process_us": (process1 - process0) / requests / 1000, "loop_us": (main1 - main0) / requests / 1000, "rps": rps}
    if batches:
        after = counts(address)
        row["batch"] = (after[0] - before_counts[0]) / max(1, after[1] - before_counts[1])
    return row


def median(values: list[float]) -> float:
    return float(np.median(values))


def measure(servers: dict, load: list[bytes], args: argparse.Namespace) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            proc, address = servers[name]
            runs[name].append(run_once(proc.pid, address, load, args.concurrency, args.requests,
                                       name in FERRIES or name == MODEL_HOP))
        print(f"hotpath: round {r + 1}: " + "  ".join(
            f"{n}: loop {runs[n][-1]['loop_us']:.0f} us, process {runs[n][-1]['process_us']:.0f} us" for n in names), flush=True)
    return runs


def render(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    model = ("NVIDIA's add_sub as a Triton-API Python model (max_batch_size 0, one model process; whole process "
             "includes it)" if args.python else
             f"Light MLP (bench/models.py); Ferry: fixed {args.window_us / 1000:g} ms window"
             + (f" (Ferry adaptive: latency target {args.adaptive_ms} ms)" if args.adaptive_ms else "")
             + f", max batch {args.max_batch}")
    lines = [f"{model}, batch-1 requests, closed loop at concurrency {args.concurrency}, "
             f"{args.requests} requests per run, {args.rounds} interleaved rounds, 1 instance. Server CPU per "
             "served request (median over rounds, min-max):", "",
             "| server | event loop (main thread) us/request | whole process us/request | mean batch | req/s |",
             "|---|---|---|---|---|"]
    for name, found in runs.items():
        cells = [_spread([x[k] for x in found]) for k in ("loop_us", "process_us")]
        batch = f"{median([x['batch'] for x in found]):.1f}" if "batch" in found[0] else ""
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {batch} | {median([x['rps'] for x in found]):.0f} |")
    lines.append("")
    pairs = [(FERRY, FLOOR)] + ([(BASELINE, FLOOR), (FERRY, BASELINE)] if BASELINE in runs else []) + (
        [(HOP, FLOOR), (FERRY, HOP)] if HOP in runs else []) + (
        [(MODEL_HOP, FLOOR), (FERRY, MODEL_HOP)] + ([(ADAPTIVE, MODEL_HOP)] if ADAPTIVE in runs else [])
        if MODEL_HOP in runs else []) + (
        [(ADAPTIVE, FLOOR), (ADAPTIVE, FERRY)] if ADAPTIVE in runs else []) + (
        [(ADAPTIVE, ADAPTIVE_BASELINE)] if ADAPTIVE_BASELINE in runs else [])
    for top, bottom in pairs:
        for key, label in (("loop_us", "event loop CPU per request"), ("process_us", "whole process CPU per request"),
                           ("rps", "requests/s")):
            ratios = [a[key] / b[key] for a, b in zip(runs[top], runs[bottom]) if b[key] > 0]
            lines.append(f"- {top} / {bottom}, {label}, round by round: {_spread(ratios, 2)}")
    return "\n".join(lines)


def _spread(values: list[float], digits: int = 0) -> str:
    return f"{median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def profile(repo: Path, load: list[bytes], args: argparse.Namespace, out: Path) -> str:
    """Ferry's event loop under cProfile for one run (startup and warm-up left out); the functions with
    the most own time, per request."""
    stats_file = out / "ferry.prof"
    cmd = [sys.executable, "-m", "bench.hotpath", "serve-profiled", str(stats_file), *common.ferry_command(repo)[4:],
           "--drain-grace-seconds", "5"]
    proc, address = common.start_server(cmd)
    try:
        drive(address, load, args.concurrency, 2000)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        drive(address, load, args.concurrency, args.requests)
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    if args.profile_out is not None:  # for pstats by hand: callers, callees
        args.profile_out.write_bytes(stats_file.read_bytes())
    stats = pstats.Stats(str(stats_file))
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:args.profile]
    lines = [f"cProfile of Ferry's event loop, {args.requests} requests (own time per request, us; with callees; "
             "calls per request):"]
    for (filename, line, func), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(filename).parent.name}/{Path(filename).name}:{line}" if line else filename
        lines.append(f"  {own / args.requests * 1e6:7.1f}  {cumulative / args.requests * 1e6:7.1f} cum  "
                     f"{calls / args.requests:6.2f}x  {func}  ({where})")
    return "\n".join(lines)


def serve_profiled(stats_file: str, argv: list[str]) -> None:
    """`ferry serve` whose main thread is profiled between SIGUSR1 and SIGUSR2; the stats are written then."""
    from server.__main__ import main as ferry_main

    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda *_: (profiler.disable(), profiler.dump_stats(stats_file)))
    ferry_main(["serve", *argv])


def start_baseline(commit: str, repo: Path, tmp: Path, name: str = "baseline"):
    """Ferry as it was at `commit` (exported from this repository's git), serving the same model."""
    tree = tmp / name
    tree.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=common.ROOT, capture_output=True, check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(common.ferry_command(repo), cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    return proc, peers.wait_for_lines(proc, [r"ferry: serving gRPC on (\S+)", r"ferry: ready"], 120)[0].group(1)


def measure_all(repo: Path, load: list[bytes], args: argparse.Namespace, tmp: Path) -> str:
    servers = {}
    try:
        servers[FERRY] = common.start_server(common.ferry_command(repo))
        if args.adaptive_ms:
            adaptive = build(Path(tmp), args.window_us, args.max_batch, args.adaptive_ms)
            servers[ADAPTIVE] = common.start_server(common.ferry_command(adaptive))
        servers[FLOOR] = common.start_server([sys.executable, "-m", "bench.floor_server", "0"])
        if args.hop:
            servers[HOP] = common.start_server([sys.executable, "-m", "bench.floor_server", "0", "--batched"])
        if args.hop_model:
            servers[MODEL_HOP] = common.start_server([sys.executable, "-m", "bench.floor_server", "0", "--batched",
                                                      "--model", str(repo / MODEL / "1" / "model.onnx")])
        if args.baseline:
            servers[BASELINE] = start_baseline(args.baseline, repo, Path(tmp), "baseline")
            if args.adaptive_ms:
                servers[ADAPTIVE_BASELINE] = start_baseline(args.baseline, adaptive, Path(tmp), "baseline-adaptive")
        for _, address in servers.values():  # warm both: first calls, ONNX Runtime's first runs
            drive(address, load, args.concurrency, 2000)
        t0 = time.monotonic()
        runs = measure(servers, load, args)
        wall = time.monotonic() - t0
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    report = render(runs, args) + f"\n- whole run {wall:.0f} s"
    print(report, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000, help="requests per measured run")
    parser.add_argument("--rounds", type=int, default=5, help="0: no measurement (with --profile: only the profile)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window-us", type=int, default=1000, help="Ferry's fixed batching window")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--baseline", metavar="COMMIT",
                        help="also serve Ferry as of this git commit (e.g. main) in the same rounds: before/after")
    parser.add_argument("--hop", action="store_true",
                        help="also run the floor behind a batching hop (bench/floor_server.py --batched)")
    parser.add_argument("--hop-model", action="store_true",
                        help="also run that hop with the model run on each batch (bench/floor_server.py --model)")
    parser.add_argument("--adaptive-ms", type=int, default=0, metavar="TARGET",
                        help="also serve Ferry behind the adaptive window with this latency target (and profile it too)")
    parser.add_argument("--python", action="store_true", help="NVIDIA's add_sub as a Triton-API Python model instead of "
                        "the light MLP (not with --adaptive-ms)")
    parser.add_argument("--profile", type=int, default=0, help="then profile Ferry's loop and print this many functions")
    parser.add_argument("--profile-out", type=Path, help="with --profile: also keep the cProfile stats in this file")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    if args.python and args.hop_model:
        parser.error("--hop-model runs the light MLP: not with --python")
    if args.python and args.adaptive_ms:
        parser.error("--python serves add_sub as NVIDIA ships it (no batching): no adaptive window to compare")
    load = payloads(python=args.python)
    with tempfile.TemporaryDirectory() as tmp:
        repo = build(Path(tmp), args.window_us, args.max_batch, python=args.python)
        report = measure_all(repo, load, args, Path(tmp)) if args.rounds else ""
        if args.profile:
            print(f"{FERRY}: " + profile(repo, load, args, Path(tmp)), flush=True)
            if args.adaptive_ms:
                adaptive = build(Path(tmp), args.window_us, args.max_batch, args.adaptive_ms)
                print(f"{ADAPTIVE}: " + profile(adaptive, load, args, Path(tmp)), flush=True)
    if report and not args.no_record:
        common.append_results("Server CPU per request (bench/hotpath.py)", report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-profiled"]:
        serve_profiled(sys.argv[2], sys.argv[3:])
    else:
        main()
