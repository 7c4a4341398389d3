"""A Hugging Face `config.json` of the Llama family -> the few numbers the model needs.

The families differ only in small switches read here (biases, q/k norms, which layers slide), so one
model class in llama.py serves them all and each switch follows what transformers' own class does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from server.errors import ConfigError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class LlamaArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3 and Mistral Nemo, where it is not hidden_size // num_heads
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    attention_bias: bool  # q/k/v projections carry a bias (always in Qwen2, never in Mistral)
    output_bias: bool  # o_proj carries one too (Llama and Qwen3 with attention_bias)
    mlp_bias: bool  # gate/up/down projections carry a bias (Llama's `mlp_bias`; never in the others)
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before rotary embedding
    sliding_window: int | None  # None when no layer slides
    sliding_layers: tuple[bool, ...]  # per layer: attends only to the last `sliding_window` positions
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
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        theta = raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        partial = raw.get("partial_rotary_factor", (rope or {}).get("partial_rotary_factor", 1.0))
        if partial != 1.0:  # transformers' Llama family rotates every dimension of a head, and so does Ferry
            raise ConfigError(f"{path}: partial_rotary_factor {partial!r} is not supported (rotary embedding covers "
                              "the whole head_dim in the Llama family)")
        window, sliding = _sliding_layers(raw, kind, path)
        bias = {"qwen2": True, "mistral": False}.get(kind, bool(raw.get("attention_bias", False)))
        return cls(
            model_type=kind, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"], num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if rope and rope.get("rope_type", rope.get("type")) not in (None, "default") else None,
            max_position=raw.get("max_position_embeddings", 2048),
            attention_bias=bias, output_bias=bias and kind in ("llama", "qwen3"),
            mlp_bias=kind == "llama" and bool(raw.get("mlp_bias", False)), qk_norm=kind == "qwen3",
            sliding_window=window, sliding_layers=sliding, eos_token_ids=eos,
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def _sliding_layers(raw: dict, kind: str, path: Path) -> tuple[int | None, tuple[bool, ...]]:
    """Which layers use sliding-window attention, as transformers decides: every layer of a Mistral
    with a `sliding_window`; in Qwen2/Qwen3 only with `use_sliding_window`, then the layers named
    `sliding_attention` in `layer_types`, or else those from `max_window_layers` on. Llama never slides."""
    layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window") if kind != "llama" else None
    if kind in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return None, (False,) * layers
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    if kind == "mistral":
        return window, (True,) * layers
    types = raw.get("layer_types") or [
        _LAYER_TYPES[i >= raw.get("max_window_layers", 28)] for i in range(layers)]
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise ConfigError(f"{path}: layer_types must name {layers} layers, each one of {', '.join(_LAYER_TYPES)}; "
                          f"got {types!r}")
    sliding = tuple(t == "sliding_attention" for t in types)
    return (window if any(sliding) else None), sliding
