"""RepositoryModelLoad's parameters, as Triton takes them: `config` (a JSON ModelConfig that
replaces the model folder's config) and `file:<path>` (model files sent inline).

Inline files are written to a temporary model folder (`<tmp>/<model>/<path>`) that lives as long as
the versions loaded from it; every path is checked before anything is written. Messages start with
Triton's words ("failed to load", "failed to poll from model repository"), which Triton's own
example clients match on, and go on with what to fix.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from google.protobuf import json_format

from protos import model_config_pb2 as mc
from server.errors import ConfigError, InvalidInputError
from server.names import shown

NAME_MAX = 255  # bytes per path component, as POSIX file systems allow
MAX_DEPTH = 8


@dataclass(frozen=True, slots=True)
class LoadOverride:
    config: mc.ModelConfig | None = None
    files: dict[PurePosixPath, bytes] = field(default_factory=dict)


def parse(name: str, params: dict[str, Any]) -> LoadOverride | None:
    """Decoded load parameters -> an override (None when there are none); refuses unknown keys."""
    if not params:
        return None
    config, files = None, {}
    for key, value in params.items():
        if key == "config":
            config = _config(name, value)
        elif key.startswith("file:"):
            if not isinstance(value, bytes):
                raise InvalidInputError(f"failed to load {shown(name)}: parameter {shown(key)} must carry the file as bytes_param")
            files[_file_path(name, key[len("file:"):])] = value
        else:
            raise InvalidInputError(f"failed to load {shown(name)}: unknown load parameter {shown(key)} "
                                    "(known: 'config', 'file:<path>')")
    if files and config is None:
        raise InvalidInputError(f"failed to load {shown(name)}: 'file:' parameters need a 'config' parameter too, "
                                "as in Triton (the files replace the model folder, so its config cannot be used)")
    return LoadOverride(config, files)


def _config(name: str, value) -> mc.ModelConfig:
    if not isinstance(value, str):
        raise InvalidInputError(f"failed to load {shown(name)}: parameter 'config' must be a JSON string (string_param)")
    config = mc.ModelConfig()
    try:
        json_format.Parse(value, config)
    except json_format.ParseError as exc:
        raise ConfigError(f"failed to load {shown(name)}: the 'config' parameter is not a JSON ModelConfig: {exc}") from None
    if config.name and config.name != name:
        raise ConfigError(f"failed to load {shown(name)}: the 'config' parameter names model {config.name!r}")
    config.name = name
    return config


def _file_path(name: str, text: str) -> PurePosixPath:
    # `file:/1/model.py` names the model folder's 1/model.py, as Triton reads it (its QA suite writes it so)
    path = PurePosixPath(text.lstrip("/"))
    parts = path.parts
    why = ""
    if not text.lstrip("/") or path.is_absolute() or any(p in ("..", ".") for p in parts):
        why = "must be a relative path inside the model folder, without '.' or '..'"
    elif len(parts) > MAX_DEPTH:
        why = f"is more than {MAX_DEPTH} folders deep"
    elif any(len(p.encode()) > NAME_MAX or "\\" in p or "\x00" in p for p in parts):
        why = f"has a component longer than {NAME_MAX} bytes or holding '\\\\' or NUL"
    if why:
        raise InvalidInputError(f"failed to load {shown(name)}, failed to poll from model repository: "
                                f"file parameter path {shown(text)} {why}")
    return path


def stage(name: str, files: dict[PurePosixPath, bytes]) -> Path:
    """Write inline files into a new temporary model folder; returns `<tmp>/<name>`."""
    model_dir = Path(tempfile.mkdtemp(prefix="ferry-inline-")) / name
    for path, data in files.items():
        target = model_dir.joinpath(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return model_dir


def remove(model_dir: Path | None) -> None:
    if model_dir is not None:
        shutil.rmtree(model_dir.parent, ignore_errors=True)
