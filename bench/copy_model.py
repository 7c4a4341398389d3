"""A small Llama trained to copy its prompt with edits, for measuring prompt lookup on real copying.

A random model does not copy its prompt, so prompt lookup's acceptance on it says little about a
summariser or a code editor, whose output repeats long runs of the prompt with changes between them.
This model is trained for that: the prompt is `BOS, span, SEP`; the answer is the span again with a
fixed, seeded substitution applied (about `edit_share` of the vocabulary is renamed, as a code edit
renames identifiers), then EOS. An edited token breaks the n-gram match that prompt lookup follows,
so acceptance is below 1 for the same reason it is on real edits.

Training is bounded (a few minutes on a CPU) and seeded; the weights are cached under
~/.cache/ferry-bench, keyed by every training setting, so a rerun loads them instead of training.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import models

BOS, EOS, SEP = 0, 1, 2  # models.random_llama's bos/eos; SEP ends the prompt
FIRST_CONTENT = 3
CACHE = Path.home() / ".cache" / "ferry-bench"


@dataclass(frozen=True)
class CopySettings:
    vocab: int = 512
    hidden: int = 128
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    span_min: int = 16
    span_max: int = 48
    edit_share: float = 0.1
    steps: int = 1500
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    version: int = 1  # bump when the task itself changes

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def edit_map(s: CopySettings) -> np.ndarray:
    """token -> the token the answer writes for it: itself, except `edit_share` of the content tokens."""
    rng = np.random.default_rng(s.seed + 1)
    table = np.arange(s.vocab)
    content = np.arange(FIRST_CONTENT, s.vocab)
    renamed = rng.choice(content, size=int(len(content) * s.edit_share), replace=False)
    table[renamed] = rng.choice(content, size=len(renamed))
    return table


def prompt_and_answer(span: np.ndarray, table: np.ndarray) -> tuple[list[int], list[int]]:
    return [BOS, *span.tolist(), SEP], table[span].tolist()


def spans(rng: np.random.Generator, s: CopySettings, count: int, length: int) -> np.ndarray:
    return rng.integers(FIRST_CONTENT, s.vocab, size=(count, length))


def _batch(rng, s: CopySettings, table: np.ndarray):
    import torch

    length = int(rng.integers(s.span_min, s.span_max + 1))
    span = spans(rng, s, s.batch, length)
    ids = np.concatenate([np.full((s.batch, 1), BOS), span, np.full((s.batch, 1), SEP), table[span],
                          np.full((s.batch, 1), EOS)], axis=1)
    labels = ids.copy()
    labels[:, : length + 2] = -100  # loss on the answer only (transformers shifts labels by one)
    return torch.tensor(ids), torch.tensor(labels)


def train(folder: Path, s: CopySettings, log=print) -> None:
    import torch
    import transformers

    models.random_llama(folder, vocab=s.vocab, hidden=s.hidden, intermediate=s.intermediate, layers=s.layers,
                        heads=s.heads, kv_heads=s.heads, max_positions=4 * s.span_max + 16)
    torch.manual_seed(s.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    warmup = max(1, s.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, s.steps) / s.steps)))
    rng, table, start = np.random.default_rng(s.seed), edit_map(s), time.perf_counter()
    for step in range(s.steps):
        ids, labels = _batch(rng, s, table)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        optimiser.zero_grad()
        if step % 100 == 0 or step == s.steps - 1:
            log(f"copy model: step {step}/{s.steps} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    model.eval().save_pretrained(str(folder))


def trained(s: CopySettings, log=print) -> Path:
    """The cached model folder for `s`, trained first if no finished copy is cached."""
    folder = CACHE / f"copy-llama-{s.key()}"
    if (folder / "done").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    train(partial, s, log)
    (partial / "settings.json").write_text(json.dumps(asdict(s), indent=1))
    (partial / "done").write_text("")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # a run cut short leaves no folder that looks finished
    return folder


def lookup_share(prompt: list[int], output: list[int], max_n: int = 4, min_n: int = 1) -> float:
    """Fraction of output tokens prompt lookup would have proposed as the next token from everything
    before it (the best acceptance any k could reach with these lookup settings)."""
    from server.scheduling.ngram import propose

    history, hits = list(prompt), 0
    for token in output:
        hits += propose(history, 1, max_n, min_n) == [token]
        history.append(token)
    return hits / max(len(output), 1)


def widened(src: Path, dst: Path, hidden: int = 512, intermediate: int = 1376, layers: int = 6) -> Path:
    """The model at `src` computing exactly the same tokens at the cost of a `hidden`-wide, `layers`-deep
    model (the benchmark's 20M Llama), so drafting is weighed against a realistic step. The trained
    weights fill the top-left corner of every matrix and the rest is zero: padded width stays 0 through
    the residual stream, extra heads and MLP units output 0, and the added layers' output projections
    are 0, so each adds nothing to the residual; RMSNorm weights are scaled by sqrt(old / new width),
    since the padded zeros lower the mean square by that ratio (its epsilon grows by the inverse)."""
    import torch
    import transformers

    small = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    c = small.config
    head_dim = c.hidden_size // c.num_attention_heads
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim, num_key_value_heads=hidden // head_dim, head_dim=head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, tie_word_embeddings=False)
    big = transformers.LlamaForCausalLM(config)
    norm_scale = math.sqrt(c.hidden_size / hidden)
    kept = small.state_dict()
    with torch.no_grad():
        for name, tensor in big.state_dict().items():
            tensor.zero_()
            if name in kept:
                old = kept[name]
                tensor[tuple(slice(0, n) for n in old.shape)] = old * (norm_scale if name.endswith("norm.weight") else 1)
    big.save_pretrained(str(dst))
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    return dst
