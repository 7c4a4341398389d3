"""Load generation against any KServe v2 gRPC server: closed-loop concurrency and open-loop Poisson arrivals.

Requests are serialized once and sent as raw bytes through a generic stub, so the client spends its
CPU on the network, not on protobuf; on a small machine the client shares cores with the server and
every cycle it saves is one the server can use. Latency is measured per call on one monotonic clock.
With `streaming=True` the calls are Ferry's server-streaming Generate, timed token by token.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from protos import generate_pb2 as gen_pb

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
GENERATE = "/ferry.generate.v1.Generation/Generate"
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_PROGRESS_EVERY_S = 0.25


@dataclass
class RunResult:
    """What one load run measured. Latencies in seconds; error texts counted by message.

    Streaming runs also fill the token timings: time to first token and time per output token (one
    value per successful request), inter-token latency (one value per gap between token messages)."""

    latencies_s: np.ndarray
    errors: dict[str, int]
    wall_s: float
    client_cpu_s: float
    concurrency: int = 0
    request_rate: float | None = None
    extra: dict = field(default_factory=dict)
    sent: int = 0
    ttft_s: np.ndarray | None = None
    tpot_s: np.ndarray | None = None
    itl_s: np.ndarray | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    @property
    def streaming(self) -> bool:
        return self.ttft_s is not None

    @property
    def throughput(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def percentile_ms(self, q: float, values: np.ndarray | None = None) -> float:
        values = self.latencies_s if values is None else values
        return float(np.percentile(values, q) * 1000) if len(values) else float("nan")

    def summary(self) -> dict:
        row = {
            "concurrency": self.concurrency, "request_rate": self.request_rate, "completed": self.completed,
            "errors": sum(self.errors.values()), "throughput_rps": round(self.throughput, 1),
            **{f"p{q}_ms": round(self.percentile_ms(q), 3) for q in (50, 90, 95, 99)},
            "client_cpu_share": round(self.client_cpu_s / self.wall_s, 3) if self.wall_s else 0.0, **self.extra,
        }
        if self.streaming:
            row["output_tokens_per_s"] = round(self.output_tokens / self.wall_s, 1) if self.wall_s else 0.0
            for name, values in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("itl", self.itl_s)):
                row[f"{name}_p50_ms"] = round(self.percentile_ms(50, values), 3)
        return row


@dataclass
class _Tally:
    """Written by the callers while a run is in flight."""

    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    def error(self, exc: grpc.aio.AioRpcError) -> None:
        key = f"{exc.code().name}: {exc.details()}"
        self.errors[key] = self.errors.get(key, 0) + 1

    def result(self, wall_s: float, cpu_s: float, sent: int, streaming: bool, **kwargs) -> RunResult:
        timings = {}
        if streaming:
            timings = {"ttft_s": np.array(self.ttft), "tpot_s": np.array(self.tpot), "itl_s": np.array(self.itl),
                       "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
                       "finish_reasons": self.finish_reasons}
        return RunResult(np.array(self.latencies), self.errors, wall_s, cpu_s, sent=sent, **kwargs, **timings)


async def _call(method, payload: bytes, timeout_s: float, tally: _Tally) -> None:
    start = time.perf_counter()
    try:
        await method(payload, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        tally.error(exc)
        return
    tally.latencies.append(time.perf_counter() - start)


async def _stream(method, payload: bytes, timeout_s: float, tally: _Tally) -> None:
    start = time.perf_counter()
    token_times: list[float] = []
    tokens, last = 0, None
    try:
        async for response in method(payload, timeout=timeout_s):
            if response.token_ids:
                token_times.append(time.perf_counter())
                tokens += len(response.token_ids)
            last = response
    except grpc.aio.AioRpcError as exc:
        tally.error(exc)
        return
    end = time.perf_counter()
    tally.latencies.append(end - start)
    if last is not None and last.HasField("usage"):
        tokens = last.usage.completion_tokens
        tally.prompt_tokens += last.usage.prompt_tokens
    reason = last.finish_reason if last is not None else ""
    tally.finish_reasons[reason] = tally.finish_reasons.get(reason, 0) + 1
    tally.output_tokens += tokens
    if token_times:
        tally.ttft.append(token_times[0] - start)
        tally.itl.extend(np.diff(token_times).tolist())
        if tokens > 1:
            tally.tpot.append((token_times[-1] - token_times[0]) / (tokens - 1))


def _sender(channel, method_path: str, streaming: bool, timeout_s: float, tally: _Tally):
    if streaming:
        method = channel.unary_stream(method_path, response_deserializer=gen_pb.GenerateResponse.FromString)
        return lambda payload: _stream(method, payload, timeout_s, tally)
    method = channel.unary_unary(method_path)
    return lambda payload: _call(method, payload, timeout_s, tally)


def _channel(address: str, credentials: grpc.ChannelCredentials | None, options: list):
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS + options)
    return grpc.aio.secure_channel(address, credentials, options=_CHANNEL_OPTIONS + options)


async def _warm(channel, method_path: str, streaming: bool, payloads: list[bytes], count: int,
                timeout_s: float) -> None:
    tally = _Tally()
    send = _sender(channel, method_path, streaming, timeout_s, tally)
    for i in range(count):
        await send(payloads[i % len(payloads)])
    if tally.errors:
        raise RuntimeError(f"warm-up requests failed: {tally.errors}")


_measuring = 0  # runs in flight in this process (a benchmark may overlap two)


@contextlib.contextmanager
def _still_heap():
    """Keep this process's long-lived objects out of collections while measuring: a full collection
    over everything numpy, grpc and the caller imported pauses every caller for tens of ms and would
    be charged to the server's latency. New garbage is still collected."""
    global _measuring
    if _measuring == 0:
        gc.collect()
        gc.freeze()
    _measuring += 1
    try:
        yield
    finally:
        _measuring -= 1
        if _measuring == 0:
            gc.unfreeze()


async def _report_progress(tally: _Tally, progress: Callable[[int], None]) -> None:
    while True:  # a ticker, so the callers' hot path never calls back
        await asyncio.sleep(_PROGRESS_EVERY_S)
        progress(tally.done)


async def closed_loop(address: str, payloads: list[bytes], concurrency: int, requests: int | None = None,
                      duration_s: float | None = None, warmup: int = 0, timeout_s: float = 60,
                      method_path: str = MODEL_INFER, *, streaming: bool = False,
                      credentials: grpc.ChannelCredentials | None = None, channel_options: list = (),
                      progress: Callable[[int], None] | None = None) -> RunResult:
    """`concurrency` callers, each sending its next request as soon as the previous one returns."""
    if requests is None and duration_s is None:
        raise ValueError("bound the run with requests or duration_s")
    async with _channel(address, credentials, list(channel_options)) as channel:
        await _warm(channel, method_path, streaming, payloads, warmup, timeout_s)
        tally = _Tally()
        send = _sender(channel, method_path, streaming, timeout_s, tally)
        sent = 0
        stop_at = None

        async def caller(offset: int) -> None:
            nonlocal sent
            while (requests is None or sent < requests) and (stop_at is None or time.perf_counter() < stop_at):
                sent += 1
                await send(payloads[(offset + sent) % len(payloads)])

        ticker = asyncio.ensure_future(_report_progress(tally, progress)) if progress else None
        with _still_heap():
            cpu0, t0 = time.process_time(), time.perf_counter()
            stop_at = t0 + duration_s if duration_s is not None else None
            await asyncio.gather(*(caller(i) for i in range(concurrency)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if ticker:
            ticker.cancel()
    return tally.result(wall, cpu, sent, streaming, concurrency=concurrency)


async def open_loop(address: str, payloads: list[bytes], rate: float, requests: int | None = None, seed: int = 0,
                    timeout_s: float = 60, method_path: str = MODEL_INFER, *, duration_s: float | None = None,
                    warmup: int = 0, streaming: bool = False, credentials: grpc.ChannelCredentials | None = None,
                    channel_options: list = (), progress: Callable[[int], None] | None = None) -> RunResult:
    """Poisson arrivals at `rate` requests/s, regardless of how fast answers come back; the run stops
    sending after `requests` arrivals or `duration_s` seconds, then waits for every answer."""
    if requests is None and duration_s is None:
        raise ValueError("bound the run with requests or duration_s")
    rng = np.random.default_rng(seed)
    async with _channel(address, credentials, list(channel_options)) as channel:
        await _warm(channel, method_path, streaming, payloads, warmup, timeout_s)
        tally = _Tally()
        send = _sender(channel, method_path, streaming, timeout_s, tally)
        tasks = []
        ticker = asyncio.ensure_future(_report_progress(tally, progress)) if progress else None
        with _still_heap():
            cpu0, t0 = time.process_time(), time.perf_counter()
            due = t0
            while requests is None or len(tasks) < requests:
                due += rng.exponential(1.0 / rate)
                if duration_s is not None and due > t0 + duration_s:
                    break
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(send(payloads[len(tasks) % len(payloads)])))
            await asyncio.gather(*tasks)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if ticker:
            ticker.cancel()
    return tally.result(wall, cpu, len(tasks), streaming, request_rate=rate)


async def replay(address: str, payloads: list[bytes], offsets_s: list[float], timeout_s: float = 60,
                 method_path: str = MODEL_INFER, *, warmup: int = 0, streaming: bool = False,
                 credentials: grpc.ChannelCredentials | None = None, channel_options: list = ()) -> RunResult:
    """Recorded arrivals: request i (`payloads[i]`) is sent `offsets_s[i]` seconds after the start, whatever
    the answers do, then every answer is awaited (`ferry tune --from-trace`)."""
    if len(payloads) != len(offsets_s):
        raise ValueError(f"{len(payloads)} payloads for {len(offsets_s)} arrival times")
    async with _channel(address, credentials, list(channel_options)) as channel:
        await _warm(channel, method_path, streaming, payloads, warmup, timeout_s)
        tally = _Tally()
        send = _sender(channel, method_path, streaming, timeout_s, tally)
        tasks = []
        with _still_heap():
            cpu0, t0 = time.process_time(), time.perf_counter()
            for payload, offset in zip(payloads, offsets_s):
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(send(payload)))
            await asyncio.gather(*tasks)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rate = len(payloads) / offsets_s[-1] if len(offsets_s) > 1 and offsets_s[-1] > 0 else None
    return tally.result(wall, cpu, len(tasks), streaming, request_rate=rate)
