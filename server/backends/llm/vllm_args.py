"""Triton's vLLM backend folders: `<version>/model.json` (vLLM engine arguments) -> Ferry's `generation` settings.

Read once when a version loads. Arguments with a Ferry equivalent become `ModelGeneration` fields; those
whose value is what Ferry does anyway pass in silence; every other one is returned in `ignored`, for the
one WARNING the backend logs. A value of the wrong type or out of range fails the load naming the argument:
serving with a setting the user did not ask for would be worse than not serving.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from protos import model_config_pb2 as mc
from server.errors import ConfigError

_DTYPES = {"auto": "auto", "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
           "float": "float32", "float32": "float32"}  # vLLM's spellings -> Ferry's
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # `org/name` or `name`, as vLLM passes to the Hub
_MAX_BLOCK_SIZE = 1024  # as the engine's own limit (backends/llm/engine.py)
_MAX_UINT32 = 2**32 - 1  # the generation fields' protobuf type


@dataclass(frozen=True, slots=True)
class EngineArgs:
    folder: Path  # the local Hugging Face folder `model` names, resolved
    generation: mc.ModelGeneration  # the arguments Ferry applies, as its own settings
    ignored: tuple[str, ...]  # arguments Ferry does not apply, as `name` or `name=value`


class _Reader:
    """Typed reads of one model.json's values; every refusal names the file and the argument."""

    def __init__(self, values: dict[str, Any], source: str):
        self.values, self.source = values, source

    def fail(self, key: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: engine argument '{key}' {why}, got {self.values[key]!r}")

    def integer(self, key: str, low: int = 1, high: int = _MAX_UINT32) -> int:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(key, f"must be an integer within {low}..{high}")
        return value

    def fraction(self, key: str) -> float:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 < value <= 1):
            raise self.fail(key, "must be a number within (0, 1]")
        return float(value)

    def flag(self, key: str) -> bool:
        """JSON true/false, or the strings "true"/"false" (Triton's own samples write `"enable_lora": "true"`)."""
        value = self.values[key]
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise self.fail(key, "must be true or false")
        return value

    def dtype(self, key: str) -> str:
        value = self.values[key]
        if not isinstance(value, str) or value not in _DTYPES:
            raise self.fail(key, f"must be one of {', '.join(_DTYPES)}")
        return _DTYPES[value]


def _speculative(r: _Reader, g: mc.ModelGeneration) -> bool:
    """vLLM's `speculative_config` names the same fields as Ferry's; only method "ngram" has an equivalent."""
    spec = r.values["speculative_config"]
    if not isinstance(spec, dict):
        raise r.fail("speculative_config", "must be a JSON object")
    if spec.get("method") != "ngram" or set(spec) - {"method", "num_speculative_tokens", "prompt_lookup_max",
                                                      "prompt_lookup_min"}:
        return False
    if "num_speculative_tokens" not in spec:
        raise r.fail("speculative_config", "needs num_speculative_tokens with method \"ngram\"")
    inner = _Reader(spec, f"{r.source}: speculative_config")
    g.speculative.method = "ngram"
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        if key in spec:
            setattr(g.speculative, key, inner.integer(key))
    return True


def _setter(field: str, read: Callable[[_Reader, str], Any]) -> Callable[[_Reader, mc.ModelGeneration, str], bool]:
    def apply(r: _Reader, g: mc.ModelGeneration, key: str) -> bool:
        setattr(g, field, read(r, key))
        return True
    return apply


# engine argument -> how it lands in `generation`; False back means "not applied" (named in the warning)
_MAPPED: dict[str, Callable[[_Reader, mc.ModelGeneration, str], bool]] = {
    "gpu_memory_utilization": _setter("gpu_memory_utilization", _Reader.fraction),
    "max_model_len": _setter("max_model_len", _Reader.integer),
    "block_size": _setter("block_size", lambda r, k: r.integer(k, high=_MAX_BLOCK_SIZE)),
    "max_num_seqs": _setter("max_num_seqs", _Reader.integer),
    "max_num_batched_tokens": _setter("max_num_batched_tokens", _Reader.integer),
    "enable_prefix_caching": _setter("enable_prefix_caching", _Reader.flag),
    "dtype": _setter("dtype", _Reader.dtype),
    "num_gpu_blocks_override": _setter("num_kv_blocks", _Reader.integer),
    "kv_cache_memory_bytes": _setter("kv_cache_memory_mb", lambda r, k: -(-r.integer(k, high=2**63) // 2**20)),
    "speculative_config": lambda r, g, k: _speculative(r, g),
}
# Arguments whose value (when it is this one) is what Ferry does anyway: no warning for them.
_SAME_AS_FERRY: dict[str, Callable[[Any], bool]] = {
    "enforce_eager": lambda v: v in (True, "true", "True"),  # Ferry captures no CUDA graphs
    "tensor_parallel_size": lambda v: v == 1,
    "pipeline_parallel_size": lambda v: v == 1,
    "trust_remote_code": lambda v: True,  # Ferry never runs a checkpoint's code; its own model classes load it
    "disable_log_stats": lambda v: True,  # Ferry's figures are on /metrics either way
    "disable_log_requests": lambda v: True,
}


def read(model_json: Path, source: str) -> EngineArgs:
    """model.json -> EngineArgs; `source` is how messages name the file (relative to the repository)."""
    r = _Reader(_parse(model_json, source), source)
    folder = _model_folder(r, model_json.parent)
    generation, ignored = mc.ModelGeneration(), []
    for key, value in r.values.items():
        if key == "model":
            continue
        if key in _MAPPED:
            if not _MAPPED[key](r, generation, key):
                ignored.append(key)
        elif key == "tokenizer" and _resolve(value, model_json.parent) == folder:
            continue  # the model's own tokenizer, which Ferry reads from the model folder anyway
        elif key not in _SAME_AS_FERRY:
            ignored.append(key)
        elif not _SAME_AS_FERRY[key](value):
            ignored.append(f"{key}={json.dumps(value)}")
    return EngineArgs(folder, generation, tuple(ignored))


def model_folder(model_json: Path, source: str) -> Path:
    """Only `model`, resolved: what an engine instance needs once `read` has been applied to the config."""
    return _model_folder(_Reader(_parse(model_json, source), source), model_json.parent)


def _parse(model_json: Path, source: str) -> dict[str, Any]:
    try:
        values = json.loads(model_json.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{source}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a JSON object of vLLM engine arguments, got {type(values).__name__}")
    return values


def _resolve(value: Any, version_dir: Path) -> Path | None:
    if not isinstance(value, str) or not value:
        return None
    path = Path(value).expanduser()
    return (path if path.is_absolute() else version_dir / path).resolve()


def _model_folder(r: _Reader, version_dir: Path) -> Path:
    """`model` as a local Hugging Face folder (relative paths from the version folder); a Hub name is refused."""
    if "model" not in r.values:
        raise ConfigError(f"{r.source}: engine argument 'model' is missing; set it to a local Hugging Face model folder")
    value, folder = r.values["model"], _resolve(r.values["model"], version_dir)
    if folder is None:
        raise r.fail("model", "must be the path of a local Hugging Face model folder")
    if not folder.is_dir():
        if _HUB_NAME.match(value) and not value.startswith("."):
            raise ConfigError(
                f"{r.source}: engine argument 'model' is {value!r}, which is not a local folder: Ferry does not "
                f"download from the Hugging Face Hub. Download it first (e.g. `huggingface-cli download {value} "
                f"--local-dir /models/{value.rsplit('/', 1)[-1]}`) and set 'model' to that folder (absolute, "
                f"or relative to {version_dir.parent.name}/{version_dir.name}/)")
        raise r.fail("model", "names no folder (a relative path is read from the version folder)")
    if not (folder / "config.json").is_file():
        raise r.fail("model", "is a folder without config.json (a Hugging Face model folder has one)")
    return folder
