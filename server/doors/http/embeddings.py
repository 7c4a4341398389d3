"""OpenAI's `/v1/embeddings` for embedding models (backend "embedding"): the body read, the answer shaped.

`input` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's four forms);
strings are tokenized by the model's own tokenizer, token ids are taken as they are. Every text is queued
on its own by the model's runner (runners/embedding.py), so one request's texts and other clients' are
batched by length together. `encoding_format` "base64" sends each vector as OpenAI does: its little-endian
float32 bytes in base64. `dimensions` keeps each vector's first dimensions (scaled back to unit length when
the model normalises). A text longer than the model takes is a 400 naming the limit unless
`truncate_prompt_tokens` (vLLM's field) asks for truncation: a text is cut as its tokenizer cuts it (its
first tokens, special tokens kept, as sentence-transformers truncates), token ids keep their last tokens.
"""

from __future__ import annotations

import base64
import time

from server.errors import InvalidInputError
from server.repository.registry import Registry
from server.request import InferRequest
from server.runners.embedding import shortened

_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}


def embedding_model(registry: Registry, body: dict):
    """The ready version of the embedding model the body names; 400 for a model of another kind."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise InvalidInputError("'model' must name an embedding model (GET /v1/models lists them)")
    mv = registry.get(name, "")
    if not getattr(mv.runner, "embeds", False):
        raise InvalidInputError(f"model '{mv.name}' is not an embedding model (its backend is {mv.config.backend!r}); "
                                "/v1/embeddings serves models with backend \"embedding\"")
    return mv


async def answer(registry: Registry, body: dict, arrival_ns: int | None = None) -> dict:
    """The whole /v1/embeddings answer for a checked JSON body (OpenAI's object)."""
    if not isinstance(body, dict):
        raise InvalidInputError("the request body must be a JSON object")
    unknown = set(body) - _FIELDS
    if unknown:
        raise InvalidInputError(f"unsupported fields {sorted(unknown)[:10]}; /v1/embeddings takes {sorted(_FIELDS)}")
    form = body.get("encoding_format") or "float"
    if form not in ("float", "base64"):
        raise InvalidInputError(f"'encoding_format' must be \"float\" or \"base64\", got {form!r}")
    mv = embedding_model(registry, body)
    runner = mv.runner
    texts, ids = inputs_of(body.get("input"))
    truncate = body.get("truncate_prompt_tokens")
    rows = runner.id_rows(ids, truncate) if ids is not None else runner.text_rows(texts, truncate)
    template = InferRequest(mv.name, {}, 1, (), arrival_ns=arrival_ns or time.monotonic_ns())
    vectors = shortened(await runner.embed(rows, template), body.get("dimensions"), runner.normalizes, mv.name)
    tokens = sum(len(r) for r in rows)
    if form == "base64":
        little = vectors.astype("<f4", copy=False)
        encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        encoded = vectors.tolist()
    return {"object": "list", "model": mv.name,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def inputs_of(value) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's `input` forms as (texts, None) or (None, token id rows)."""
    if isinstance(value, str):
        return [value], None
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return value, None
        if all(_is_id(v) for v in value):
            return None, [value]
        if all(isinstance(v, list) and v and all(_is_id(t) for t in v) for v in value):
            return None, value
    raise InvalidInputError("'input' must be a string, a non-empty list of strings, a non-empty list of token ids "
                            "or a list of non-empty lists of token ids")


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

