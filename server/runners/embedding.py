"""The embedding runner: a batching runner whose unit of work is one text, not one client request.

A client request carries any number of texts (OpenAI's `input` list, KServe's `text` rows). Each text is
tokenized here, on the event loop, checked against the model's length (an over-long text is refused naming
the limit, or cut to `truncate_prompt_tokens` when the request asks, as vLLM does), and queued as a request
of its own whose length is its token count. So the model's scheduler (bin packing by token count by default,
scheduling/binpack.py) puts texts of similar length from many clients in one batch padded to its own longest,
and a request's long text never pads its short ones. The request's answer is its texts' vectors in order.
The statistics count texts: a batch is one execution, each text one inference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

import numpy as np

from server.backends.embedding_layout import EMBEDDING, IDS, TEXT
from server.errors import InvalidInputError
from server.request import InferRequest
from server.runners.batch import ModelRunner

TRUNCATE = "truncate_prompt_tokens"  # vLLM's name: keep this many tokens of an over-long text instead of refusing it


class EmbeddingRunner(ModelRunner):
    embeds = True  # /v1/embeddings serves it (the doors ask this, not the class)

    @property
    def _encoder(self):
        return self.workers[0].backend

    @property
    def dimension(self) -> int:
        return self._encoder.dimension

    @property
    def max_length(self) -> int:
        return self._encoder.max_length

    @property
    def normalizes(self) -> bool:
        return self._encoder.layout.normalize

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self._encoder.tokenize(texts) if texts else []

    def text_rows(self, texts: list[str], truncate: int | None = None) -> list[list[int]]:
        """Each text's token ids. Longer than the model takes: an error naming the limit, unless `truncate`
        asks for truncation, which cuts the text as the tokenizer does (its first tokens, special tokens
        kept: sentence-transformers' own truncation, and vLLM's for text)."""
        rows = self.tokenize(texts)
        if truncate is None:
            return self._within(rows)
        keep = self._keep(truncate)
        long = [i for i, row in enumerate(rows) if len(row) > keep]
        if long:
            for i, row in zip(long, self._encoder.tokenize([texts[i] for i in long], max_length=keep)):
                rows[i] = row
        return rows

    def id_rows(self, rows: list[list[int]], truncate: int | None = None) -> list[list[int]]:
        """Token ids as the client sent them, within the vocabulary (an id past it would fail its whole batch)
        and the model's length; `truncate` keeps the last tokens of a longer row (vLLM's rule for ids)."""
        vocab = self._encoder.vocab_size
        for i, row in enumerate(rows):
            if min(row) < 0 or max(row) >= vocab:
                raise InvalidInputError(f"input {i} holds token ids outside model '{self.name}''s vocabulary "
                                        f"(0..{vocab - 1})")
        if truncate is None:
            return self._within(rows)
        keep = self._keep(truncate)
        return [row if len(row) <= keep else row[len(row) - keep:] for row in rows]

    def _keep(self, truncate) -> int:
        """`truncate_prompt_tokens` checked: 1 up to the model's length, or -1 for the model's length (vLLM)."""
        limit = self.max_length
        if truncate == -1:
            return limit
        if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 1:
            raise InvalidInputError(f"'{TRUNCATE}' must be a positive integer (or -1: the model's maximum), got {truncate!r}")
        if truncate > limit:
            raise InvalidInputError(f"'{TRUNCATE}' ({truncate}) is more than model '{self.name}' takes: "
                                    f"its maximum context length is {limit} tokens")
        return truncate

    def _within(self, rows: list[list[int]]) -> list[list[int]]:
        limit = self.max_length
        for i, row in enumerate(rows):
            if len(row) > limit:
                raise InvalidInputError(f"input {i} has {len(row)} tokens, more than model '{self.name}' takes: its "
                                        f"maximum context length is {limit} tokens; shorten it or send "
                                        f"'{TRUNCATE}' to have it truncated")
            if not row:
                raise InvalidInputError(f"input {i} has no tokens")
        return rows

    async def embed(self, rows: Sequence[list[int]], template: InferRequest | None = None) -> np.ndarray:
        """Each row's vector ([rows, dim] float32), every row queued as a request of its own; `template`
        (the client's request) lends them its id, arrival, deadline and priority. One failing row fails
        the call and withdraws the others still queued."""
        self._admit_check()
        base = template or InferRequest(self.name, {}, 1, ())
        queued = [self._queue_and_wait(InferRequest(
            self.name, {IDS: np.asarray(row, dtype=np.int64)}, 1, (), id=base.id, priority=base.priority,
            timeout_us=base.timeout_us, deadline_ns=base.deadline_ns, arrival_ns=base.arrival_ns,
            timeout_action=base.timeout_action, length=len(row), nbytes=8 * len(row))) for row in rows]
        if not queued:
            return np.zeros((0, self.dimension), np.float32)
        tasks = [asyncio.ensure_future(q) for q in queued]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return np.concatenate([a[EMBEDDING] for a in answers])

    def infer(self, request: InferRequest) -> Awaitable[dict[str, np.ndarray]]:
        """KServe's infer: `text` rows in, `embedding` rows out; the request's `truncate_prompt_tokens`
        parameter as on /v1/embeddings."""
        self._admit_check()
        return self._infer_texts(request)

    async def _infer_texts(self, request: InferRequest) -> dict[str, np.ndarray]:
        texts = [t.decode() if isinstance(t, bytes) else str(t) for t in request.inputs[TEXT].reshape(-1).tolist()]
        rows = self.text_rows(texts, request.parameters.get(TRUNCATE))
        return {EMBEDDING: await self.embed(rows, request)}


def shortened(vectors: np.ndarray, dimensions: int | None, renormalize: bool, model: str) -> np.ndarray:
    """OpenAI's `dimensions`: the first `dimensions` of each vector (Matryoshka-style truncation), scaled back to
    unit length when the model normalises its vectors."""
    if dimensions is None:
        return vectors
    full = vectors.shape[1]
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= full:
        raise InvalidInputError(f"'dimensions' must be an integer from 1 to {full} (model '{model}' gives {full}), "
                                f"got {dimensions!r}")
    if dimensions == full:
        return vectors
    cut = vectors[:, :dimensions]
    if not renormalize:
        return np.ascontiguousarray(cut)
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)
