"""The byte budget: admitted request data is bounded per model and for the whole server."""

from __future__ import annotations

import pytest

from server.errors import QueueFullError
from server.scheduling.budget import ByteBudget


def test_a_model_cannot_take_more_than_its_own_or_the_servers_limit():
    server = ByteBudget(100, "the server")
    a, b = ByteBudget(60, "model 'a'", server), ByteBudget(0, "model 'b'", server)
    a.take(50)
    with pytest.raises(QueueFullError, match="model 'a'"):
        a.take(20)  # 70 > a's 60
    b.take(40)
    with pytest.raises(QueueFullError, match="the server"):
        b.take(20)  # 50 + 40 + 20 > the server's 100
    assert (a.held, b.held, server.held) == (50, 40, 90)  # a refusal holds nothing anywhere
    a.give(50)
    b.take(20)
    assert (a.held, b.held, server.held) == (0, 60, 60)


def test_zero_means_unlimited():
    budget = ByteBudget(0, "the server")
    budget.take(2**40)
    assert budget.held == 2**40
