"""The seam every backend implements: load once, execute batches, unload once.

A backend sees whole batches as numpy arrays joined along dim 0; joining and splitting belong to
`Batch`, so every backend gets the same batching contract for free. `execute` runs on the
instance's own thread, never on the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protos import model_config_pb2 as mc


STREAM_END = object()  # a decoupled backend's `open_streams` delivers it after a request's final response
NOT_RUN = object()  # in a train's answers: the request never began (its process died running one before it)


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "cpu" or "cuda"
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def parameter(config: mc.ModelConfig, key: str, default: str | None = None) -> str | None:
    """A config `parameters` entry (Triton keeps these as strings)."""
    value = config.parameters.get(key)
    return value.string_value if value is not None else default


class Backend(ABC):
    name: str  # as written in a config's `backend` field
    default_filename: str
    # BYTES inputs reach the model as text (ONNX Runtime's strings): each element must be UTF-8, which
    # is checked per request at decode, so one client's bad bytes never fail a batch.
    bytes_as_text: bool = False
    runs_batches: bool = True  # execute() takes a batch of inputs (False: a token-step engine); model_warmup needs it
    takes_bf16: bool = False  # BF16 tensors (numpy arrays of ml_dtypes.bfloat16) reach execute() and may leave it
    instance: int = 0  # index among its model version's instances (0..count-1), set by the loader
    instance_name: str = ""  # Triton's name for it (`<model>_<group>_<index>`), set by the loader
    version_dir: Path | None = None  # the model's version folder, set by the loader (the model file may live elsewhere)
    checks_ready: bool = False  # is_ready() asks the model (on a thread: it may block); else always ready

    def __init__(self, config: mc.ModelConfig, model_path: Path, device: Device):
        self.config = config
        self.model_path = model_path
        self.device = device

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        """Fill what the config leaves out from the model file itself, where the format allows."""

    @classmethod
    def prime(cls) -> None:
        """Pay the runtime's one-off costs (its environment, thread pools, kernel tables) before the first
        load is measured, so they land in the server's baseline and not in one model's footprint, where
        the budget would charge them for as long as that model stays (server/repository/footprint.py)."""

    @classmethod
    def cuda_devices(cls) -> int:
        """CUDA devices this backend can really use (0 where CUDA is absent or fails to start)."""
        return 0

    @abstractmethod
    def load(self) -> None:
        """Read the model onto `self.device`; raise with a readable message if it cannot be served."""

    @abstractmethod
    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; return every output declared in the config, keyed by name."""

    def is_ready(self) -> bool:
        """The model's own readiness, asked on every ready check where `checks_ready` (e.g. Triton's is_ready)."""
        return True

    def train_limit(self) -> int:
        """How many queued single requests one dispatch may hand this backend as a train, each run alone
        (`Batch.train`); 1: one at a time. Only a backend whose batches cost a fixed hop each (a model
        process) gains from more."""
        return 1

    def train_hold_ns(self) -> int:
        """How long a free instance may wait for a longer train while the event loop is the bottleneck
        (server/scheduling/train_hold.py); 0: never. Fixed once loaded."""
        return 0

    def execute_ns(self) -> int:
        """What one execute takes, as measured (0: not measured), where `train_limit` is sized by it."""
        return 0

    def unload(self) -> None:
        """Release the model's memory."""

    def held(self) -> tuple | None:
        """The objects holding the model's memory (a session, a module) that `unload` lets go of, so an
        unload can tell from weak references whether reference counting freed them or a cycle keeps them
        (server/heap.py `reclaim`); None: not known, and every unload then runs a full collection."""
        return None

    def describe(self) -> dict[str, str]:
        """Facts an operator wants to see in the model's config parameters (device, provider)."""
        return {"device": str(self.device)}
