"""`ferry perf`: build a synthetic workload from what the server says about a model, run it at each
load level (closed-loop concurrency or open-loop Poisson rate) and turn each run into a report row.

Every request is built and serialized before the clock starts; the loops in loadgen.py only send bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from clients import balancing, loadgen, messages, tensors
from clients.client import InferenceClient
from clients.connection import TlsOptions
from clients.errors import FerryClientError
from clients.messages import ModelMetadata

DISTINCT_REQUESTS = 16  # cycled, so the server cannot answer from a single cached input
# About one token each for common BPE vocabularies; rows report the server's real prompt token counts.
WORDS = ("the a ferry leaves when it is full or time boat sea river harbour dock crew ticket morning evening "
         "light wind wave north south east west port island bridge water quick slow small large car bus "
         "train road city town people passenger captain engine deck rope anchor weather storm calm").split()


@dataclass(frozen=True)
class Workload:
    """Pre-serialized requests for one model, and what they contain (for the report)."""

    model: str
    kind: str  # "infer" or "generate"
    payloads: list[bytes]
    description: dict = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return self.kind == "generate"


def parse_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`NAME:D1,D2` (perf_analyzer's --shape): the shape without the batch dimension for batching models."""
    shapes = {}
    for spec in specs:
        name, sep, dims = spec.rpartition(":")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            sep = ""
        if not sep or not name or any(d < 0 for d in shapes.get(name, ())):
            raise ValueError(f"--shape {spec!r}: expected NAME:D1,D2,... with non-negative sizes")
    return shapes


def input_shapes(metadata: ModelMetadata, batching: bool, batch_size: int,
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The full shape of each input: the batch dimension, then the given or fixed dimensions."""
    unknown = set(shapes) - {spec.name for spec in metadata.inputs}
    if unknown:
        raise ValueError(f"--shape names {sorted(unknown)}, but {metadata.name}'s inputs are "
                         f"{[s.name for s in metadata.inputs]}")
    full = {}
    for spec in metadata.inputs:
        dims = spec.shape[1:] if batching else spec.shape
        dims = shapes.get(spec.name, dims)
        if any(d < 0 for d in dims):
            raise ValueError(f"input {spec.name} has variable dimensions {list(dims)}: give --shape {spec.name}:...")
        full[spec.name] = (batch_size, *dims) if batching else tuple(dims)
    return full


def synthetic_array(datatype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if datatype == "BYTES":
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        items = ["".join(rng.choice(letters, 8)) for _ in range(int(np.prod(shape)))]
        return np.array(items, dtype=object).reshape(shape)
    if datatype == "BOOL":
        return rng.random(shape) < 0.5
    if datatype.startswith("FP"):
        return rng.standard_normal(shape).astype(tensors.BY_API[datatype])
    return rng.integers(0, 100, shape).astype(tensors.BY_API[datatype])  # small: valid ids and indices


def infer_workload(client: InferenceClient, model: str, version: str = "", batch_size: int = 1,
                   shapes: dict[str, tuple[int, ...]] | None = None, seed: int = 0) -> Workload:
    metadata = client.model_metadata(model, version)
    batching = client.model_config(model, version).max_batch_size > 0
    full = input_shapes(metadata, batching, batch_size, shapes or {})
    rng = np.random.default_rng(seed)
    specs = {s.name: s for s in metadata.inputs}
    payloads = []
    for _ in range(DISTINCT_REQUESTS):
        inputs = {name: synthetic_array(specs[name].datatype, shape, rng) for name, shape in full.items()}
        payloads.append(messages.infer_request(model, inputs, version=version).SerializeToString())
    description = {"inputs": {name: {"datatype": specs[name].datatype, "shape": list(shape)}
                              for name, shape in full.items()}}
    return Workload(model, "infer", payloads, description)


def parse_length(spec: str) -> tuple[int, int]:
    """`N` or `LO:HI` (uniform, inclusive) words per prompt."""
    try:
        low, _, high = spec.partition(":")
        bounds = (int(low), int(high or low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"prompt length {spec!r}: expected N or LO:HI with 1 <= LO <= HI")
    return bounds


def prompts(length: tuple[int, int], count: int, rng: np.random.Generator) -> list[str]:
    sizes = rng.integers(length[0], length[1] + 1, count)
    return [" ".join(rng.choice(WORDS, int(n))) for n in sizes]


def generate_workload(model: str, version: str = "", prompt_length: tuple[int, int] = (32, 32), seed: int = 0,
                      count: int = 4 * DISTINCT_REQUESTS, **sampling) -> Workload:
    texts = prompts(prompt_length, count, np.random.default_rng(seed))
    payloads = [messages.generate_request(model, text, version, **sampling).SerializeToString() for text in texts]
    description = {"prompt_words": list(prompt_length), "sampling": sampling}
    return Workload(model, "generate", payloads, description)


def is_generation_model(client: InferenceClient, model: str, version: str = "") -> bool:
    config = client.model_config(model, version)
    return config.HasField("generation") or config.backend == "llm"


def run_point(url: str, workload: Workload, *, concurrency: int | None = None, rate: float | None = None,
              requests: int | None = None, duration_s: float | None = None, warmup: int = 0,
              timeout_s: float = 60, seed: int = 0, tls: TlsOptions | None = None,
              progress: Callable[[int], None] | None = None) -> loadgen.RunResult:
    """One load level: `concurrency` callers in a closed loop, or Poisson arrivals at `rate`."""
    method = loadgen.GENERATE if workload.streaming else loadgen.MODEL_INFER
    target = balancing.parse(url)  # several replicas: round_robin, health checks and retries
    common = {"timeout_s": timeout_s, "method_path": method, "streaming": workload.streaming, "warmup": warmup,
              "credentials": tls.credentials() if tls else None,
              "channel_options": target.channel_options() + (tls.channel_options() if tls else []),
              "progress": progress}
    if rate is not None:
        return asyncio.run(loadgen.open_loop(target.target, workload.payloads, rate, requests, seed=seed,
                                             duration_s=duration_s, **common))
    return asyncio.run(loadgen.closed_loop(target.target, workload.payloads, concurrency, requests, duration_s,
                                           **common))


def served_by_replica(url: str, model: str, version: str = "", client_options: dict | None = None) -> dict[str, int]:
    """Successful requests each replica behind a balanced `url` has served for `model` so far, read from
    its own ModelStatistics; empty for a single address (behind a proxy that would be one backend's count,
    mislabelled). Two readings taken around a run give each replica's share of it."""
    target = balancing.parse(url)
    if not target.balanced:
        return {}
    counts = {}
    for address in balancing.replicas(target):
        try:
            with InferenceClient(address, timeout_s=10, **(client_options or {})) as client:
                counts[address] = sum(s.inference_stats.success.count for s in client.model_statistics(model, version))
        except FerryClientError:
            counts[address] = None  # gone (or going): no figure rather than a wrong one
    return counts


def replica_shares(before: dict[str, int | None], after: dict[str, int | None]) -> dict[str, int | None]:
    return {a: None if after.get(a) is None or before.get(a) is None else after[a] - before[a] for a in after}


def row(result: loadgen.RunResult) -> dict:
    """The report's figures for one load level. Times in ms; None where nothing was measured."""
    out = {
        "concurrency": result.concurrency or None, "request_rate": result.request_rate, "requests": result.sent,
        "completed": result.completed, "errors": sum(result.errors.values()), "duration_s": round(result.wall_s, 6),
        "throughput_rps": round(result.throughput, 3), **_stats("latency", result.latencies_s),
        "client_cpu_share": round(result.client_cpu_s / result.wall_s, 3) if result.wall_s else None,
    }
    if result.streaming:
        out["prompt_tokens_mean"] = round(result.prompt_tokens / result.completed, 1) if result.completed else None
        out["output_tokens"] = result.output_tokens
        out["output_tokens_per_s"] = round(result.output_tokens / result.wall_s, 3) if result.wall_s else None
        for name, values in (("ttft", result.ttft_s), ("tpot", result.tpot_s), ("itl", result.itl_s)):
            out.update(_stats(name, values))
        out["finish_reasons"] = dict(result.finish_reasons)
    out["error_messages"] = dict(result.errors)
    return out


def _stats(name: str, values_s: np.ndarray) -> dict:
    if not len(values_s):
        return {f"{name}_{k}_ms": None for k in ("mean", "p50", "p90", "p95", "p99")}
    ms = np.asarray(values_s) * 1000
    figures = {"mean": ms.mean(), **{f"p{q}": np.percentile(ms, q) for q in (50, 90, 95, 99)}}
    return {f"{name}_{k}_ms": round(float(v), 3) for k, v in figures.items()}
