"""Shared fixtures: real servers started as `python -m server serve` on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in ("unit", "integration", "gpu"):
            item.add_marker(getattr(pytest.mark, folder))


def wait_for(predicate, timeout_s: float = 60, what: str = "") -> None:
    """Wait for a state, never for an amount of work: `predicate` is polled until true, with a bound
    generous enough for a slow, busy CI machine; the poll interval only sets how soon it is seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what or predicate}")


FP32_REL, FP32_ABS = 1e-4, 1e-5


def approx_fp32(expected):
    """`pytest.approx` for float32 results of two computations that need not round alike, on any CPU.

    Another batch shape (a request alone or beside others, streamed or not, drafts verified together or
    one token a step), another thread count, instruction set (AVX2, AVX-512, NEON) or library (numpy,
    ONNX Runtime, torch) sums in another order, so two correct answers differ in their last bits: 1.7e-6
    on a logprob near -1 failed an abs=1e-6 check on another CPU (issue 25), and the test llama's
    logprobs differ by up to 3e-5 between a prefill and step-by-step decoding. rel 1e-4 with a 1e-5
    floor holds those with a margin, and still fails a real fault, which moves values by 1e-2 or more
    (another row's answer, another position's logprob, a penalty left out). Scalars, lists, arrays.

    Not for ids, counts or integer-valued floats (compared exactly), nor for one computation repeated in
    the same shape on the same machine, where exact equality is the point and a comment says so."""
    return pytest.approx(expected, rel=FP32_REL, abs=FP32_ABS)


async def wait_for_async(predicate, timeout_s: float = 60, what: str = "", poll_s: float = 0.005) -> None:
    """`wait_for` inside a running event loop: the poll yields to the loop, so the work it waits on runs.
    `poll_s`: the pause between checks (a loop that must look idle while it waits wants few wake-ups)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what or predicate}")
        await asyncio.sleep(poll_s)


def until_preempted(server, model: str, round_, attempts: int = 6):
    """Run `round_()` (concurrent streams to `model`, checked by the caller) until one round preempted.

    Preemption needs a round's streams to hold the KV pool at once; a busy machine can stagger the threads
    of one round so that each finishes before the next starts. Such a round is run again rather than
    trusted, and the test still fails if no round of `attempts` ever preempts. Returns the preempting
    round's results, the ones the caller checks."""
    for _ in range(attempts):
        before = server.metric("ferry_preemptions_total", model=model) or 0.0
        results = round_()
        if (server.metric("ferry_preemptions_total", model=model) or 0.0) > before:
            return results
    raise AssertionError(f"no round of {attempts} preempted on model '{model}'")


class RunningServer:
    """A `ferry serve` subprocess; its stdout is collected so tests can read what it printed."""

    def __init__(self, repo: Path, *extra: str, timeout_s: float = 90, module: str = "server",
                 env: dict[str, str] | None = None):
        """`module`: what `python -m` runs; a test launcher may register a test backend, then run Ferry's main.
        `env`: variables added to the server's environment (e.g. a TMPDIR of the test's own)."""
        cmd = [sys.executable, "-m", module, "serve", "--model-repository", str(repo),
               "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout_s):
            self.stop()
            raise RuntimeError("server did not become ready:\n" + "".join(self.lines))
        text = "".join(self.lines)
        self.address = re.search(r"ferry: serving gRPC on (\S+)", text).group(1)
        self.metrics_url = re.search(r"ferry: serving metrics on (\S+)", text).group(1)
        http = re.search(r"ferry: serving HTTP on (\S+)", text)
        self.http_address = http.group(1) if http else None  # host:port, as tritonclient.http takes it
        self.http_url = f"http://{self.http_address}" if http else None
        self.channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ferry: ready"):
                self._ready.set()
        self._ready.set()

    def metric(self, name: str, **labels: str) -> float | None:
        """The current value of one Prometheus sample, read from the server's /metrics page. The parser
        files a counter's samples as `<name>_total` (OpenMetrics' model); Ferry's page names them as
        Triton does, without the suffix, so either spelling finds them."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (name, name + "_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 20, **labels: str) -> None:
        wait_for(lambda: self.metric(name, **labels) == value, timeout_s, f"{name}{labels} to reach {value}")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "channel"):
            self.channel.close()
        return self.proc.returncode


def link_shipped_models(repo: Path, *names: str) -> None:
    """Serve some of model_repository/'s examples from a test repository, without copying them."""
    for name in names:
        (repo / name).symlink_to(ROOT / "model_repository" / name)


def serve_client_test_models(repo: Path) -> RunningServer:
    """The server both Python client test files use: shipped examples, every datatype, a gated model."""
    from tests import builders

    link_shipped_models(repo, "simple", "classifier", "tiny_llama")
    builders.identity_all_types(repo / "types" / "1" / "model.onnx")
    gate = repo / "gate"
    builders.gated_model(repo, "gated", gate=gate, max_batch_size=1)
    # the clients' load/unload calls need explicit model control (off by default)
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")
    server.gate = gate
    return server


@pytest.fixture
def start_server():
    servers = []

    def start(repo: Path, *extra: str) -> RunningServer:
        server = RunningServer(repo, *extra)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
