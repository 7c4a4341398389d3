"""Next-token choice per sequence: greedy, temperature, top-k, top-p, seeded.

A seeded request draws token i from a generator seeded with (seed, i), so its output does not depend
on which other requests share the batch or on how often it was preempted and recomputed.

Rows never fail each other: the decoder refuses bad sampling parameters, and should a row's
distribution still come out unusable (NaN or infinite logits from the model, an all-masked row), that
row falls back to its argmax instead of making `torch.multinomial` raise for the whole step.
"""

from __future__ import annotations

import torch

from server.scheduling.sequence import SamplingParams

_SEED_STRIDE = 1_000_003
_MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32 to inf: as good as greedy


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           fallback: torch.Generator) -> list[int]:
    # logits: [S, vocab] float32; positions: index of the token being chosen, per row
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
    return choice.tolist()


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
