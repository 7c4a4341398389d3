"""A generation step that raises fails only the sequences that make it raise; the others go on.

A step runs many clients' sequences in one forward pass, so one sequence the model cannot handle
must not fail the others. When a step over several sequences raises, its entries run again as two
halves, recursively, until each raising sequence is alone. Re-running is safe because a step only
writes K/V at each entry's own new positions (num_computed .. num_computed + n) in that sequence's
own blocks, and nothing advances until the scheduler's postprocess: a re-run rewrites the same slots
from the same inputs, and garbage a raising pass left there is overwritten before anyone reads it.

Cost, only on the failure path: one raising sequence among n costs at most 2·ceil(log2 n) extra
passes, each over half the entries of the one before (about one more step's worth of tokens in all,
but on a GPU each pass reads every weight again, so in decode it costs about that many step
latencies). A fault that every entry raises (not caused by any one sequence) costs 2(n - 1) passes
and fails them all. Unseeded random sampling draws again in a re-run, so a sampled (not greedy,
not seeded) sequence may pick a different token than the raising pass would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from server.scheduling.continuous import StepPlan
from server.scheduling.sequence import Sequence

Step = Callable[[StepPlan], dict[int, int | list[int]]]


@dataclass(slots=True)
class StepOutcome:
    """What a step came to: the tokens of the entries that ran, and the sequences that raised alone."""

    ran: StepPlan  # the entries that ran, in the plan's order: what postprocess must see
    sampled: dict[int, int | list[int]] = field(default_factory=dict)  # seq_id -> token(s), for entries in `ran`
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)
    reruns: int = 0  # passes beyond the first, spent finding the raising sequences


def run_step_isolated(step: Step, plan: StepPlan) -> StepOutcome:
    """Run `plan`; if it raises, run its halves (depth first, in plan order) until each raising entry is alone."""
    sampled: dict[int, int | list[int]] = {}
    failed: list[tuple[Sequence, Exception]] = []
    reruns = 0
    parts = [plan.entries]
    while parts:
        entries = parts.pop()
        try:
            sampled.update(step(StepPlan(entries, plan.drafts)))
        except Exception as exc:  # noqa: BLE001 - whatever the model raised, it fails this part only
            if len(entries) == 1:
                failed.append((entries[0][0], exc))
                continue
            half = len(entries) // 2
            parts += [entries[half:], entries[:half]]  # the first half is popped first
            reruns += 2
    gone = {id(seq) for seq, _ in failed}
    ran = StepPlan([entry for entry in plan.entries if id(entry[0]) not in gone], plan.drafts)
    return StepOutcome(ran, sampled, failed, reruns)
