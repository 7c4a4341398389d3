"""A Hugging Face `config.json` of the Llama family -> the few numbers the model needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from server.errors import ConfigError

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str  # as saved: float32, bfloat16, float16

    @classmethod
    def load(cls, folder: Path) -> LlamaArgs:
        path = folder / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        kind = raw.get("model_type")
        if kind not in SUPPORTED:
            raise ConfigError(f"{path}: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = raw.get("sliding_window") if raw.get("use_sliding_window", kind == "mistral") else None
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        theta = raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        return cls(
            model_type=kind, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if rope and rope.get("rope_type", rope.get("type")) not in (None, "default") else None,
            max_position=raw.get("max_position_embeddings", 2048),
            attention_bias=bool(raw.get("attention_bias", kind == "qwen2")),
            sliding_window=window, eos_token_ids=eos,
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )
