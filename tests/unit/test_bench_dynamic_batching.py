"""The pure parts of bench/dynamic_batching.py: how a point's runs become the adaptive window's verdict."""

from bench.dynamic_batching import margin_table, verdict


def test_the_p99_target_is_judged_only_where_the_bare_floor_meets_it():
    assert verdict(1.0, 40.0, 50, floor_p99_ms=30.0) == "ok"
    assert verdict(1.0, 60.0, 50, floor_p99_ms=30.0) == "MISS (p99)"
    assert verdict(1.0, 60.0, 50, floor_p99_ms=55.0).startswith("ok (p99 out of reach")
    assert verdict(1.0, 60.0, 50, floor_p99_ms=None) == "MISS (p99)"  # no floor measured: no excuse
    assert verdict(0.96, 10.0, 50, floor_p99_ms=5.0) == "MISS (req/s)"  # out-of-reach p99 never excuses req/s


def test_the_margin_table_compares_adaptive_and_its_control_with_the_best_fixed_window():
    def row(policy, rps, runs):
        return {"model": "light", "policy": policy, "concurrency": 64, "throughput_rps": rps, "p99_ms": 40.0,
                "server_ms": 7.0, "runs": runs}
    rows = [row("fixed 2ms", 900.0, "850/900/950"), row("fixed 8ms", 1000.0, "990/1000/1010"),
            row("adaptive (50 ms)", 980.0, "960/980/1020"), row("adaptive again (50 ms)", 1010.0, "1000/1010/1020")]
    (line,) = [x for x in margin_table(rows, [64], {64: 20.0}).splitlines() if x.startswith("| light")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:6] == ["fixed 8ms", "0.980", "0.96/0.98/1.02", "1.00/1.01/1.02"]
    assert cells[-1] == "ok"
