"""What every benchmark needs: a server subprocess, the machine's description, RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server.tensors import datatypes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"


def start_server(cmd: list[str], timeout_s: float = 120, lines: list[str] | None = None,
                 cwd: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """Start a server that prints `ferry: serving gRPC on HOST:PORT` and `ferry: ready`.

    `lines`, when given, receives what it printed up to `ready` (e.g. the metrics address). `cwd`: the
    checkout whose `server` package `python -m server` runs (another one to compare against).
    """
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = None
    for line in proc.stdout:
        if lines is not None:
            lines.append(line)
        found = re.search(r"ferry: serving gRPC on (\S+)", line)
        if found:
            address = found.group(1)
        if line.startswith("ferry: ready"):
            break
    if address is None:
        proc.kill()
        raise RuntimeError(f"server did not start: {cmd}")
    # keep draining its output so a chatty server never blocks on a full pipe
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, address


def ferry_command(repo: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "server", "serve", "--model-repository", str(repo), "--grpc-port", "0", "--http-port", "0",
            "--metrics-port", "-1", "--log-level", "WARNING", *extra]


def infer_payload(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    request = pb.ModelInferRequest(model_name=model)
    for name, array in inputs.items():
        request.inputs.add(name=name, datatype=datatypes.from_numpy(array.dtype).api, shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request.SerializeToString()


def model_counts(channel, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of a model, for mean executed batch size over a run."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model)).model_stats[0]
    return stats.inference_count, stats.execution_count


def model_totals(metrics_url: str, model: str, *names: str) -> tuple[float, ...]:
    """Counters (`<name>_total`) of version 1 of `model` from a Prometheus page; 0 for one not yet there."""
    import urllib.request

    page = urllib.request.urlopen(metrics_url, timeout=10).read().decode()

    def value(name: str) -> float:
        found = re.search(rf'{name}_total\{{model="{model}",version="1"\}} (\S+)', page)
        return float(found.group(1)) if found else 0.0

    return tuple(value(name) for name in names)


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, {platform.system()}"


def load_note(load_before: float, order: str = "Systems ran one after another.") -> str:
    """The closing line of a run whose systems ran in turn: how busy the machine was at its start and end."""
    return (f"\n\nMachine load average (1 min) at the start and end of the run: {load_before:.1f}, "
            f"{os.getloadavg()[0]:.1f}. {order}\n")


def append_results(title: str, body: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with RESULTS.open("a") as f:
        f.write(f"\n## {title} ({stamp})\n\nMachine: {machine()}\n\n{body.rstrip()}\n")


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
