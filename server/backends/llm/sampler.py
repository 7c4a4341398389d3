"""Next-token choice per sequence: penalties, min_tokens, greedy, temperature, top-k, top-p, seeded; logprobs.

A seeded request draws token i from a generator seeded with (seed, i), so its output does not depend
on which other requests share the batch or on how often it was preempted and recomputed.

Penalties follow vLLM (and transformers for `repetition_penalty`): repetition over prompt and output
tokens (a positive logit divided by it, a negative one multiplied), then frequency (times each
output occurrence) and presence (once per output token) subtracted. They are applied to every row
that asks, greedy or not, over the whole batch at once: per-row token counts come from one
`index_put_` over all rows' token ids. A row still under its `min_tokens` gets -inf on its eos
(unless ignore_eos) and stop token ids, so it cannot end early.

Logprobs are reported from the distribution the token was chosen from: after penalties, min_tokens
and temperature, before top-k/top-p (vLLM V0's choice); a greedy row's are log_softmax of its
penalized logits, which without penalties is the model's own. -inf (and NaN) become -9999.0, as vLLM
writes them, so every answer stays valid JSON.

Rows never fail each other: the decoder refuses bad sampling parameters, and should a row's
distribution still come out unusable (NaN or infinite logits from the model, an all-masked row), that
row falls back to its argmax instead of making `torch.multinomial` raise for the whole step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from server.scheduling.sequence import SamplingParams

_SEED_STRIDE = 1_000_003
_MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32 to inf: as good as greedy
_NO_LOGPROB = -9999.0  # what -inf is reported as (vLLM's OpenAI server does the same)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's log-probability and the `logprobs` most likely (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens were more likely
    top: list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class History:
    """A row's tokens so far (prompt, then output): what penalties and min_tokens read."""

    token_ids: list[int]
    prompt_len: int

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           fallback: torch.Generator) -> list[int]:
    """Tokens only, for rows with no history to penalize (see `choose`)."""
    return choose(logits, params, positions, fallback, None, ())[0]


def choose(logits: torch.Tensor, params: list[SamplingParams], positions: list[int], fallback: torch.Generator,
           histories: list[History] | None, eos_ids: tuple[int, ...]) -> tuple[list[int], dict[int, TokenLogprobs]]:
    """One token per row, and {row: TokenLogprobs} for rows that asked for logprobs."""
    # logits: [S, vocab] float32; positions: index of the token being chosen, per row
    if histories is not None:
        logits = _penalize(logits, params, histories)
        logits = _hold_stops(logits, params, histories, eos_ids)
    choice = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = _filtered_probs(logits[index], [params[i] for i in rows])
        usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        for j, i in enumerate(rows):
            if not usable[j]:
                continue  # keeps its argmax
            seed = params[i].seed
            generator = fallback
            if seed is not None:
                generator = torch.Generator(device=logits.device)
                generator.manual_seed((seed * _SEED_STRIDE + positions[i]) % (2**63))
            choice[i] = torch.multinomial(probs[j], 1, generator=generator)[0]
    return choice.tolist(), _logprobs(logits, params, choice)


def _counts(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrence counts of each row's token ids, in one scatter over all of them."""
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(len(lists), device=device),
                                   torch.tensor([len(ids) for ids in lists], device=device))
    inside = (flat >= 0) & (flat < vocab)  # an id the head cannot score cannot be penalized
    counts = torch.zeros(len(lists), vocab, device=device)
    counts.index_put_((rows[inside], flat[inside]), torch.ones_like(flat[inside], dtype=counts.dtype), accumulate=True)
    return counts


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _penalize(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(rows, device=device)
    output = _counts([histories[i].output for i in rows], vocab, device)
    seen = (_counts([histories[i].token_ids[:histories[i].prompt_len] for i in rows], vocab, device) > 0) | (output > 0)
    chosen = [params[i] for i in rows]
    repetition = _column([p.repetition_penalty for p in chosen], device)
    penalized = logits[index]
    penalized = torch.where(seen, torch.where(penalized > 0, penalized / repetition, penalized * repetition), penalized)
    penalized = (penalized - _column([p.frequency_penalty for p in chosen], device) * output
                 - _column([p.presence_penalty for p in chosen], device) * (output > 0))
    logits = logits.clone()
    logits[index] = torch.where(penalized.isnan(), float("-inf"), penalized)  # an extreme penalty never picks NaN
    return logits


def _hold_stops(logits: torch.Tensor, params: list[SamplingParams], histories: list[History],
                eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Rows under their min_tokens cannot choose eos (unless ignored) or a stop token id."""
    held = [(i, p.stop_token_ids + (() if p.ignore_eos else eos_ids)) for i, p in enumerate(params)
            if len(histories[i].token_ids) - histories[i].prompt_len < p.min_tokens]
    pairs = [(i, t) for i, ids in held for t in ids if 0 <= t < logits.shape[-1]]
    if not pairs:
        return logits
    rows, ids = torch.tensor(pairs, dtype=torch.long, device=logits.device).unbind(1)
    logits = logits.clone()
    logits[rows, ids] = float("-inf")
    return logits


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], choice: torch.Tensor) -> dict[int, TokenLogprobs]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    temps = _column([p.temperature if not p.greedy else 1.0 for p in (params[i] for i in rows)], logits.device)
    logprobs = (logits[index] / temps.clamp_min(_MIN_TEMPERATURE)).log_softmax(dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=_NO_LOGPROB, neginf=_NO_LOGPROB, posinf=0.0).clamp_min(_NO_LOGPROB)
    chosen = logprobs.gather(1, choice[index].unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    k = min(max(params[i].logprobs for i in rows), logprobs.shape[-1])
    top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))  # sorted, most likely first
    return {i: TokenLogprobs(int(choice[i]), chosen[j], ranks[j], list(zip(top_ids[j], top_values[j]))[:params[i].logprobs])
            for j, i in enumerate(rows)}


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1).clamp_min(_MIN_TEMPERATURE)
    logits = logits / temps
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=device).unsqueeze(0)
    top_k = torch.tensor([p.top_k or logits.shape[-1] for p in params], device=device).unsqueeze(1)
    drop = ranks >= top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    top_p = torch.tensor([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], device=device).unsqueeze(1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p  # keep the smallest prefix whose mass reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.softmax(dim=-1))
