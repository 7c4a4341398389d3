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
default). Its unit is the stall prompts may add to a decode's wait, summed over the streams decoding:
a full batch of streams (`auto_tokens`, the scheduler passes max_num_seqs) may each wait AUTO - 1
times what the batch's decodes cost for prompt work, and fewer streams share that same total, so each
of d streams may wait max_num_seqs / d times as long. So no step of a full batch lasts more than AUTO
times what its decodes cost, and the fewer the streams a long prompt would stall, the more of it goes
in one step: chunking a prompt does not shrink the wait it causes, it spreads the wait over more
steps, each repeating the step's fixed cost, and delays the prompt's own first token by as many steps.
The full batch is priced on the line that charges every token alike (StepCost.alike: it extrapolates
to a full batch steadily). (A fixed number of milliseconds is right for one model on one machine only:
50 ms is a stall for a small model and a crawl for a large one. Two other automatic targets were
measured: AUTO times a full batch's cost whatever the streams, which with 2-4 streams cut a 250-token
prompt into three chunks and raised Poisson arrivals' time to first token p99 by ~40% and their
inter-token p99 too (more steps carried a chunk); and AUTO times the step's own decodes, which leaves
prompts a sliver of each step while few streams run, worse still.)

NOTE: the cost model is step_ms = fixed + per_decode * decodes + per_prompt * prompt_tokens, fitted by
least squares over exponentially decayed past steps (recent steps count most, so it follows load and
context growth). Decodes and prompt tokens are priced apart because they cost differently: a decode
is a row of its own through the step's per-sequence work (its attention over its whole context, its
sampling), a prompt token shares its sequence's; on the benchmark model a decode costs about twice a
prompt token, and one price for both had mid-sized steps of mostly decodes run 20-35% over the
target. Both prices can be told apart only while both counts vary, and not in step with each other;
otherwise a count that holds still is charged at its last price told apart (the other is fitted
after it), and before any was told apart every token is charged alike (one line over all tokens).
While every recent step had about the same size the slope cannot be told from the intercept either;
then the whole cost is charged per token (a line through 0), which overestimates the slope and so
errs towards smaller chunks. One step is counted at most twice its predicted cost, so a lone stall
(the machine busy elsewhere) does not cut every chunk to the minimum for the next dozen steps; while
the line goes through 0, a step smaller than the average is predicted at the average step's cost (a
line through 0 would charge it none of the fixed part and count its honest cost as a stall).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

DECAY = 0.9  # weight of the past at each new step: about the last 10-20 steps shape the fit
STALL = 2.0  # a step counts at most this many times its predicted cost: a real slowdown is still
# followed within a few steps, a one-off stall moves the fit by a bounded amount
ONSET = 4  # prompts waiting per decode from which a step is bounded by the token budget only
AUTO = 1.5  # the automatic target: this many times the cost of a full batch of decodes (2 until the
# prices were told apart; then 1.5 cut the issue-33 burst's inter-token p99 without costing tokens/s:
# docs/architecture.md "Generation step cost", round 5)
_FLAT = 1.0  # tokens^2: a decayed variance of a count below this cannot fix its price
_TOGETHER = 0.98  # squared correlation of the two counts above which they move together: one price for both
_EPS = 1e-9  # ms: a fixed part this far below 0 is rounding, not a misfit


class Line(NamedTuple):
    fixed: float  # ms a step costs whatever it computes
    per_decode: float  # ms per sequence fed its one pending token
    per_prompt: float  # ms per prompt-chunk or draft token

    def cost(self, decodes: int, prompt_tokens: int = 0) -> float:
        return self.fixed + self.per_decode * decodes + self.per_prompt * prompt_tokens


_NONE = Line(0.0, 0.0, 0.0)


class StepCost:
    """Online fit of step_ms = fixed + per_decode * decodes + per_prompt * prompt_tokens from measured steps."""

    def __init__(self, decay: float = DECAY):
        self.decay = decay
        # decayed sums of 1, d, p, ms, d*d, p*p, d*p, d*ms, p*ms (d: decodes, p: prompt tokens)
        self._sums = [0.0] * 9
        self._prices: tuple[float, float] | None = None  # the last (per_decode, per_prompt) told apart
        self._line = self._alike_line = _NONE  # the fits as of the last step observed

    @property
    def fitted(self) -> bool:
        return self._sums[0] > 0

    def observe(self, decodes: int, prompt_tokens: int, ms: float) -> None:
        """Fold in one step that fed `decodes` sequences one token and `prompt_tokens` more (prompt
        chunks, drafts), and took `ms` milliseconds."""
        if decodes < 0 or prompt_tokens < 0 or decodes + prompt_tokens == 0 or not math.isfinite(ms) or ms < 0:
            return
        if self.fitted:  # a lone stall (another process took the cores) must not shrink chunks for many steps
            ms = min(ms, STALL * self._expected(decodes, prompt_tokens))
        d, p, k, sums = decodes, prompt_tokens, self.decay, self._sums
        for i, value in enumerate((1, d, p, ms, d * d, p * p, d * p, d * ms, p * ms)):
            sums[i] = k * sums[i] + value
        moments = self._moments()
        self._line, self._alike_line = self._fit(moments), self._alike(moments)

    def _expected(self, decodes: int, prompt_tokens: int) -> float:
        """The most a step can plausibly cost by the fit. A line through 0 (no fixed part could be told
        apart yet) charges a small step none of the fixed part, which may be most of its cost; so such a
        step is expected to cost up to what the average step did."""
        expected = self._line.cost(decodes, prompt_tokens)
        return expected if self._line.fixed > 0 else max(expected, self._sums[3] / self._sums[0])

    def _moments(self) -> tuple[float, ...]:
        """Decayed means of d, p, ms; variances of d, p; covariances d-p, d-ms, p-ms."""
        w, sd, sp, sy, sdd, spp, sdp, sdy, spy = self._sums
        md, mp, my = sd / w, sp / w, sy / w
        return (md, mp, my, sdd / w - md * md, spp / w - mp * mp, sdp / w - md * mp, sdy / w - md * my,
                spy / w - mp * my)

    def line(self) -> Line:
        """The current fit; all zeros before any step was seen."""
        return self._line

    def _fit(self, moments: tuple[float, ...]) -> Line:
        """Solve for the prices, remembering them when both can be told apart."""
        md, mp, my, vd, vp, cdp, cdy, cpy = moments
        if vd >= _FLAT and vp >= _FLAT and cdp * cdp <= _TOGETHER * vd * vp:  # both prices can be told apart
            det = vd * vp - cdp * cdp
            a, b = (cdy * vp - cpy * cdp) / det, (cpy * vd - cdy * cdp) / det
            if a > 0 and b > 0 and my - a * md - b * mp >= -_EPS:
                self._prices = (a, b)
                return Line(max(0.0, my - a * md - b * mp), a, b)
        if self._prices is not None:  # a count that holds still keeps its last price; the other is fitted
            a, b = self._prices
            if vd >= _FLAT > vp:
                a = (cdy - b * cdp) / vd
            elif vp >= _FLAT > vd:
                b = (cpy - a * cdp) / vp
            fixed = my - a * md - b * mp
            if a > 0 and b > 0 and fixed >= -_EPS:
                return Line(max(0.0, fixed), a, b)
        return self._alike(moments)

    def alike(self) -> Line:
        """The fit with every token priced alike (one line over all of them); all zeros before any step.
        Steps of many prompt tokens pin its slope down, so it extrapolates steadily to a batch of
        decodes larger than any seen lately, where the decode price alone, fitted over a few streams,
        does not (one stream's step is cheaper than the line through two or more: 1 to 5 decodes read
        ~4 ms a decode on the benchmark model against ~1 from a burst's 20 to 48)."""
        return self._alike_line

    @staticmethod
    def _alike(moments: tuple[float, ...]) -> Line:
        md, mp, my, vd, vp, cdp, cdy, cpy = moments
        mx, vx, cxy = md + mp, vd + vp + 2 * cdp, cdy + cpy
        if vx >= _FLAT:
            slope = cxy / vx
            if slope > 0 and my - slope * mx >= -_EPS:
                return Line(max(0.0, my - slope * mx), slope, slope)
        return Line(0.0, my / mx, my / mx)

    def predict(self, decodes: int, prompt_tokens: int = 0) -> float:
        """The fitted cost of a step (0 before any step was seen)."""
        return self._line.cost(decodes, prompt_tokens)

    def prompt_tokens_within(self, ms: float, decodes: int) -> int | None:
        """The most prompt tokens a step with `decodes` decodes may add and be predicted to end within
        `ms` (0 if the decodes alone overrun it); None: no fit yet."""
        line = self.line()
        if line.per_prompt <= 0:
            return None
        spare = ms - line.fixed - line.per_decode * decodes
        return max(0, math.floor(spare / line.per_prompt + 1e-6))  # not one token less for rounding


@dataclass(slots=True)
class StepBudget:
    """The step-time target of one model and the cost model it is judged by."""

    max_step_ms: float = 0.0  # 0: no fixed target
    min_prefill_tokens: int = 32
    cost: StepCost | None = None
    onset: int = ONSET  # 0: every step with a decode is held to the target
    auto: float = 0.0  # without max_step_ms: a full batch's steps target this many times its decodes' cost (0: none)
    auto_tokens: int = 0  # the streams of a full batch, whose summed stall fewer streams share (the step's own, if more)

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
        allowed = self.cost.prompt_tokens_within(target, decoding)
        if allowed is None:
            return budget
        return max(0, min(room, max(self.min_prefill_tokens, allowed)))

    def target_ms(self, decoding: int) -> float:
        """The step-time target of a step with `decoding` decodes: the fixed one, else the automatic one
        (0: none, or no fit yet): the decodes' own cost plus their share of the stall a full batch may
        take (see the module's docstring)."""
        if self.max_step_ms > 0:
            return self.max_step_ms
        if self.auto <= 0:
            return 0.0
        full = max(decoding, self.auto_tokens)
        stall = (self.auto - 1) * self.cost.alike().cost(full)  # each stream's share when a full batch runs
        return self.cost.predict(decoding) + stall * full / max(decoding, 1)
