"""Prompt lookup: draft the next tokens of a sequence by finding where its last few tokens occurred before.

Summaries, code edits and extraction copy long runs of their prompt, and a model that loops copies
its own output; in both cases the tokens that followed the latest earlier occurrence of the
sequence's last n tokens are a good guess at what comes next, found without a draft model. The
longest n (from `max_n` down to `min_n`) that occurs earlier wins, and its latest occurrence: the
most recent context is the likeliest to be repeated.

One pass over the history per call, vectorised: for every earlier position p whose token equals the
last token, how many tokens before it also match the suffix (up to `max_n`), as `max_n` array
comparisons over all positions at once, never a Python loop over the history.
"""

from __future__ import annotations

import numpy as np


def propose(token_ids: list[int] | np.ndarray, num_tokens: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest suffix of
    `token_ids` of length `min_n`..`max_n`; [] when no suffix that long occurred before."""
    history = np.asarray(token_ids)
    length = len(history)
    if num_tokens < 1 or length < min_n + 1:
        return []
    # ends[p]: an occurrence ending at p (p < length - 1, so at least one token follows it)
    ends = history[:-1]
    matched = ends == history[-1]  # [length - 1] positions whose suffix of length 1 matches
    run = matched.astype(np.int32)
    for back in range(1, min(max_n, length - 1)):
        # position p extends its match if p - back exists and equals the suffix's token `back` from the end
        matched[back:] &= ends[:-back] == history[-1 - back]
        matched[:back] = False
        run += matched
    best = int(run.max(initial=0))
    if best < min_n:
        return []
    end = int(np.flatnonzero(run >= best)[-1])
    return history[end + 1 : end + 1 + num_tokens].tolist()
