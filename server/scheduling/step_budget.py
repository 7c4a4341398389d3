"""A step-time target: how many prompt tokens one generation step may take so that it ends in time.

Every running sequence's next token waits for the whole step it is in, so a step that also computes a
long prompt chunk is an inter-token stall for every decode in it (a 1,024-token chunk on a CPU: ~300 ms
against ~30 ms for the decodes alone). With a target, decodes still come first (one token each); the
prompt chunks of the step get what the target leaves, judged by a cost model the runner keeps feeding
with measured step times (this module reads no clock). A step with no decode in it has nobody's
inter-token latency to protect, so it is bounded only by `max_num_batched_tokens`; and a step always
offers at least `min_prefill_tokens` to prompts, so they progress however tight the target.

NOTE: the cost model is a line, step_ms = fixed + per_token * tokens, fitted by least squares over
exponentially decayed past steps (recent steps count most, so it follows load and context growth).
While every recent step had about the same size the slope cannot be told from the intercept; then
the whole cost is charged per token (a line through 0), which overestimates the slope and so errs
towards smaller chunks. One step is counted at most twice its predicted cost, so a lone stall (the
machine busy elsewhere) does not cut every chunk to the minimum for the next dozen steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.9  # weight of the past at each new step: about the last 10-20 steps shape the fit
STALL = 2.0  # a step counts at most this many times its predicted cost: a real slowdown is still
# followed within a few steps, a one-off stall moves the fit by a bounded amount
_FLAT = 1.0  # tokens^2: a decayed variance of step sizes below this cannot fix a slope


class StepCost:
    """Online fit of step_ms = fixed_ms + per_token_ms * tokens from measured steps."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums

    @property
    def fitted(self) -> bool:
        return self._w > 0

    def observe(self, tokens: int, ms: float) -> None:
        """Fold in one step that computed `tokens` tokens and took `ms` milliseconds."""
        if tokens <= 0 or not math.isfinite(ms) or ms < 0:
            return
        if self.fitted:  # a lone stall (another process took the cores) must not shrink chunks for many steps
            fixed, per_token = self.line()
            ms = min(ms, STALL * (fixed + per_token * tokens))
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + tokens
        self._y = d * self._y + ms
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * ms

    def line(self) -> tuple[float, float]:
        """(fixed_ms, per_token_ms) of the current fit; (0, 0) before any step was seen."""
        if not self.fitted:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var >= _FLAT:
            slope = (self._xy / self._w - mx * my) / var
            if slope > 0:
                fixed = my - slope * mx
                return (fixed, slope) if fixed >= 0 else (0.0, my / mx)
        return 0.0, my / mx

    def tokens_within(self, ms: float) -> int | None:
        """The most tokens a step may hold and be predicted to end within `ms`; None: no fit yet."""
        fixed, per_token = self.line()
        if per_token <= 0:
            return None
        return max(0, math.floor((ms - fixed) / per_token + 1e-6))  # not one token less for rounding


@dataclass(slots=True)
class StepBudget:
    """The step-time target of one model and the cost model it is judged by."""

    max_step_ms: float = 0.0  # 0: no target
    min_prefill_tokens: int = 32
    cost: StepCost | None = None

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = StepCost()

    def prefill_tokens(self, decoding: int, budget: int) -> int:
        """Prompt tokens a step with `decoding` one-token decodes may add, within the step's token
        `budget` (max_num_batched_tokens); all of it when there is no target, no decode or no fit yet."""
        room = budget - decoding
        if self.max_step_ms <= 0 or decoding == 0:
            return budget
        allowed = self.cost.tokens_within(self.max_step_ms)
        if allowed is None:
            return budget
        return max(0, min(room, max(self.min_prefill_tokens, allowed - decoding)))
