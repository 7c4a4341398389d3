"""Python backend: a `model.py` in the version folder, like Triton's python backend but plain numpy.

The file defines `class Model` with `execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]`
and, optionally, `initialize(self, args: dict)` and `finalize(self)`. `args` holds `config` (the model
config as a dict), `version_dir`, `device` and `instance` (0-based among the model's instances). Each
instance gets its own `Model` object; the instances of one load share one import of `model.py`, so
module-level state is shared by them. A batching model's `execute` gets every request of the batch
joined along dim 0 (true batching: one call per batch); a decoupled model's `execute` is a generator
yielding one dict per response (runners/decoupled.py). Every load imports the file afresh under a name of its own
(never entered in sys.modules): an edited `model.py` takes effect on RepositoryModelLoad or a
repository poll, and the module is dropped when the last instance of its load is unloaded.
"""

from __future__ import annotations

import importlib.util
import itertools
import threading
from pathlib import Path

import numpy as np
from google.protobuf import json_format

from protos import model_config_pb2 as mc
from server.backends.base import Backend, Device
from server.errors import ConfigError

_loads = itertools.count()  # makes each import's module name unique, so no import reuses another's


class _SharedImports:
    """One module per load of a version: keyed by the version's config object, which the loader
    gives all instances of one load (and a new one on every load); kept alive with the entry so
    its id cannot be reused while the module is held."""

    def __init__(self):
        self._held: dict[int, list] = {}  # id(config) -> [config, module, instances holding it]
        self._lock = threading.Lock()

    def acquire(self, config: mc.ModelConfig, path: Path):
        with self._lock:
            entry = self._held.get(id(config))
            if entry is None:
                entry = self._held[id(config)] = [config, _import(path, config.name), 0]
            entry[2] += 1
            return entry[1]

    def release(self, config: mc.ModelConfig) -> None:
        with self._lock:
            entry = self._held.get(id(config))
            if entry is not None:
                entry[2] -= 1
                if entry[2] <= 0:
                    del self._held[id(config)]


_imports = _SharedImports()


def _import(path: Path, model: str):
    """Execute `path` as a new module that is never entered in sys.modules (so never found again)."""
    name = f"ferry_model_{model}_{next(_loads)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PythonBackend(Backend):
    name = "python"
    default_filename = "model.py"

    def __init__(self, config: mc.ModelConfig, model_path: Path, device: Device):
        super().__init__(config, model_path, device)
        self.model = None
        self._holds_module = False

    def load(self) -> None:
        module = _imports.acquire(self.config, self.model_path)
        self._holds_module = True
        model_class = getattr(module, "Model", None)
        if model_class is None:
            raise ConfigError(f"{self.config.name}/{self.model_path.parent.name}/{self.model_path.name}: defines no `class Model`")
        self.model = model_class()
        if hasattr(self.model, "initialize"):
            self.model.initialize({
                "config": json_format.MessageToDict(self.config, preserving_proto_field_name=True),
                "version_dir": str(self.model_path.parent), "device": str(self.device), "instance": self.instance,
            })

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.asarray(value) for name, value in self.model.execute(inputs).items()}

    def responses(self, inputs: dict[str, np.ndarray]):
        """A decoupled model's `execute` yields its responses (dicts of outputs), 0..N per request."""
        produced = self.model.execute(inputs)
        if isinstance(produced, dict):
            raise ConfigError(f"model '{self.config.name}' is decoupled: its execute must yield one dict per response "
                              "(a generator), not return a dict")
        yield from produced

    def unload(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            self.model.finalize()
        self.model = None
        if self._holds_module:
            self._holds_module = False
            _imports.release(self.config)  # the last instance of this load drops the module
