"""One measurement of the config being served: warm it, run the load, read what the server counted.

The load is Ferry's own generator (clients/loadgen.py): closed-loop clients, Poisson arrivals, or a
recorded trace replayed at its offsets. The server's statistics, read around the measured run (never
around the warm-up), give the rows and executions it served, so the mean batch is the server's own
figure; the CPU is the server process's (when ferry tune started it) and the load generator's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from clients import loadgen, perf
from clients.tune.target import Target
from clients.tune.workload import Trace


@dataclass(frozen=True)
class Load:
    """What each measurement sends: `workload`'s requests from `concurrency` clients or at `rate` requests/s
    for `requests` requests or `duration_s` seconds, or a `trace` replayed as recorded."""

    workload: perf.Workload
    concurrency: int | None = None
    rate: float | None = None
    trace: Trace | None = None
    requests: int | None = None
    duration_s: float | None = 3.0
    warmup: int = 8
    timeout_s: float = 60.0
    largest: int = 1  # the most rows one request carries


    @property
    def clients(self) -> int:
        """How many requests may be in flight, which bounds the batch sizes worth trying."""
        if self.concurrency:
            return self.concurrency
        if self.trace is not None and len(self.trace.offsets_s) > 1:
            span = self.trace.offsets_s[-1] or 1e-3
            return max(1, round(len(self.trace.offsets_s) / span * 0.05))  # about 50 ms of arrivals
        return max(1, round((self.rate or 1) * 0.05))

    def describe(self) -> str:
        if self.trace is not None:
            return f"trace of {len(self.trace.offsets_s)} requests"
        return f"{self.concurrency} clients" if self.concurrency else f"{self.rate:g} requests/s"


def _counts(target: Target, model: str) -> tuple[int, int, int]:
    stats = target.client.model_statistics(model)
    return (sum(s.inference_stats.success.count for s in stats), sum(s.inference_count for s in stats),
            sum(s.execution_count for s in stats))


def measure(target: Target, load: Load) -> dict:
    """Run the load once against what is served now; a row of figures (times in ms)."""
    workload = load.workload
    method = loadgen.GENERATE if workload.streaming else loadgen.MODEL_INFER
    common = {"timeout_s": load.timeout_s, "method_path": method, "streaming": workload.streaming}
    if load.warmup:
        asyncio.run(loadgen.closed_loop(target.url, workload.payloads, min(load.clients, load.warmup), load.warmup,
                                        **common))
    before, cpu0, t0 = _counts(target, workload.model), target.cpu_seconds(), time.perf_counter()
    if load.trace is not None:
        result = asyncio.run(loadgen.replay(target.url, workload.payloads, load.trace.offsets_s, **common))
    elif load.rate:
        result = asyncio.run(loadgen.open_loop(target.url, workload.payloads, load.rate, load.requests,
                                               duration_s=load.duration_s if load.requests is None else None, **common))
    else:
        result = asyncio.run(loadgen.closed_loop(target.url, workload.payloads, load.concurrency, load.requests,
                                                 load.duration_s if load.requests is None else None, **common))
    wall = time.perf_counter() - t0
    after, cpu1 = _counts(target, workload.model), target.cpu_seconds()
    row = perf.row(result)
    executions = after[2] - before[2]
    row.update({"served": after[0] - before[0], "rows": after[1] - before[1], "executions": executions,
                "mean_batch": round((after[1] - before[1]) / executions, 2) if executions else None,
                "server_cpu": round((cpu1 - cpu0) / wall, 2) if cpu0 is not None and cpu1 is not None else None})
    return row
