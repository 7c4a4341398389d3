"""Sentence-embedding encoders in the sentence-transformers layout: `backend: "embedding"`.

A version folder as `SentenceTransformer.save` writes it: `modules.json` naming a Transformer module (a
Hugging Face encoder, BERT, RoBERTa, XLM-R..., with its tokenizer), a Pooling module (`1_Pooling/config.json`:
mean, CLS, max or last-token) and optionally Normalize. The encoder is transformers' own `AutoModel`, run in
torch or, on a CPU, as the same graph in ONNX Runtime (encoders.py); only the pooling is written here, in torch,
over the batch padded to its own longest text.

Texts are tokenized on the event loop by the embedding runner (runners/embedding.py), which queues one request
per text with its token count as its length, so the scheduler (bin packing by default) batches texts of similar
length from many clients. The instance's thread gets the batch's requests as they came (`per_request`): each is
a row of token ids, padded here once per batch, and each answer is that text's vector.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from protos import model_config_pb2 as mc
from server.backends.base import Backend, parameter
from server.backends.encoders import load_encoder
from server.backends.onnx_runtime import session_options
from server.backends.embedding_layout import (DEFAULT_MAX_BATCH_TEXTS, DEFAULT_MAX_BATCH_TOKENS, DEFAULT_NUM_BUCKETS,
                                              EMBEDDING, IDS, TEXT, EmbeddingLayout)
from server.errors import ConfigError

log = logging.getLogger(__name__)
_IMPORT = threading.Lock()


class EmbeddingBackend(Backend):
    name = "embedding"
    default_filename = "modules.json"
    bytes_as_text = True  # the text input is checked as UTF-8 per request
    per_request = True  # the worker hands over the batch's requests (token rows of their own lengths)

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        """The signature every embedding model has (text in, one vector out per row) and bin packing by
        token count unless the config chose its own batching."""
        layout = EmbeddingLayout(model_path)
        dim = _hidden_size(layout.encoder)
        if config.max_batch_size == 0:
            config.max_batch_size = DEFAULT_MAX_BATCH_TEXTS
        if not config.input:
            text = config.input.add(name=TEXT, data_type=mc.TYPE_STRING)
            text.dims.append(1)
        if not config.output:
            out = config.output.add(name=EMBEDDING, data_type=mc.TYPE_FP32)
            out.dims.append(dim)
        if config.WhichOneof("scheduling_choice") is None and not config.HasField("binpack_batching"):
            config.dynamic_batching.SetInParent()
            config.binpack_batching.max_batch_cost = DEFAULT_MAX_BATCH_TOKENS
            config.binpack_batching.num_buckets = DEFAULT_NUM_BUCKETS
        names = ([t.name for t in config.input], [t.name for t in config.output])
        if names != ([TEXT], [EMBEDDING]) or config.input[0].data_type != mc.TYPE_STRING:
            raise ConfigError(f"model '{config.name}': an embedding model takes input '{TEXT}' (TYPE_STRING, dims [1]) "
                              f"and gives output '{EMBEDDING}' (TYPE_FP32, dims [{dim}]); the config declares "
                              f"{names[0]} -> {names[1]}")

    @classmethod
    def cuda_devices(cls) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def load(self) -> None:
        with _IMPORT:  # instances load on threads of their own; transformers' lazy module is not safe to race
            try:
                from transformers import AutoModel, AutoTokenizer  # imported with the first embedding model only
            except ImportError as exc:
                raise ConfigError(f"the embedding backend needs transformers ({exc}): pip install 'ferry[embeddings]'") from None

        layout = EmbeddingLayout(self.model_path)
        self.layout = layout
        self.tokenizer = AutoTokenizer.from_pretrained(str(layout.encoder))
        model = AutoModel.from_pretrained(str(layout.encoder)).to(str(self.device)).eval()
        limits = [layout.max_seq_length, getattr(model.config, "max_position_embeddings", None)]
        if layout.max_seq_length is None and self.tokenizer.model_max_length < 10**9:
            limits.append(self.tokenizer.model_max_length)
        self.max_length = min(n for n in limits if n)
        self.dimension = int(model.config.hidden_size)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.vocab_size = int(model.config.vocab_size)
        self.encoder = load_encoder(model, layout.encoder, self.device, parameter(self.config, "encoder_runtime", "auto"),
                                    session_options(self.config), name=self.config.name)
        log.info("model '%s': %s encoder, %s pooling%s, %d dims, max %d tokens, on %s (%s)", self.config.name,
                 model.config.model_type, layout.pooling, " + normalize" if layout.normalize else "",
                 self.dimension, self.max_length, self.device, self.encoder.runtime)

    def tokenize(self, texts: list[str], max_length: int | None = None) -> list[list[int]]:
        """Token ids as the Transformer module makes them (special tokens added); untruncated unless
        `max_length` is given (then cut as the tokenizer cuts, special tokens kept)."""
        return self.tokenizer(texts, add_special_tokens=True, truncation=max_length is not None, max_length=max_length,
                              verbose=False)["input_ids"]

    def can_send(self) -> bool:
        return False  # runs on the instance's thread (execute_requests)

    def execute_requests(self, requests, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        vectors = self.encode([row[IDS] for row in inputs])
        return [{EMBEDDING: vectors[i:i + 1]} for i in range(len(inputs))]

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise ConfigError("the embedding backend runs the batch's requests as they came (execute_requests)")

    def encode(self, rows: list[np.ndarray]) -> np.ndarray:
        """Rows of token ids (their own lengths) -> [rows, dim] float32, padded once to the longest row."""
        lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
        longest = int(lengths.max())
        ids = np.full((len(rows), longest), self.pad_id, np.int64)
        mask = np.arange(longest)[None, :] < lengths[:, None]
        ids[mask] = np.concatenate(rows)
        mask = mask.astype(np.int64)
        hidden = self.encoder(ids, mask)
        with torch.inference_mode():
            device = hidden.device
            attention = torch.from_numpy(mask).to(device)
            pooled = pool(hidden, attention, torch.from_numpy(lengths).to(device), self.layout.pooling)
            if self.layout.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().numpy()

    def held(self) -> tuple:
        return (self.encoder,) if getattr(self, "encoder", None) is not None else ()

    def unload(self) -> None:
        self.encoder = None
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "pooling": self.layout.pooling,
                "normalize": str(self.layout.normalize).lower(), "max_model_len": str(self.max_length),
                "dimension": str(self.dimension), "encoder_runtime": self.encoder.runtime,
                "encoder_graph": self.encoder.source}


def pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """[rows, longest, hidden] -> [rows, hidden], padded positions left out (right padding)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def _hidden_size(encoder: Path) -> int:
    try:
        config = json.loads((encoder / "config.json").read_text())
        return int(config.get("hidden_size") or config["d_model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{encoder.name or 'the encoder'}: config.json gives no hidden_size ({exc})") from None

