"""The server `ferry tune` measures: one it starts itself on free ports, or one already running (`--url`).

Every candidate reaches the server as a reload of the model with a `config` load parameter (Triton's
RepositoryModelLoad override): no restart, and a reload that fails leaves the versions already serving
in place, so the model is never left broken. That needs explicit model control; a server in another
mode is refused before anything is measured, naming the flag to start it with.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from google.protobuf import json_format

from clients.client import InferenceClient
from clients.errors import FerryClientError
from protos import model_config_pb2 as mc

_PROBE = "ferry-tune-probe"  # a model name no repository holds: explicit mode answers NOT_FOUND, others refuse


class NotTunable(RuntimeError):
    """The server cannot take candidate configs; the message says what to change."""


class Target:
    def __init__(self, url: str, client_options: dict | None = None, process: subprocess.Popen | None = None):
        self.url = url
        self.client = InferenceClient(url, timeout_s=120, **(client_options or {}))
        self.client_options = client_options or {}
        self.process = process

    def check_control(self) -> None:
        """Refuse a server that does not allow loads (mode none or poll), before any measurement."""
        try:
            self.client.load_model(_PROBE, timeout_s=30)
        except FerryClientError as exc:
            text = str(exc)
            if "model-control-mode" in text or "not allowed" in text:
                raise NotTunable(f"the server at {self.url} refuses model loads ({text}); ferry tune applies each "
                                 "candidate by reloading the model: start the server with --model-control-mode "
                                 "explicit, or give ferry tune --model-repository DIR to start its own") from None
            if exc.status == grpc.StatusCode.NOT_FOUND:
                return  # loads are allowed; there is just no such model
            raise NotTunable(f"the server at {self.url} refused a model load: {text} (model control needs the "
                             "admin token when tokens are set: --token)") from None
        self.client.unload_model(_PROBE)  # a repository that does hold such a model: leave it as it was

    def config(self, model: str) -> mc.ModelConfig:
        return self.client.model_config(model)

    def apply(self, model: str, config: mc.ModelConfig) -> str:
        """Reload `model` with `config`; '' or the server's reason it did not load (the old config then serves)."""
        text = json_format.MessageToJson(config, preserving_proto_field_name=True, indent=None)
        try:
            self.client.load_model(model, config=text)
        except FerryClientError as exc:
            return str(exc)
        return ""

    def cpu_seconds(self) -> float | None:
        """CPU time the server process has used (its own server only; None for --url)."""
        if self.process is None:
            return None
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / ticks  # self + children

    def close(self) -> None:
        self.client.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_local(repository: Path, model: str, extra: list[str], timeout_s: float = 300) -> Target:
    """`ferry serve` on free ports with explicit model control, serving only `model`."""
    cmd = [sys.executable, "-m", "server", "serve", "--model-repository", str(repository), "--grpc-port", "0",
           "--http-port", "-1", "--metrics-port", "-1", "--model-control-mode", "explicit", "--load-model", model,
           *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in process.stdout:
            if len(lines) < 2000:
                lines.append(line)
            if line.startswith("ferry: ready"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.1) and time.monotonic() < deadline:
        pass
    address = re.search(r"ferry: serving gRPC on (\S+)", "".join(lines))
    if process.poll() is not None or not ready.is_set() or address is None:
        process.kill()
        raise RuntimeError("the tuning server did not start:\n" + "".join(lines[-30:]))
    return Target(address.group(1), process=process)
