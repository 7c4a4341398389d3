"""Triton's Python-based backends: `<backend-directory>/<name>/model.py`, served to every model whose
config says `backend: "<name>"`.

One model.py written once (an adapter for a family of models) and many models, each with its own
config and files, run by the Python backend as if the model.py were in each model's version folder:
each model gets its own instance processes, and `args` / `pb_utils.get_model_dir()` point at the
model's folders, not the backend's. Only `ferry serve --backend-directory` turns this on, since it runs
the code found there: without it, an unknown backend name is refused as before.
"""

from __future__ import annotations

from pathlib import Path

from protos import model_config_pb2 as mc
from server.errors import ConfigError

RUNTIME = "model.py"  # Triton's `runtime` for a Python-based backend (the one file it looks for)


def runtime_path(config: mc.ModelConfig, backend_directory: Path | None, source: str) -> Path | None:
    """The model.py serving `config`'s backend, or None when the name is not a Python-based backend's."""
    if backend_directory is None or not config.backend:
        return None
    name = config.backend
    if name in (".", "..") or "/" in name or "\\" in name:
        raise ConfigError(f"{source}: backend {name!r} is not a folder name")
    if config.runtime and config.runtime != RUNTIME:
        raise ConfigError(f"{source}: runtime {config.runtime!r}: Ferry runs Python-based backends only "
                          f"(runtime {RUNTIME!r}); it loads no backend shared library")
    path = backend_directory / name / RUNTIME
    return path if path.is_file() else None


def is_python(config: mc.ModelConfig) -> bool:
    """Whether the model runs a model.py (the python backend, or a Python-based backend), for what only
    a model.py can do (decoupled responses, rescheduling)."""
    return config.backend == "python" or config.runtime == RUNTIME
