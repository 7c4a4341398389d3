"""The sentence-transformers layout of an embedding model folder, read without torch.

`modules.json` lists the modules `SentenceTransformer.save` wrote: a Transformer (the Hugging Face encoder and
its tokenizer, at the folder's root or in `0_Transformer/`), a Pooling module (`1_Pooling/config.json`) and
optionally Normalize. Ferry serves exactly that pipeline; anything else is refused at load, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from server.errors import ConfigError

TEXT, EMBEDDING, IDS = "text", "embedding", "input_ids"
_POOLINGS = ("mean", "cls", "max", "lasttoken")
DEFAULT_MAX_BATCH_TEXTS = 64
DEFAULT_MAX_BATCH_TOKENS = 16384  # padded tokens a batch may hold (rows x its longest text)
# Learned length buckets. On a CPU an encoder's time follows the padded tokens it runs, nearly whatever the
# rows, so narrow buckets pay: 16 left a long-tailed mix 1.15x padding against 1.5x with the policy's
# default 4, and served 1.2-1.3x the texts/s from 64 clients (bench/embeddings.py, RESULTS 2026-12-06).
DEFAULT_NUM_BUCKETS = 16


class EmbeddingLayout:
    """What the sentence-transformers files say: where the encoder is, how to pool, whether to normalise."""

    def __init__(self, modules_json: Path):
        self.folder = modules_json.parent
        source = f"{self.folder.parent.name}/{self.folder.name}/modules.json"
        try:
            modules = json.loads(modules_json.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{source}: cannot be read as JSON ({exc})") from None
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if "Transformer" not in kinds or "Pooling" not in kinds or unknown:
            raise ConfigError(f"{source}: Ferry serves a Transformer module, a Pooling module and optionally Normalize; "
                              f"this folder has {sorted(kinds)}")
        self.encoder = self.folder / kinds["Transformer"].get("path", "")
        self.pooling = _pooling_mode(self.folder / kinds["Pooling"].get("path", "1_Pooling") / "config.json", source)
        self.normalize = "Normalize" in kinds
        self.max_seq_length = _max_seq_length(self.encoder)


def _pooling_mode(path: Path, source: str) -> str:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source}: the Pooling module's config.json cannot be read ({exc})") from None
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers write the mode by name
        modes = [config["pooling_mode"].replace("_token", "").replace("_tokens", "")]
    else:
        modes = [m for m in _POOLINGS if config.get(f"pooling_mode_{m}_token") or config.get(f"pooling_mode_{m}_tokens")
                 or config.get(f"pooling_mode_{m}")]
    if len(modes) != 1 or modes[0] not in _POOLINGS:
        raise ConfigError(f"{source}: pooling must be exactly one of {list(_POOLINGS)}; {path.name} asks for "
                          f"{modes or 'none'}")
    return modes[0]


def _max_seq_length(encoder: Path) -> int | None:
    try:
        return int(json.loads((encoder / "sentence_bert_config.json").read_text())["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
