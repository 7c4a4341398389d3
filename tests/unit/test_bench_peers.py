"""The pure parts of bench/peers.py: how rounds become medians, spreads, ratios and orders."""

from bench.peers import ADAPTIVE, CONTROL, FERRY, best_fixed, describe, ferry_systems, rotation, round_ratios, spread


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


def test_ferry_variants_name_one_model_each_and_the_control_reuses_the_adaptive_one():
    assert ferry_systems([1.0], control=False) == {FERRY: "", ADAPTIVE: "_adaptive"}
    systems = ferry_systems([1.0, 8.0, 0.5], control=True)
    assert systems == {FERRY: "", "Ferry 8 ms": "_w8", "Ferry 0.5 ms": "_w0p5", ADAPTIVE: "_adaptive", CONTROL: "_adaptive"}


def test_the_best_fixed_window_is_the_fixed_variant_with_the_highest_median():
    systems = ferry_systems([1.0, 8.0], control=True)
    runs = {FERRY: [{"rps": r} for r in (100, 300, 110)], "Ferry 8 ms": [{"rps": r} for r in (200, 190, 210)],
            ADAPTIVE: [{"rps": 999}] * 3, CONTROL: [{"rps": 999}] * 3}
    assert best_fixed(runs, systems) == "Ferry 8 ms"  # the 1 ms window's one fast round does not make it best
