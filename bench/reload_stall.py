"""What reloading one model costs the others: a busy model's latency while another is unloaded and loaded
again and again, beside the same server left alone.

    python -m bench.reload_stall [--before DIR] [--rounds 3] [--duration 4] [--no-record]

The busy model is the light MLP (8 closed-loop clients); beside it, a 4 MiB ONNX model (bench/many_models.py's)
is unloaded and loaded every 200 ms through the model-control API (explicit mode). Rows: this checkout
and, with --before, another one (e.g. main before a change, a `git worktree`), quiet and reloading, in
interleaved rounds. An unload that walks the whole heap on the event loop stalls every request in flight
for as long as the walk takes; its mark is the reloading p99 against the quiet one.

Appended to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path

from bench import many_models, models
from bench.common import ROOT, append_results, ferry_command, load_note, start_server, table
from clients import loadgen, perf
from clients.client import InferenceClient

RELOAD_EVERY_S = 0.2


def serve(checkout: Path, repo: Path) -> tuple[subprocess.Popen, str]:
    return start_server(ferry_command(repo, "--model-control-mode", "explicit", "--load-model", "*"), cwd=checkout)


def measure(address: str, payloads: list[bytes], reloading: bool, duration_s: float) -> dict:
    stop, reloads = threading.Event(), [0]

    def reload() -> None:
        client = InferenceClient(address)
        while not stop.is_set():
            client.unload_model("m00")
            client.load_model("m00")
            reloads[0] += 1
            stop.wait(RELOAD_EVERY_S)
        client.close()

    thread = threading.Thread(target=reload) if reloading else None
    if thread:
        thread.start()
    try:
        s = asyncio.run(loadgen.closed_loop(address, payloads, 8, duration_s=duration_s, warmup=16)).summary()
    finally:
        stop.set()
        if thread:
            thread.join()
    return {"rps": s["throughput_rps"], "p50": s["p50_ms"], "p99": s["p99_ms"], "reloads": reloads[0], "errors": s["errors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout to serve beside this one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        many_models.repository(repo, 1)
        models.light_mlp(repo / "light" / "1" / "model.onnx")
        checkouts = {"this checkout": ROOT, **({"before": args.before.resolve()} if args.before else {})}
        servers = {label: serve(path, repo) for label, path in checkouts.items()}
        try:
            payloads = perf.infer_workload(InferenceClient(next(iter(servers.values()))[1]), "light").payloads
            runs = {(label, phase): [] for label in servers for phase in ("quiet", "reloading")}
            for _ in range(args.rounds):
                for label, (_, address) in servers.items():
                    for phase in ("quiet", "reloading"):
                        runs[(label, phase)].append(measure(address, payloads, phase == "reloading", args.duration))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    rows = [{"server": label, "phase": phase, "req/s": round(statistics.median(r["rps"] for r in rs)),
             "p50 ms": round(statistics.median(r["p50"] for r in rs), 2),
             "p99 ms": round(statistics.median(r["p99"] for r in rs), 2),
             "p99 per round": "/".join(f"{r['p99']:.1f}" for r in rs),
             "reloads": sum(r["reloads"] for r in rs), "errors": sum(r["errors"] for r in rs)}
            for (label, phase), rs in runs.items()]
    ratios = []
    for label in servers:
        quiet, busy = runs[(label, "quiet")], runs[(label, "reloading")]
        per_round = [b["p99"] / q["p99"] for q, b in zip(quiet, busy) if q["p99"]]
        ratios.append(f"- {label}: reloading / quiet p99, median of rounds {statistics.median(per_round):.2f} "
                      f"[{min(per_round):.2f}-{max(per_round):.2f}]")
    body = (f"The light MLP at 8 closed-loop clients; beside it a 4 MiB ONNX model unloaded and loaded again every "
            f"{RELOAD_EVERY_S * 1000:.0f} ms (explicit mode), {args.duration:g} s a phase, {args.rounds} interleaved rounds.\n\n"
            + table(rows, list(rows[0])) + "\n\n" + "\n".join(ratios)
            + load_note(load_before, "Servers and phases ran in interleaved rounds."))
    print(body)
    if not args.no_record:
        append_results("A busy model while another is reloaded (bench/reload_stall.py)", body)


if __name__ == "__main__":
    main()
