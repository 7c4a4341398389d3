"""Structured output: constraints compiled to token masks by llguidance, one matcher per sequence.

Why llguidance (docs/generation.md says more): a pip wheel of Rust code that requires nothing else
(xgrammar requires torch, transformers and triton); it reads the model's own tokenizer.json; its
masks are computed lazily from the lexer and parser state (no vocabulary-wide precompile per
schema), which keeps the first request of a new schema cheap; and a matcher can be deep-copied, so a
schema is compiled once and each sequence starts from a copy of the compiled template.

A sequence's matcher follows its output lazily: before a step, each constrained row's matcher consumes
whatever the sequence gained since the last step (one token, several after accepted drafts, none
after a preemption, whose recompute keeps its tokens), so the scheduler never talks to it. The masks
for a step depend only on tokens known before the step, so they are computed on a helper thread
while the model's forward pass runs (both release the GIL) and applied to the logits after it: the
constrained rows wait for their mask only if it takes longer than the forward pass.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from server.errors import InvalidInputError
from server.scheduling.sequence import Constraint

_CACHED = 256  # compiled grammars kept per model, least recently used dropped first
_BITS = torch.arange(32, dtype=torch.int32)
_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


@dataclass(slots=True)
class GuidedStats:
    """Running totals the runner publishes (generation_metrics.py)."""

    rows: int = 0  # tokens chosen under a mask
    mixed_steps: int = 0  # steps with constrained and free rows together
    compiles: int = 0
    compile_us: float = 0.0
    mask_wait_us: float = 0.0  # waited for masks after the forward pass


class Guide:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "consumed", "broken")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.consumed = 0
        self.broken = False  # a token it could not take (never from its own mask): only eos is allowed after

    def follow(self, output: list[int]) -> None:
        """Bring the matcher to `output`, an extension of what it consumed."""
        new = output[self.consumed:]
        if new and not self.broken:
            taken = self.matcher.try_consume_tokens(new)
            self.consumed += taken
            self.broken = taken < len(new)

    def rewind(self, length: int) -> None:
        """Back to the first `length` output tokens (a drafted step's tentative tokens undone)."""
        if length < self.consumed:
            self.matcher.rollback(self.consumed - length)
            self.consumed = length
        self.broken = False  # what it refused was a draft, after `length`


class Guides:
    """The compiled constraints of one model (a bounded cache), and the masks of a step."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_ids = [t for t in eos_ids if 0 <= t < vocab_size]
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=self.eos_ids or None)
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        # Rows from which llguidance's own threads compute a step's masks (0: never). On a small machine
        # they only compete with torch's threads for the same cores: one thread is quicker there
        # (bench/RESULTS.md, structured outputs notes).
        self.parallel_rows = 16 if (os.cpu_count() or 1) >= 8 else 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ferry-guided-mask")
        self.stats = GuidedStats()

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The compiled template for `constraint`; one the engine cannot compile is the client's error."""
        template = self._compiled.get(constraint)
        if template is not None:
            self._compiled.move_to_end(constraint)
            return template
        started = time.perf_counter()
        try:
            grammar = llguidance.grammar_from(_FORMATS[constraint.kind], _grammar_text(constraint))
        except ValueError as exc:
            raise InvalidInputError(f"the {constraint.kind} constraint cannot be compiled: {exc}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidInputError(f"the {constraint.kind} constraint cannot be compiled: {template.get_error()}")
        self.stats.compiles += 1
        self.stats.compile_us += (time.perf_counter() - started) * 1e6
        self._compiled[constraint] = template
        if len(self._compiled) > _CACHED:
            self._compiled.popitem(last=False)
        return template

    def start(self, constraint: Constraint) -> Guide:
        return Guide(self.compile(constraint).deep_copy())

    def masks(self, rows: list[tuple[Guide, list[int]]], total_rows: int) -> Future:
        """Start computing one bitmask row per (guide, output so far) of a step choosing `total_rows`
        tokens; the Future gives [rows, words] int32."""
        self.stats.rows += len(rows)
        self.stats.mixed_steps += len(rows) < total_rows
        return self._thread.submit(self._fill, rows)

    def wait(self, masks: Future) -> torch.Tensor:
        started = time.perf_counter()
        mask = masks.result()
        self.stats.mask_wait_us += (time.perf_counter() - started) * 1e6
        return mask

    def _fill(self, rows: list[tuple[Guide, list[int]]]) -> torch.Tensor:
        mask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        real: dict[int, tuple[Guide, int]] = {}  # a drafted sequence's rows: its first row is its real output
        for guide, output in rows:
            real.setdefault(id(guide), (guide, len(output)))
        # Many sequences (one row each) at once on llguidance's threads; else one after another here, as
        # drafted rows must be (row j is the state after the first j drafts).
        parallel = 0 < self.parallel_rows <= len(rows) == len(real)
        broken = []
        for j, (guide, output) in enumerate(rows):
            guide.follow(output)
            if guide.broken:
                broken.append(j)
            elif not parallel:
                guide.matcher.unsafe_compute_mask_ptr(mask[j].data_ptr(), mask.shape[1] * 4)
        working = [(g.matcher, j) for j, (g, _) in enumerate(rows) if not g.broken] if parallel else []
        if working:  # (llguidance refuses an empty list)
            self._executor.unsafe_compute_mask_ptr(working, mask.data_ptr(), mask.shape[1] * 4, mask.shape[0])
        for guide, length in real.values():
            guide.rewind(length)  # drafts' tentative tokens undone (nothing to undo for the others)
        for j in broken:  # a token it could not take: nothing but the end is left to choose
            mask[j] = _only(self.eos_ids, mask.shape[1])
        return mask

    def close(self) -> None:
        self._thread.shutdown(wait=False)


def apply(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    """`logits` with every token a row's mask leaves out at -inf, for the given rows ([S, vocab])."""
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long, device=device)
    if device.type == "cpu":  # numpy's unpackbits: one C pass (the shift-and-and below is ~30x slower on a CPU)
        allowed = torch.from_numpy(np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]).bool()
    else:  # the packed bits cross to the accelerator, 32 tokens a word, and are unpacked there
        mask = mask.to(device)
        allowed = ((mask.unsqueeze(-1) >> _BITS.to(device)) & 1).flatten(1)[:, :vocab].bool()
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def _grammar_text(constraint: Constraint) -> str:
    if constraint.kind != "json":
        return constraint.spec
    schema = json.loads(constraint.spec)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        # Compact JSON: a flexible-whitespace grammar lets a weak model spend its whole budget on blanks.
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return json.dumps(schema)


def _only(ids: list[int], words: int) -> torch.Tensor:
    row = torch.zeros(words, dtype=torch.int64)
    for t in ids:
        row[t // 32] |= 1 << (t % 32)
    return ((row + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, as int32
