"""The guided search: a few seed points, then one step at a time around the best one, within a budget.

1. A/A: the served config is measured twice before anything changes. The spread between the two is
   the noise of this machine under this load; any later difference smaller than it is a tie.
2. Seeds: a coarse grid over batch size x window (space.seeds), plus the user's own `--candidate`s.
3. Refinement: every neighbour of the best candidate (one knob one step, space.neighbours) is
   measured; a neighbour that beats the best by more than the noise becomes the best, and its own
   neighbours are next. The search stops when every neighbour of the best has been measured (no
   measurement left could change the answer), or when the next one would not fit in the budget.
4. Confirmation: the served config and the winner are measured once more, one after the other. If
   the second reading demotes the winner, the search goes on around the new best (step 3) and
   confirms that one; the winner is kept only if it still beats the served config by more than the noise.
5. Budget left over is spent where the answer can still change: more readings (up to three each) of
   the candidates the best does not beat by more than the noise, the fewest-read first; a reading that
   changes the best sends the search back to step 3.
6. The pick: among the best and the candidates it does not beat by more than the noise (read as often,
   within every bound), the one with the lowest p99 (`roomiest`). Their throughput is a tie, so what is
   left to choose on is the room under the bound: on the heavy encoder the best by a hair read p99 174 ms
   in the search and 207 ms in the bench's final rounds, over its 200 ms bound, where a tied candidate
   had more room (bench/RESULTS.md 2026-12-07).

Each candidate is applied by hot reload (target.apply); one that fails to load is recorded with the
server's reason and skipped (the server keeps serving the config before it). When the search ends the
served config is loaded again: nothing changes for the model's clients unless the caller applies the winner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from clients.tune import space
from clients.tune.measure import Load, measure
from clients.tune.target import Target
from protos import model_config_pb2 as mc

NOISE_FLOOR = 0.03  # differences below 3% are ties however quiet the A/A pair looked
MAX_READINGS = 3  # readings of one candidate the leftover budget may buy
CONFIRMATION = 2  # measurements of the confirmation pair, kept free of the budget while exploring


@dataclass(frozen=True)
class Objective:
    """`throughput` (requests/s; output tokens/s for generation), or `latency` (request p99; inter-token
    p99 for generation), under optional p99 bounds in ms. Errors make a candidate infeasible."""

    kind: str = "throughput"
    p99_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    generation: bool = False

    def throughput(self, row: dict) -> float:
        return (row.get("output_tokens_per_s") if self.generation else row.get("throughput_rps")) or 0.0

    def latency(self, row: dict) -> float:
        value = row.get("itl_p99_ms") if self.generation else row.get("latency_p99_ms")
        return float("inf") if value is None else value

    def excess(self, row: dict) -> float:
        """How far past its bounds a measurement is (0: within all of them)."""
        if row.get("errors") or not row.get("completed"):
            return float("inf")
        over = 0.0
        for key, bound in (("latency_p99_ms", self.p99_ms), ("ttft_p99_ms", self.ttft_p99_ms),
                           ("itl_p99_ms", self.itl_p99_ms)):
            if bound is not None:
                value = row.get(key)
                over += float("inf") if value is None else max(0.0, value / bound - 1)
        return over

    def metric(self, row: dict) -> float:
        """Higher is better."""
        return self.throughput(row) if self.kind == "throughput" else -self.latency(row)

    def beats(self, a: dict, b: dict, noise: float) -> bool:
        """`a` is clearly better than `b`: within bounds where `b` is not, or further from them by a margin,
        or better on the objective by more than the noise."""
        ea, eb = self.excess(a), self.excess(b)
        if ea == 0 < eb:
            return True
        if ea > 0 or eb > 0:
            return ea < eb * (1 - noise) if eb != float("inf") else ea < eb
        ma, mb = self.metric(a), self.metric(b)
        return ma > mb + abs(mb) * noise


@dataclass
class Candidate:
    knobs: space.Knobs
    label: str = ""
    rows: list[dict] = field(default_factory=list)
    error: str = ""  # why it did not load

    @property
    def summary(self) -> dict:
        """The mean of its measurements (one row; counts summed)."""
        if not self.rows:
            return {}
        out = dict(self.rows[-1])
        for k, v in self.rows[-1].items():
            values = [r.get(k) for r in self.rows]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(isinstance(x, (int, float)) for x in values):
                out[k] = round(sum(values) / len(values), 3)
        out["errors"] = sum(r.get("errors") or 0 for r in self.rows)
        return out


@dataclass
class Outcome:
    current: Candidate
    winner: Candidate
    candidates: list[Candidate]
    noise: float
    tie: bool  # the winner is the served config, or not clearly better than it
    elapsed_s: float


class Search:
    def __init__(self, target: Target, model: str, base: mc.ModelConfig, load: Load,
                 objective: Objective, budget_s: float, max_candidates: int | None = None,
                 extra: list[space.Knobs] = (), latency_target_ms: float = 50.0, noise_floor: float = NOISE_FLOOR,
                 log: Callable[[str], None] = print):
        self.target, self.model, self.base, self.load = target, model, base, load
        self.objective, self.budget_s, self.max_candidates = objective, budget_s, max_candidates
        self.extra, self.latency_target_ms, self.noise_floor, self.log = list(extra), latency_target_ms, noise_floor, log
        self.generation = space.is_generation(base)
        self.candidates: dict[tuple, Candidate] = {}
        self.costs: list[float] = []
        self.t0 = time.monotonic()

    # -- budget ---------------------------------------------------------------------------------
    def _fits(self, new: bool = True, measurements: int = 1) -> bool:
        """`measurements` more fit in the budget left at the mean cost so far, and a `new` candidate fits
        within --max-candidates (the served config is not counted; re-measuring one is not a new one)."""
        if new and self.max_candidates is not None and len(self.candidates) > self.max_candidates:
            return False
        cost = sum(self.costs) / len(self.costs) if self.costs else 0.0
        reserve = CONFIRMATION if new else 0  # a new candidate may win: keep room to measure it again
        return time.monotonic() - self.t0 + cost * (measurements + reserve) <= self.budget_s

    # -- one candidate --------------------------------------------------------------------------
    def _config(self, knobs: space.Knobs) -> mc.ModelConfig:
        return space.apply(self.base, knobs, self.latency_target_ms)

    def _try(self, knobs: space.Knobs, label: str = "") -> Candidate | None:
        """Measure `knobs` once, if not measured yet and the budget allows; None otherwise."""
        k = space.key(knobs)
        if k in self.candidates or not self._fits():
            return None
        candidate = self.candidates[k] = Candidate(knobs, label)
        start = time.monotonic()
        candidate.error = self.target.apply(self.model, self._config(knobs))
        if candidate.error:
            self.log(f"  {space.summary(knobs)}: did not load, skipped: {candidate.error}")
        else:
            candidate.rows.append(measure(self.target, self.load))
            self.log(f"  {space.summary(knobs)}: {self._shown(candidate.rows[-1])}")
        self.costs.append(time.monotonic() - start)
        return candidate

    def _shown(self, row: dict) -> str:
        rate = f"{self.objective.throughput(row):.1f} {'tokens' if self.generation else 'req'}/s"
        return f"{rate}, p99 {row.get('latency_p99_ms') or float('nan'):.1f} ms, errors {row.get('errors')}"

    def _best(self) -> Candidate:
        best = None
        for candidate in self.candidates.values():
            if candidate.rows and (best is None or self.objective.beats(candidate.summary, best.summary, 0.0)):
                best = candidate
        return best

    # -- the search -----------------------------------------------------------------------------
    def run(self) -> Outcome:
        current = self._baseline()
        for knobs in self.extra:
            self._try(knobs, "given")
        for knobs in space.seeds(current.knobs, self.generation, self.load.clients, self.load.largest):
            self._try(knobs, "seed")
        confirmed: set[int] = set()
        while True:
            self._refine()
            best = self._best()
            if id(best) not in confirmed and self._confirm(current, best):
                confirmed.add(id(best))
                if self._best() is not best:
                    continue  # the second reading demoted it: refine around the new best, and confirm that
            if not self._settle(best):
                break
        best = roomiest(self._best(), self.candidates.values(), self.objective, self.noise)
        winner = best if self.objective.beats(best.summary, current.summary, self.noise) else current
        tie = winner is current
        restored = self.target.apply(self.model, self.base)  # the served config again until the caller applies one
        if restored:
            self.log(f"warning: reloading the served config after the search failed: {restored}")
        return Outcome(current, winner, list(self.candidates.values()), self.noise, tie, time.monotonic() - self.t0)

    def _baseline(self) -> Candidate:
        """A/A: the served config, as it is served (no reload), measured twice."""
        knobs = space.current(self.base)
        current = self.candidates[space.key(knobs)] = Candidate(knobs, "current")
        for _ in range(2):
            start = time.monotonic()
            current.rows.append(measure(self.target, self.load))
            self.costs.append(time.monotonic() - start)
            self.log(f"  {space.summary(knobs)} (current): {self._shown(current.rows[-1])}")
        a, b = (self.objective.metric(r) for r in current.rows)
        spread = abs(a - b) / max(abs(a + b) / 2, 1e-9) if all(map(_finite, (a, b))) else 1.0
        self.noise = max(self.noise_floor, spread)
        self.log(f"  A/A spread {spread:.1%}: differences under {self.noise:.1%} count as ties")
        return current

    def _refine(self) -> None:
        while self._fits():
            best = self._best()
            if best is None:
                return
            pending = [k for k in space.neighbours(best.knobs, self.generation, self.load.clients,
                                                        self.load.largest)
                       if space.key(k) not in self.candidates]
            if not pending:
                return  # every step from the best measured: nothing left can change the answer
            if self._try(pending[0], "refine") is None:
                return

    def _settle(self, best: Candidate) -> bool:
        """Budget left once the neighbourhood is measured goes where the answer can still change: one more
        reading of the candidate, among the best and those it does not clearly beat, with the fewest
        readings (at most MAX_READINGS each). False when there is none, or no budget."""
        open_ = [c for c in self.candidates.values() if c.rows and len(c.rows) < MAX_READINGS
                 and (c is best or not self.objective.beats(best.summary, c.summary, self.noise))]
        if not open_ or not self._fits(new=False):
            return False
        candidate = min(open_, key=lambda c: len(c.rows))
        config = self.base if candidate.label == "current" else self._config(candidate.knobs)
        if self.target.apply(self.model, config):
            return False
        candidate.rows.append(measure(self.target, self.load))
        self.log(f"  {space.summary(candidate.knobs)} (within the noise of the best, again): "
                 f"{self._shown(candidate.rows[-1])}")
        return True

    def _confirm(self, current: Candidate, winner: Candidate) -> bool:
        """Served config and winner once more, back to back, so a lucky first reading does not decide;
        False when there was nothing to confirm or no budget left for it."""
        if winner is current or not winner.rows or not self._fits(new=False, measurements=CONFIRMATION):
            return False
        for candidate, config in ((current, self.base), (winner, self._config(winner.knobs))):
            if self.target.apply(self.model, config):
                return False
            candidate.rows.append(measure(self.target, self.load))
            self.log(f"  {space.summary(candidate.knobs)} (again): {self._shown(candidate.rows[-1])}")
        return True


def roomiest(best: Candidate, candidates, objective: Objective, noise: float) -> Candidate:
    """The lowest-p99 candidate among `best` and those tied with it on throughput (within the noise), read
    as often as it and within every bound; `best` itself when it is outside a bound or the objective is
    latency (then it already is the lowest)."""
    if best is None or objective.kind != "throughput" or objective.excess(best.summary) > 0:
        return best
    tied = [c for c in candidates if c.rows and len(c.rows) >= min(len(best.rows), MAX_READINGS)
            and objective.excess(c.summary) == 0 and not objective.beats(best.summary, c.summary, noise)]
    return min(tied + [best], key=lambda c: (objective.latency(c.summary), c is not best))


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
