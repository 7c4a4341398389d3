"""Backends by name. Modules are imported on first use, so serving ONNX alone never imports torch."""

from __future__ import annotations

import importlib
from pathlib import Path

from protos import model_config_pb2 as mc
from server.errors import ConfigError

_BACKENDS = {
    "onnxruntime": "server.backends.onnx_runtime:OnnxRuntimeBackend",
    "pytorch": "server.backends.pytorch:TorchBackend",
    "python": "server.backends.python.backend:PythonBackend",
    "llm": "server.backends.llm.engine:LLMBackend",
    "vllm": "server.backends.llm.vllm_folder:VllmFolderBackend",  # Triton's vLLM folders: <version>/model.json
    "embedding": "server.backends.embedding:EmbeddingBackend",  # sentence-transformers folders: <version>/modules.json
}
# Backends whose models generate text step by step (served by the generation runner).
GENERATION = frozenset({"llm", "vllm"})
# Backend whose models turn texts into vectors (served by the embedding runner, one queued request per text).
EMBEDDING = "embedding"
# Triton platform names -> backend names, so Triton configs work unchanged.
_PLATFORMS = {"onnxruntime_onnx": "onnxruntime", "pytorch_libtorch": "pytorch", "pytorch_export": "pytorch"}
# Which backend a bare model file implies when the config names none.
_FILE_HINTS = {".onnx": "onnxruntime", ".pt": "pytorch", ".pt2": "pytorch", ".py": "python", ".safetensors": "llm"}


def backend_class(name: str):
    target = _BACKENDS.get(name)
    if target is None:
        raise ConfigError(f"unknown backend {name!r}; available: {sorted(_BACKENDS)}, or a Python-based backend "
                          f"(<dir>/{name}/model.py, served with `ferry serve --backend-directory <dir>`)")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def is_builtin(name: str) -> bool:
    return name in _BACKENDS


def resolve_backend_name(config: mc.ModelConfig, version_dirs: list[Path], source: str) -> str:
    if config.backend:
        return config.backend
    if config.platform:
        if config.platform not in _PLATFORMS:
            raise ConfigError(f"{source}: field 'platform' is {config.platform!r}; supported: {sorted(_PLATFORMS)}")
        return _PLATFORMS[config.platform]
    names = {config.default_model_filename} if config.default_model_filename else None
    if names is None and any((d / "modules.json").is_file() for d in version_dirs):
        return "embedding"  # a sentence-transformers folder (its model.safetensors is an encoder, not an LLM)
    for version_dir in version_dirs:
        for path in sorted(version_dir.iterdir()):
            if (names is None or path.name in names) and path.suffix in _FILE_HINTS:
                return _FILE_HINTS[path.suffix]
    raise ConfigError(
        f"{source}: set field 'backend' (one of {sorted(_BACKENDS)}) or add a model file "
        f"({', '.join('model' + s for s in _FILE_HINTS)}) to a version folder"
    )
