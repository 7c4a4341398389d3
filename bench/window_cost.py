"""What the batching policy costs the event loop per request, without gRPC: the scheduler driven as the runner drives it.

    python -m bench.window_cost [--rows 32] [--batches 300] [--baseline COMMIT] [--no-record]

A light model's window at 64 clients fills with one arrival per loop pass; this replays that on a clock
the benchmark owns, against the real DynamicBatcher (fixed 8 ms window, and the adaptive window with the
front-end loop reported idle and busy): `rows` arrivals 0.3 ms apart per batch, each followed by what
server/runners/batch.py does for it: a turn (expire, next_batch, gauges, next_event_ns, the timer set
again when the next event moved) when `submit` says the arrival matters (before that answer existed:
every arrival while an instance is free), else only the pending gauge. The batch is cut at its last
arrival at the latest. Timers are real asyncio TimerHandles, never run: the timer's own turns are not
counted (the runner's timer fires at most once per decided close or silence look).
Single-threaded and short, so the figures move far less on a busy machine than a server's do; they
are the scheduler's share only (bench/hotpath.py measures the whole server).
`--baseline COMMIT`: the same replay against the scheduler of that commit (`git archive`), same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from bench import common

POLICIES = (("fixed 8ms", False, None), ("adaptive, loop idle", True, 0.5), ("adaptive, loop busy", True, 0.95))
GAP_NS = 300_000


def replay(adaptive: bool, busy: float | None, rows: int, batches: int) -> dict:
    import numpy as np

    from server.request import InferRequest
    from server.scheduling.dynamic import BatchingSettings, DynamicBatcher
    from server.scheduling.queue import QueuePolicy, RequestQueue

    loop = asyncio.new_event_loop()
    settings = BatchingSettings(128, max_queue_delay_ns=0 if adaptive else 8_000_000,
                                latency_target_ns=50_000_000 if adaptive else 0)
    batcher = DynamicBatcher(settings, RequestQueue([QueuePolicy()]))
    x = {"x": np.zeros((1, 256), np.float32)}
    key = (("x", (256,)),)

    def request():
        return InferRequest("m", x, 1, key, deadline_ns=10**15)  # clients/loadgen.py sends a deadline

    now = 0
    batcher.observe_frontend(busy)
    for size in (1, 2, 4, 8, 16, 32, 64, 128):  # known execution times, as after warm-up
        batcher.window.on_batch(size, 60_000 + 26_000 * size)
    for _ in range(rows):  # the closed loop's clients seen once: the apparent concurrency is `rows`
        now += 1_000
        batcher.submit(request(), now)
    batcher.complete(batcher.next_batch(10**15), 60_000 + 26_000 * rows, now)
    queued = [request() for _ in range(rows * batches)]
    timer = timer_ns = None
    turns = resets = cuts = 0
    start = time.perf_counter()
    for k, req in enumerate(queued):
        now += GAP_NS
        matters = batcher.submit(req, now)
        last = k % rows == rows - 1
        if matters is False and not last:
            len(batcher)  # the runner's pending gauge
            continue
        turns += 1
        batcher.expire(now)
        batcher.observe_frontend(busy)
        batch = batcher.next_batch(10**15 if last else now)
        batcher.gauges()
        wake = batcher.next_event_ns(now)
        if wake != timer_ns:
            if timer is not None:
                timer.cancel()
            timer = None if wake is None else loop.call_later((wake - now) / 1e9, lambda: None)
            timer_ns, resets = wake, resets + 1
        if batch is not None:
            cuts += 1
            batcher.complete(batch, 60_000 + 26_000 * batch.size, now)
    elapsed = time.perf_counter() - start
    loop.close()
    n = rows * batches
    return {"us": elapsed / n * 1e6, "turns": turns / n, "resets": resets / n, "cuts": cuts / batches}


def measure(rows: int, batches: int, repeat: int = 5) -> dict[str, dict]:
    """The fastest of `repeat` replays per policy (the least disturbed by the rest of the machine)."""
    return {label: min((replay(adaptive, busy, rows, batches) for _ in range(repeat)), key=lambda r: r["us"])
            for label, adaptive, busy in POLICIES}


def measure_in(tree: str, rows: int, batches: int) -> dict[str, dict]:
    code = f"import json; from bench.window_cost import measure; print(json.dumps(measure({rows}, {batches})))"
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{common.ROOT}"}  # the tree's server/, this bench
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="arrivals per batch")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--baseline", metavar="COMMIT", help="also replay against the scheduler of this commit")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    runs = {"this tree": measure_in(str(common.ROOT), args.rows, args.batches)}
    if args.baseline:
        with tempfile.TemporaryDirectory() as tree:
            archive = subprocess.run(["git", "archive", args.baseline, "server"], cwd=common.ROOT, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            runs[args.baseline] = measure_in(tree, args.rows, args.batches)
    lines = [f"Scheduler work per request as the runner drives it ({args.rows} arrivals {GAP_NS / 1e6:g} ms apart per batch, "
             f"{args.batches} batches, fastest of 5):", "",
             "| code | policy | us/request | runner turns/request | timer resets/request | cuts/batch |", "|---|---|---|---|---|---|"]
    for code, found in runs.items():
        for label, r in found.items():
            lines.append(f"| {code} | {label} | {r['us']:.2f} | {r['turns']:.2f} | {r['resets']:.2f} | {r['cuts']:.2f} |")
    report = "\n".join(lines)
    print(report)
    if not args.no_record:
        common.append_results("Batching policy cost per request (bench/window_cost.py)", report)


if __name__ == "__main__":
    main()
