"""A step-time target: how many prompt tokens one generation step may take so that it ends in time.

Every running sequence's next token waits for the whole step it is in, so a step that also computes a
long prompt chunk is an inter-token stall for every decode in it (a 1,024-token chunk on a CPU: ~300 ms
against ~30 ms for the decodes alone). With a target, decodes still come first (one token each); the
prompt chunks of the step get what the target leaves, judged by a cost model the runner keeps feeding
with measured step times (this module reads no clock). A step with no decode in it has nobody's
inter-token latency to protect, so it is bounded only by `max_num_batched_tokens`; and a step always
offers at least `min_prefill_tokens` to prompts, so they progress however tight the target.

The same holds, nearly, for a step whose decodes are few next to the prompts it could start: at most
one decode for every `ONSET` of them. That is the onset of a burst: the server's first step caught
only the requests that had arrived by then, and the next one has their few decodes beside the rest
of the burst. Held to the target, the burst's prompts would go in target-sized chunks, each step
repeating those decodes and the step's fixed cost, and the last prompt would start hundreds of
milliseconds later (on the benchmark model) than had the first step caught the whole burst;
unbounded, a handful of streams wait one long step once. A steady stream of arrivals rarely has that
many prompts per decode, so there the target holds; a burst onto few running streams stalls them once.

Past the onset the target costs time to first token by arithmetic, not by any ordering: every step
repeats the decodes and the fixed cost, so with decodes-only cost D and target T a prompt gets T - D
of each step instead of nearly all of a long step, and the burst's last prompt starts about
(T / (T - D)) / (S / (S - D)) times later than with no target (S: a step of max_num_batched_tokens).

Without a target of its own a model gets one sized from its measured step cost (`auto`, the server's
default): AUTO times the predicted cost of a step of `auto_tokens` decodes (the scheduler passes
max_num_seqs, a full batch of streams), or of the step's own decodes when there are more. So no step
lasts more than AUTO times what a full batch of decodes costs on this model and machine, and while
few streams run, prompts get most of the step. (A fixed number of milliseconds is right for one
model on one machine only: 50 ms is a stall for a small model and a crawl for a large one. A target
of AUTO times the step's own decodes was replayed too: it bounds a burst's inter-token latency more
tightly, but with few streams it leaves prompts a sliver of each step, and it raised the time to first
token p99 of Poisson arrivals by 40%.)

NOTE: the cost model is a line, step_ms = fixed + per_token * tokens, fitted by least squares over
exponentially decayed past steps (recent steps count most, so it follows load and context growth).
While every recent step had about the same size the slope cannot be told from the intercept; then
the whole cost is charged per token (a line through 0), which overestimates the slope and so errs
towards smaller chunks. One step is counted at most twice its predicted cost, so a lone stall (the
machine busy elsewhere) does not cut every chunk to the minimum for the next dozen steps; while the
line goes through 0, a step smaller than the average is predicted at the average step's cost (a line
through 0 would charge it none of the fixed part and count its honest cost as a stall).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.9  # weight of the past at each new step: about the last 10-20 steps shape the fit
STALL = 2.0  # a step counts at most this many times its predicted cost: a real slowdown is still
# followed within a few steps, a one-off stall moves the fit by a bounded amount
ONSET = 4  # prompts waiting per decode from which a step is bounded by the token budget only
AUTO = 2.0  # the automatic target: this many times the cost of a full batch of decodes (chosen on a
# modelled replay of the issue-33 burst and Poisson loads, docs/architecture.md "Generation step cost")
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
            ms = min(ms, STALL * self._expected(tokens))
        d = self.decay
        self._w = d * self._w + 1
        self._x = d * self._x + tokens
        self._y = d * self._y + ms
        self._xx = d * self._xx + tokens * tokens
        self._xy = d * self._xy + tokens * ms

    def _expected(self, tokens: int) -> float:
        """The most a step of `tokens` can plausibly cost by the fit. A line through 0 (no fixed part
        could be told apart yet) charges a small step none of the fixed part, which may be most of its
        cost; so such a step is expected to cost up to what the average step did."""
        fixed, per_token = self.line()
        expected = fixed + per_token * tokens
        return expected if fixed > 0 else max(expected, self._y / self._w)

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

    def predict(self, tokens: int) -> float:
        """The fitted cost of a step of `tokens` tokens (0 before any step was seen)."""
        fixed, per_token = self.line()
        return fixed + per_token * tokens

    def tokens_within(self, ms: float) -> int | None:
        """The most tokens a step may hold and be predicted to end within `ms`; None: no fit yet."""
        fixed, per_token = self.line()
        if per_token <= 0:
            return None
        return max(0, math.floor((ms - fixed) / per_token + 1e-6))  # not one token less for rounding


@dataclass(slots=True)
class StepBudget:
    """The step-time target of one model and the cost model it is judged by."""

    max_step_ms: float = 0.0  # 0: no fixed target
    min_prefill_tokens: int = 32
    cost: StepCost | None = None
    onset: int = ONSET  # 0: every step with a decode is held to the target
    auto: float = 0.0  # without max_step_ms: target this many times the cost of `auto_tokens` decodes (0: none)
    auto_tokens: int = 0  # the decodes the automatic target is sized for (the step's own, if more)

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = StepCost()

    def prefill_tokens(self, decoding: int, budget: int, starting: int = 0) -> int:
        """Prompt tokens a step with `decoding` one-token decodes may add, within the step's token
        `budget` (max_num_batched_tokens), when `starting` sequences could take a prompt chunk in it;
        all of it when there is no target, no fit yet, or at most one decode per `onset` of those."""
        room = budget - decoding
        target = self.target_ms(decoding)
        if target <= 0 or decoding == 0 or (self.onset and decoding * self.onset <= starting):
            return budget
        allowed = self.cost.tokens_within(target)
        if allowed is None:
            return budget
        return max(0, min(room, max(self.min_prefill_tokens, allowed - decoding)))

    def target_ms(self, decoding: int) -> float:
        """The step-time target of a step with `decoding` decodes: the fixed one, else the automatic one
        (0: none, or no fit yet)."""
        if self.max_step_ms > 0:
            return self.max_step_ms
        return self.auto * self.cost.predict(max(decoding, self.auto_tokens)) if self.auto > 0 else 0.0
