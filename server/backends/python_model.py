"""Python backend: a `model.py` in the version folder, like Triton's python backend but plain numpy.

The file defines `class Model` with `execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]`
and, optionally, `initialize(self, args: dict)` and `finalize(self)`. `args` holds `config` (the model
config as a dict), `version_dir`, `device` and `instance` (0-based). Each instance gets its own
`Model` object; the module is imported once per version, so module-level state is shared by them.
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

_instances = itertools.count()
_modules: dict[Path, object] = {}
_modules_lock = threading.Lock()


def _import(path: Path, name: str):
    with _modules_lock:
        if path not in _modules:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _modules[path] = module
        return _modules[path]


class PythonBackend(Backend):
    name = "python"
    default_filename = "model.py"

    def __init__(self, config: mc.ModelConfig, model_path: Path, device: Device):
        super().__init__(config, model_path, device)
        self.instance = next(_instances)

    def load(self) -> None:
        module = _import(self.model_path.resolve(), f"ferry_model_{self.config.name}_{self.model_path.parent.name}")
        model_class = getattr(module, "Model", None)
        if model_class is None:
            raise ConfigError(f"{self.model_path}: defines no `class Model`")
        self.model = model_class()
        if hasattr(self.model, "initialize"):
            self.model.initialize({
                "config": json_format.MessageToDict(self.config, preserving_proto_field_name=True),
                "version_dir": str(self.model_path.parent), "device": str(self.device), "instance": self.instance,
            })

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: np.asarray(value) for name, value in self.model.execute(inputs).items()}

    def unload(self) -> None:
        if hasattr(self, "model") and hasattr(self.model, "finalize"):
            self.model.finalize()
        self.model = None
