"""`ferry batch` runs generation throughput first: the in-process engine drops the automatic step-time
target (nobody waits on a token), so a step refills the batch with every waiting prompt the token
budget holds; a target the model's config sets is kept."""

from __future__ import annotations

from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence
from server.scheduling.step_budget import AUTO

_ids = iter(range(10**6))


def seq(prompt_len: int) -> Sequence:
    return Sequence(next(_ids), list(range(1, prompt_len + 1)), prompt_len, SamplingParams(max_tokens=64))


def decoding_batch(max_step_ms: float = 0.0) -> ContinuousScheduler:
    """16 sequences decoding, a cost fit of 5 ms + 0.5 ms a token, 8 prompts of 40 tokens waiting."""
    settings = ContinuousSettings(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=512,
                                  max_step_ms=max_step_ms, auto_step_target=0.0 if max_step_ms else AUTO,
                                  min_prefill_tokens=4)
    s = ContinuousScheduler(settings, KVBlockPool(1024, 16))
    for _ in range(16):
        s.submit(seq(8))
    plan = s.schedule()
    s.postprocess(plan, {q.seq_id: 7 for q, _ in plan.entries})
    for tokens in (10, 200, 40, 90, 3, 400):
        s.step_budget.cost.observe(0, tokens, 5.0 + 0.5 * tokens)
    for _ in range(8):
        s.submit(seq(40))
    return s


def prompt_tokens(plan) -> int:
    return sum(n for _, n in plan.entries if n > 1)


def test_the_automatic_target_holds_prompts_back_while_sequences_decode():
    s = decoding_batch()
    # a full batch of 32 may each wait (AUTO - 1) x (5 + 0.5 x 32) ms for prompts; the 16 decoding share
    # that total, twice as long each, at 0.5 ms a prompt token
    held = int((AUTO - 1) * (5.0 + 0.5 * 32) * 32 / 16 / 0.5)
    assert 0 < held < 8 * 40 and prompt_tokens(s.schedule()) == held


def test_throughput_first_admits_every_waiting_prompt_the_token_budget_holds():
    s = decoding_batch()
    s.throughput_first()
    plan = s.schedule()
    assert prompt_tokens(plan) == 8 * 40
    assert len(s.running) == 24 and s.num_waiting == 0


def test_throughput_first_keeps_a_target_the_config_sets():
    s = decoding_batch(max_step_ms=30.0)
    s.throughput_first()
    assert prompt_tokens(s.schedule()) == 34  # 30 ms holds 50 tokens: 16 decodes and 34 prompt tokens
