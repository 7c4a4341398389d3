"""The pure parts of bench/peers.py: how rounds become medians, spreads, ratios and orders."""

from bench.peers import describe, rotation, round_ratios, spread


def test_spread_is_median_min_max():
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)


def test_ratios_pair_rounds_and_drop_empty_denominators():
    assert round_ratios([2.0, 3.0, 4.0], [1.0, 0.0, 2.0]) == [2.0, 2.0]


def test_describe_formats_median_and_range():
    assert describe([1.0, 1.5, 1.25]) == "1.25 [1.00-1.50]"
    assert describe([]) == "n/a"


def test_rotation_moves_every_system_to_the_front_in_turn():
    systems = ["a", "b", "c"]
    assert [rotation(systems, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert sorted(rotation(systems, 2)) == systems
