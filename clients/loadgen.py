"""Load generation against any KServe v2 gRPC server: closed-loop concurrency and open-loop Poisson arrivals.

Requests are serialized once and sent as raw bytes through a generic stub, so the client spends its
CPU on the network, not on protobuf; on a small machine the client shares cores with the server and
every cycle it saves is one the server can use. Latency is measured per call on one monotonic clock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@dataclass
class RunResult:
    """What one load run measured. Latencies in seconds; error texts counted by message."""

    latencies_s: np.ndarray
    errors: dict[str, int]
    wall_s: float
    client_cpu_s: float
    concurrency: int = 0
    request_rate: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    @property
    def throughput(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1000) if self.completed else float("nan")

    def summary(self) -> dict:
        return {
            "concurrency": self.concurrency, "request_rate": self.request_rate, "completed": self.completed,
            "errors": sum(self.errors.values()), "throughput_rps": round(self.throughput, 1),
            **{f"p{q}_ms": round(self.percentile_ms(q), 3) for q in (50, 90, 95, 99)},
            "client_cpu_share": round(self.client_cpu_s / self.wall_s, 3) if self.wall_s else 0.0, **self.extra,
        }


async def _call(method, payload: bytes, timeout_s: float, latencies: list, errors: dict) -> None:
    start = time.perf_counter()
    try:
        await method(payload, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        key = f"{exc.code().name}: {exc.details()}"
        errors[key] = errors.get(key, 0) + 1
        return
    latencies.append(time.perf_counter() - start)


async def closed_loop(address: str, payloads: list[bytes], concurrency: int, requests: int | None = None,
                      duration_s: float | None = None, warmup: int = 0, timeout_s: float = 60,
                      method_path: str = MODEL_INFER) -> RunResult:
    """`concurrency` callers, each sending its next request as soon as the previous one returns."""
    if requests is None and duration_s is None:
        raise ValueError("bound the run with requests or duration_s")
    async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        method = channel.unary_unary(method_path)
        for i in range(warmup):
            await method(payloads[i % len(payloads)], timeout=timeout_s)
        latencies: list[float] = []
        errors: dict[str, int] = {}
        sent = 0
        stop_at = None

        async def caller(offset: int) -> None:
            nonlocal sent
            while (requests is None or sent < requests) and (stop_at is None or time.perf_counter() < stop_at):
                sent += 1
                await _call(method, payloads[(offset + sent) % len(payloads)], timeout_s, latencies, errors)

        cpu0, t0 = time.process_time(), time.perf_counter()
        stop_at = t0 + duration_s if duration_s is not None else None
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return RunResult(np.array(latencies), errors, wall, cpu, concurrency=concurrency)


async def open_loop(address: str, payloads: list[bytes], rate: float, requests: int, seed: int = 0,
                    timeout_s: float = 60, method_path: str = MODEL_INFER) -> RunResult:
    """Poisson arrivals at `rate` requests/s, regardless of how fast answers come back."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=requests)
    async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        method = channel.unary_unary(method_path)
        latencies: list[float] = []
        errors: dict[str, int] = {}
        tasks = []
        cpu0, t0 = time.process_time(), time.perf_counter()
        due = t0
        for i, gap in enumerate(gaps):
            due += gap
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_call(method, payloads[i % len(payloads)], timeout_s, latencies, errors)))
        await asyncio.gather(*tasks)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return RunResult(np.array(latencies), errors, wall, cpu, request_rate=rate)
