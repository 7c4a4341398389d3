"""Speculative decoding with prompt-lookup drafts: which drafts a step checks, and which the model keeps.

NOTE: the output is exactly what decoding one token per step gives. A decoding sequence is fed its
last token plus up to k drafted tokens (ngram.py) in one step, and the model chooses a token after
each of them, every choice made as if the tokens before it were the sequence's own (penalties,
min_tokens, seeds and logprobs included: the sampler sees each position's own history). Drafts are
kept while they equal the model's choice, then the model's next choice is added; so a step yields
1 to k + 1 tokens, each the one plain decoding would have produced there. For a sampled (not greedy)
request this is also exact: a draft is one fixed token, and keeping it only when the model's draw
there picks it is rejection sampling against a one-token proposal, so every kept token is drawn
from the model's own distribution (and a seeded request draws the very same tokens).

Drafts take only what a step leaves: they are planned after everyone due is scheduled and admitted,
within the step's remaining token budget and free KV blocks, and never preempt or delay anyone.
Their K/V is written into the sequence's own blocks past `num_computed`; `num_computed` then advances
over the kept tokens only, blocks past the kept length go back to the pool, and only kept tokens are
ever in a block the prefix cache names (it names full blocks below `num_computed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.scheduling.ngram import propose


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    num_speculative_tokens: int  # k: drafts per sequence per step
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1


@dataclass(slots=True)
class SpeculativeStats:
    """Counts since the model loaded (vLLM's names): steps a sequence was drafted for, tokens drafted,
    drafts the model kept."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


def accepted(drafts: list[int], choices: list[int]) -> list[int]:
    """The tokens a verified step yields: the drafts the model agreed with, then its own next choice.
    `choices[j]` is the model's token after the last real token and drafts[:j]."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == choices[kept]:
        kept += 1
    return choices[: kept + 1]


class Speculator:
    def __init__(self, settings: SpeculativeSettings):
        self.settings = settings
        self.stats = SpeculativeStats()

    def draft(self, entries: list, budget: int, reserve, max_model_len: int) -> dict[int, list[int]]:
        """Drafts for the decoding entries of a planned step, most urgent first, within `budget` tokens;
        `reserve(seq, num_tokens)` gives `seq` room for that many tokens if the pool has it (True), or
        changes nothing (False). Rewrites each drafted entry's count to include its drafts; returns
        {seq_id: drafts}."""
        s = self.settings
        drafts: dict[int, list[int]] = {}
        for i, (seq, n) in enumerate(entries):
            if budget <= 0:
                break
            if n != 1 or seq.pending != 1:
                continue  # a prompt chunk or a recompute: nothing to verify yet
            # tokens past max_tokens or max_model_len would be thrown away: do not draft them
            limit = min(s.num_speculative_tokens, budget, seq.sampling.max_tokens - seq.num_output - 1,
                        max_model_len - seq.num_tokens - 1)
            if limit <= 0:
                continue
            tokens = propose(seq.token_ids, limit, s.prompt_lookup_max, s.prompt_lookup_min)
            while tokens and not reserve(seq, seq.num_tokens + len(tokens)):
                tokens.pop()
            if not tokens:
                continue
            drafts[seq.seq_id] = tokens
            entries[i] = (seq, n + len(tokens))
            budget -= len(tokens)
            self.stats.drafts += 1
            self.stats.draft_tokens += len(tokens)
        return drafts

    def verify(self, drafts: list[int], choices: list[int]) -> list[int]:
        """`accepted`, counted."""
        tokens = accepted(drafts, choices)
        self.stats.accepted_tokens += len(tokens) - 1
        return tokens
