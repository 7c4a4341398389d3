"""The requests `ferry tune` sends: random inputs shaped by the config, the user's own (`--input-data`),
or a recorded trace replayed (`--from-trace`, written by `ferry serve --record-traffic`).

A trace keeps each request's arrival time and size but not its data, so a replay sends random values
(or the `--input-data` values, when their shapes match) in exactly the recorded shapes, at the recorded
offsets: the same count, the same rows, the same burstiness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clients import messages, perf, tensors
from clients.client import InferenceClient

PROMPT_IDS = (5, 100)  # token ids a synthetic prompt draws from: inside every vocabulary, past the usual specials


@dataclass(frozen=True)
class Trace:
    """One model's recorded requests: arrival offsets in seconds from the first, and each one's payload."""

    workload: perf.Workload
    offsets_s: list[float]
    rows: int  # batch rows (infer) or prompt tokens (generate) in the whole trace
    output_tokens: int = 0
    largest: int = 1  # the most rows of one request


def read_trace(path: Path, model: str) -> list[dict]:
    """The lines of the last recording in `path` that are for `model`, in arrival order."""
    lines: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"--from-trace {path}: line {number} is not JSON") from None
            if "start" in line:
                lines = []  # a later recording replaces what came before
            elif line.get("model") == model:
                lines.append(line)
    if not lines:
        raise ValueError(f"--from-trace {path}: no request for model {model!r} in its last recording")
    return sorted(lines, key=lambda line: line["t"])


def trace(client: InferenceClient, model: str, path: Path, generation: bool, seed: int = 0,
          input_data: list[dict[str, np.ndarray]] | None = None) -> Trace:
    lines = read_trace(path, model)
    t0 = lines[0]["t"]
    offsets = [line["t"] - t0 for line in lines]
    rng = np.random.default_rng(seed)
    if generation:
        payloads, tokens = [], 0
        for line in lines:
            if "prompt_tokens" not in line:
                raise ValueError(f"--from-trace {path}: model {model!r} is a generation model but its lines carry inputs")
            ids = rng.integers(*PROMPT_IDS, line["prompt_tokens"]).tolist()
            payloads.append(messages.generate_request(model, ids, max_tokens=line["max_tokens"], temperature=0.0,
                                                      ignore_eos=True).SerializeToString())
            tokens += line["max_tokens"]
        rows = sum(line["prompt_tokens"] for line in lines)
        return Trace(perf.Workload(model, "generate", payloads, {"trace": str(path), "requests": len(lines)}),
                     offsets, rows, tokens)
    specs = {s.name: s for s in client.model_metadata(model).inputs}
    payloads, rows, largest = [], 0, 1
    for i, line in enumerate(lines):
        shapes = line.get("inputs")
        if shapes is None:
            raise ValueError(f"--from-trace {path}: model {model!r} takes tensors but its lines carry prompts")
        inputs = {}
        for name, shape in shapes.items():
            if name not in specs:
                raise ValueError(f"--from-trace {path}: input {name!r} is not one of {model}'s inputs {sorted(specs)}")
            given = input_data[i % len(input_data)].get(name) if input_data else None
            inputs[name] = given if given is not None and list(given.shape) == shape else \
                perf.synthetic_array(specs[name].datatype, tuple(shape), rng)
        first = next(iter(shapes.values()), [])
        rows += first[0] if first else 1  # a batching model's rows; for others, the first dimension
        largest = max(largest, first[0] if first else 1)
        payloads.append(messages.infer_request(model, inputs).SerializeToString())
    return Trace(perf.Workload(model, "infer", payloads, {"trace": str(path), "requests": len(lines)}), offsets, rows, largest=largest)


def read_input_data(client: InferenceClient, model: str, path: Path) -> list[dict[str, np.ndarray]]:
    """`--input-data FILE`: {"data": [{INPUT: nested list | {"content": [...], "shape": [...]}}, ...]}, as
    perf_analyzer takes it; each entry is one request, with the batch dimension for batching models."""
    document = json.loads(Path(path).read_text())
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--input-data {path}: expected {{\"data\": [{{INPUT: values, ...}}, ...]}}")
    types = {s.name: s.datatype for s in client.model_metadata(model).inputs}
    out = []
    for i, entry in enumerate(entries):
        request = {}
        for name, value in entry.items():
            if name not in types:
                raise ValueError(f"--input-data {path}: entry {i} names {name!r}; {model}'s inputs are {sorted(types)}")
            dtype = object if types[name] == "BYTES" else tensors.BY_API[types[name]]
            if isinstance(value, dict):
                request[name] = np.array(value["content"], dtype=dtype).reshape(value["shape"])
            else:
                request[name] = np.array(value, dtype=dtype)
        out.append(request)
    return out


def given_inputs(model: str, data: list[dict[str, np.ndarray]]) -> perf.Workload:
    payloads = [messages.infer_request(model, inputs).SerializeToString() for inputs in data]
    shapes = {name: list(array.shape) for name, array in data[0].items()}
    return perf.Workload(model, "infer", payloads, {"input_data": len(data), "inputs": shapes})
