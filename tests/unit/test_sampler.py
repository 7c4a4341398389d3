"""Next-token sampling: filters keep the right tokens and seeds make draws reproducible."""

from __future__ import annotations

import torch

from server.backends.llm.sampler import _filtered_probs, sample
from server.scheduling.sequence import SamplingParams
from tests.conftest import approx_fp32

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])


def test_greedy_is_argmax_for_every_row():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0], torch.Generator()) == [1, 0]


def test_top_k_and_top_p_keep_only_the_head_of_the_distribution():
    probs = _filtered_probs(LOGITS, [SamplingParams(temperature=1.0, top_k=2)])
    # renormalized: two exps and a division, whose last bit depends on the CPU's exp (0.91 unrenormalized)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == approx_fp32(1.0)
    full = LOGITS.softmax(-1)[0]
    probs = _filtered_probs(LOGITS, [SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01))])
    assert (probs[0, 2:] == 0).all() and (probs[0, :2] > 0).all()  # the smallest prefix reaching top_p
    probs = _filtered_probs(LOGITS, [SamplingParams(temperature=1.0, top_p=0.01)])
    assert probs[0, 0] == 1.0  # the most likely token always survives; alone, exactly exp(0) / exp(0)


def test_seeded_draws_depend_on_seed_and_position_only():
    logits = torch.zeros(1, 1000)  # uniform: any token is possible
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample(logits, [params], [p], torch.Generator().manual_seed(p)) for p in range(8)]
    again = [sample(torch.cat([torch.zeros(1, 1000), logits]), [SamplingParams(), params], [0, p],
                    torch.Generator().manual_seed(99))[1] for p in range(8)]  # another row in the batch
    assert [f[0] for f in first] == again
    other = [sample(logits, [SamplingParams(temperature=1.0, seed=43)], [p], torch.Generator())[0] for p in range(8)]
    assert other != again


def test_a_row_with_an_unusable_distribution_falls_back_to_argmax_alone():
    """One row's NaN temperature, NaN logits or empty filter must not raise for the rows beside it."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 1.0], [float("nan")] * 3, [1.0, 2.0, 8.0], [3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=float("nan")), SamplingParams(temperature=1e-40),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=-3),
              SamplingParams(temperature=1.0, seed=7)]
    chosen = sample(logits, params, [0] * 5, torch.Generator().manual_seed(0))
    assert chosen[:2] == [1, 0] and chosen[3] == 2  # unusable rows keep their argmax
    assert 0 <= chosen[2] < 3 and 0 <= chosen[4] < 3
    tiny = _filtered_probs(torch.tensor([[1.0, 3.0, 2.0]]), [SamplingParams(temperature=1e-30)])
    assert torch.isfinite(tiny).all() and tiny[0, 1] == 1.0  # a tiny temperature is as good as greedy (exp(0), exactly)


def test_penalties_count_per_row_and_extreme_values_never_raise():
    from server.backends.llm.sampler import History, choose

    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]] * 4)
    histories = [History([0, 0, 3], 1), History([0, 0, 3], 1), History([2], 1), History([1], 1)]
    params = [SamplingParams(frequency_penalty=0.2), SamplingParams(presence_penalty=0.05, logprobs=2),
              SamplingParams(repetition_penalty=3e38, temperature=1.0), SamplingParams(min_tokens=5, stop_token_ids=(0,))]
    chosen, logprobs = choose(logits, params, [3, 3, 1, 1], torch.Generator().manual_seed(0), histories, (1,))
    assert chosen[0] == 1  # token 0 once in the output: 2.0 - 0.2 < 1.9
    assert chosen[1] == 0  # presence 0.05 leaves it first
    assert 0 <= chosen[2] < 4  # an overflowing penalty falls back instead of raising
    assert chosen[3] == 3  # eos (1) and the stop id (0) are held back until min_tokens; 3 beats -1
    assert set(logprobs) == {1} and logprobs[1].rank == 1 and [t for t, _ in logprobs[1].top] == [0, 1]
