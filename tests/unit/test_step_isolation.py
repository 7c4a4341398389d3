"""A raising generation step, isolated: the real scheduler and block pool, a model step that raises
whenever it is fed a poisoned prompt token (as a model that cannot handle one input would)."""

from __future__ import annotations

import math

from server.runners.step_isolation import run_step_isolated
from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings, StepPlan
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence, SeqStatus

POISON = 999


class PoisonedStep:
    """Samples `token` for every entry that catches up; raises for a whole pass that feeds POISON.
    Records what each pass saw, so the test can check re-runs fed the same positions."""

    def __init__(self, token: int = 7):
        self.token = token
        self.passes: list[list[tuple[int, int, int]]] = []  # (seq_id, num_computed, n) per entry

    def __call__(self, plan: StepPlan) -> dict[int, int]:
        self.passes.append([(s.seq_id, s.num_computed, n) for s, n in plan.entries])
        for s, n in plan.entries:
            if POISON in s.token_ids[s.num_computed : s.num_computed + n]:
                raise IndexError("index out of range in self")
        return {s.seq_id: self.token for s, n in plan.entries if s.num_computed + n == s.num_tokens}


def make(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id, list(prompt), len(prompt), SamplingParams(max_tokens=4))


def scheduler() -> ContinuousScheduler:
    return ContinuousScheduler(ContinuousSettings(16, 256, 256, 100, 0), KVBlockPool(64, 4))


def test_only_the_poisoned_sequence_fails_and_the_rest_advance_as_one_step_would():
    s = scheduler()
    seqs = [make(i, [1 + i, 2, 3, 4, 5][: 2 + i % 4]) for i in range(8)]
    seqs[5].token_ids[1] = POISON
    for q in seqs:
        s.submit(q)
    plan = s.schedule()
    assert len(plan.entries) == 8
    step = PoisonedStep()
    outcome = run_step_isolated(step, plan)

    assert [q for q, _ in outcome.failed] == [seqs[5]] and isinstance(outcome.failed[0][1], IndexError)
    assert [q for q, _ in outcome.ran.entries] == [q for q in seqs if q is not seqs[5]]  # plan order kept
    assert outcome.sampled == {q.seq_id: 7 for q in seqs if q is not seqs[5]}
    assert 0 < outcome.reruns <= 2 * math.ceil(math.log2(8)) and len(step.passes) == outcome.reruns + 1
    # Every pass fed each sequence the same positions: nothing advanced before postprocess.
    fed = {(sid, first, n) for p in step.passes for sid, first, n in p}
    assert fed == {(q.seq_id, 0, q.prompt_len) for q in seqs}

    for q, _ in outcome.failed:  # what the runner does
        s.finish(q, "error")
    s.postprocess(outcome.ran, outcome.sampled)
    s.pool.check()
    assert seqs[5].status is SeqStatus.FINISHED and seqs[5].block_table == [] and seqs[5] not in s.running
    for q in seqs:
        if q is not seqs[5]:
            assert q.num_computed == q.prompt_len and q.output_ids == [7] and q.status is SeqStatus.RUNNING

    # The survivors go on from where one clean step would have left them.
    plan = s.schedule()
    assert sorted((q.seq_id, n) for q, n in plan.entries) == sorted((q.seq_id, 1) for q in seqs if q is not seqs[5])
    again = run_step_isolated(PoisonedStep(8), plan)
    assert again.reruns == 0 and not again.failed
    s.postprocess(again.ran, again.sampled)
    for q in seqs:
        if q is not seqs[5]:
            s.finish(q, "length")
    s.pool.check()
    assert s.pool.num_used == 0


def test_a_clean_step_runs_once_and_a_fault_every_entry_raises_fails_them_all():
    s = scheduler()
    seqs = [make(i, [1, 2, 3]) for i in range(4)]
    for q in seqs:
        s.submit(q)
    plan = s.schedule()
    step = PoisonedStep()
    clean = run_step_isolated(step, plan)
    assert clean.reruns == 0 and len(step.passes) == 1 and clean.ran.entries == plan.entries

    def broken(plan: StepPlan) -> dict[int, int]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    everyone = run_step_isolated(broken, plan)
    assert [q for q, _ in everyone.failed] == seqs and not everyone.ran and everyone.reruns == 2 * (len(seqs) - 1)
