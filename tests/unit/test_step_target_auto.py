"""The automatic step-time target (step_budget.py): with no max_step_ms, a full batch of decodes (or a
larger one) is held to AUTO times its fitted cost, and fewer streams share the same summed stall, so
each may wait longer for prompts; it is the server's default (runners/settings.py)."""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from server.runners.settings import generation_settings
from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.step_budget import AUTO, StepBudget


def fitted(budget: StepBudget, fixed: float = 5.0, per_token: float = 0.5) -> StepBudget:
    for tokens in (10, 200, 40, 90, 3, 400):
        budget.cost.observe(0, tokens, fixed + per_token * tokens)
    return budget


def test_the_automatic_target_is_a_multiple_of_the_decodes_own_cost():
    budget = fitted(StepBudget(auto=2.0, min_prefill_tokens=4))
    assert budget.target_ms(20) == pytest.approx(2.0 * (5.0 + 0.5 * 20))
    # 30 ms holds (30 - 5) / 0.5 = 50 tokens: 20 decodes and 30 prompt tokens
    assert budget.prefill_tokens(decoding=20, budget=512, starting=1) == 30
    # a larger batch of streams gets a longer step, prompts the same share of it
    assert budget.prefill_tokens(decoding=60, budget=512, starting=1) == 70  # 70 ms: 130 tokens, 60 of them decodes


def test_fewer_streams_share_a_full_batchs_stall_so_each_waits_longer_for_prompts():
    budget = fitted(StepBudget(auto=2.0, auto_tokens=64, min_prefill_tokens=4))
    stall = (2.0 - 1) * (5.0 + 0.5 * 64)  # 37 ms for each of 64 streams: 74 prompt tokens in a full batch's step
    assert budget.target_ms(64) == pytest.approx(2.0 * (5.0 + 0.5 * 64))
    assert budget.prefill_tokens(decoding=64, budget=1024, starting=1) == 74
    assert budget.target_ms(32) == pytest.approx(5.0 + 0.5 * 32 + stall * 2)  # half the streams, twice the wait each
    assert budget.prefill_tokens(decoding=32, budget=1024, starting=1) == 148
    # four streams may each wait 16 times a full batch's share: a 256-token prompt goes in one step
    assert budget.prefill_tokens(decoding=4, budget=512, starting=1) == 512 - 4
    assert budget.target_ms(100) == pytest.approx(2.0 * (5.0 + 0.5 * 100))  # more streams than that: their own


def test_the_scheduler_sizes_the_automatic_target_for_its_max_num_seqs():
    settings = ContinuousSettings(max_num_seqs=48, auto_step_target=AUTO)
    budget = ContinuousScheduler(settings, KVBlockPool(64, 4)).step_budget
    assert (budget.auto, budget.auto_tokens, budget.max_step_ms) == (AUTO, 48, 0.0)


def test_a_fixed_target_wins_over_the_automatic_one_and_none_means_none():
    assert fitted(StepBudget(max_step_ms=65.0, auto=2.0)).target_ms(20) == 65.0
    unset = fitted(StepBudget())
    assert unset.target_ms(20) == 0.0 and unset.prefill_tokens(20, 512, 1) == 512


def test_before_any_step_is_measured_nothing_is_held():
    assert StepBudget(auto=2.0).prefill_tokens(decoding=20, budget=512, starting=1) == 512


def test_the_server_default_is_the_automatic_target_and_a_configured_one_replaces_it():
    default = generation_settings(mc.ModelGeneration(), 128, 50).continuous
    assert (default.max_step_ms, default.auto_step_target) == (0.0, AUTO)
    fixed = generation_settings(mc.ModelGeneration(max_step_ms=45.5), 128, 50).continuous
    assert (fixed.max_step_ms, fixed.auto_step_target) == (45.5, 0.0)


def test_a_full_batch_is_priced_on_the_line_over_all_tokens_not_on_a_few_streams_decode_price():
    """One stream's step is cheaper than the line through two or more (the issue-33 burst's tail: 1 to 5
    decodes read ~4 ms a decode, a burst's 20 to 48 ~1), so the decode price fitted while few streams run
    would put a full batch of 64 at several times its cost, and the stall it may take with it."""
    budget = StepBudget(auto=2.0, auto_tokens=64)
    budget.cost.observe(0, 1000, 30.0 + 0.25 * 1000)  # a prompt step
    for decodes, ms in ((1, 18.0), (2, 29.0), (3, 32.0), (4, 33.0), (5, 38.0)) * 4:
        budget.cost.observe(decodes, 0, ms)
    steep, alike = budget.cost.line(), budget.cost.alike()
    assert steep.per_decode > 3.0  # what the tail alone says
    stall = budget.target_ms(64) - steep.cost(64)
    assert stall == pytest.approx(alike.cost(64))
    assert stall < 0.5 * steep.cost(64)
