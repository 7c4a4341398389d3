"""ferry tune's search space and objective, without a server: what a candidate changes in a config,
which points the search may step to, and when one measurement beats another."""

from __future__ import annotations

import pytest

from clients.tune import space
from clients.tune.cli import parse_budget
from clients.tune.search import Candidate, Objective, roomiest
from protos import model_config_pb2 as mc


def batching_config() -> mc.ModelConfig:
    config = mc.ModelConfig(name="m", max_batch_size=4, backend="onnxruntime")
    config.input.add(name="X", data_type=mc.TYPE_FP32, dims=[16])
    config.dynamic_batching.max_queue_delay_microseconds = 100
    return config


def test_apply_sets_the_knobs_and_keeps_the_rest():
    base = batching_config()
    knobs = {**space.current(base), "max_batch_size": 32, "window": space.ADAPTIVE, "preferred": [32], "instances": 2}
    config = space.apply(base, knobs, latency_target_ms=30)
    assert config.max_batch_size == 32 and config.input == base.input and config.backend == "onnxruntime"
    assert config.dynamic_batching.latency_target_ms == 30 and config.dynamic_batching.max_queue_delay_microseconds == 0
    assert list(config.dynamic_batching.preferred_batch_size) == [32]
    assert [g.count for g in config.instance_group] == [2]
    assert space.current(config) == knobs
    assert base.max_batch_size == 4  # the base is not changed
    fixed = space.apply(config, {**knobs, "window": 2000}, 30)
    assert fixed.dynamic_batching.max_queue_delay_microseconds == 2000 and fixed.dynamic_batching.latency_target_ms == 0
    assert not space.apply(config, {**knobs, "window": None}, 30).HasField("dynamic_batching")


def test_generation_knobs():
    base = mc.ModelConfig(name="llm", backend="llm")
    base.generation.block_size = 4
    knobs = space.current(base)
    assert knobs == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_step_ms": 0.0}
    config = space.apply(base, {**knobs, "max_num_seqs": 8, "max_step_ms": 25.0}, 50)
    assert (config.generation.max_num_seqs, config.generation.max_step_ms, config.generation.block_size) == (8, 25.0, 4)
    steps = space.neighbours(knobs, True, 16)
    assert {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_step_ms": 0.0} in steps
    assert all(sum(a != knobs[k] for k, a in s.items()) == 1 for s in steps)  # one knob one step


def test_seeds_and_neighbours_never_go_below_the_largest_request_or_above_the_rows_in_flight():
    knobs = space.current(batching_config())
    for seed in space.seeds(knobs, False, clients=2, largest=4):
        assert seed["max_batch_size"] >= 4
    sizes = {s["max_batch_size"] for s in space.neighbours({**knobs, "max_batch_size": 8}, False, clients=2, largest=4)}
    assert sizes == {4, 8}  # 16 could never fill with two requests of four rows
    assert {s["max_batch_size"] for s in space.seeds(knobs, False, clients=64)} == {64, 16}


def test_candidate_text():
    base = space.current(batching_config())
    knobs = space.parse("max_batch_size=16,window=adaptive,preferred=8/16", False, base)
    assert (knobs["max_batch_size"], knobs["window"], knobs["preferred"], knobs["instances"]) == (16, "adaptive", [8, 16], 1)
    with pytest.raises(ValueError, match="KEY one of"):
        space.parse("max_num_seqs=4", False, base)
    with pytest.raises(ValueError, match="not a valid value"):
        space.parse("max_batch_size=big", False, base)
    assert space.summary(knobs) == "bs 16 win adaptive pref 8/16 x1"


def test_budget_text():
    assert [parse_budget(t) for t in ("90", "90s", "5m", "1.5h")] == [90, 90, 300, 5400]
    with pytest.raises(ValueError):
        parse_budget("soon")


def test_objective_prefers_within_the_bound_then_throughput_beyond_the_noise():
    objective = Objective("throughput", p99_ms=30)
    within = {"throughput_rps": 100.0, "latency_p99_ms": 25.0, "errors": 0, "completed": 10}
    faster_over = {"throughput_rps": 300.0, "latency_p99_ms": 45.0, "errors": 0, "completed": 10}
    slightly_better = {**within, "throughput_rps": 102.0}
    clearly_better = {**within, "throughput_rps": 120.0}
    failing = {**clearly_better, "errors": 1}
    assert objective.beats(within, faster_over, 0.05) and not objective.beats(faster_over, within, 0.05)
    assert not objective.beats(slightly_better, within, 0.05)  # a tie: within the noise
    assert objective.beats(clearly_better, within, 0.05)
    assert not objective.beats(failing, within, 0.05) and objective.beats(within, failing, 0.05)
    latency = Objective("latency")
    assert latency.beats({**within, "latency_p99_ms": 10.0}, within, 0.05)


def test_the_pick_among_throughput_ties_is_the_one_with_most_room_under_the_bound():
    objective = Objective("throughput", p99_ms=200)

    def candidate(rps, p99, readings=3, bs=32):
        row = {"throughput_rps": rps, "latency_p99_ms": p99, "errors": 0, "completed": 100}
        return Candidate(space.Knobs(max_batch_size=bs), rows=[row] * readings)

    best = candidate(492, 174)
    tied_roomier = candidate(480, 161, bs=64)
    tied_but_once = candidate(485, 120, readings=1, bs=16)  # fewer readings than the best: not trusted yet
    slower = candidate(300, 90, bs=8)  # more room, but clearly less throughput
    over = candidate(495, 230, bs=4)
    pool = [best, tied_roomier, tied_but_once, slower, over]
    assert roomiest(best, pool, objective, 0.1) is tied_roomier
    assert roomiest(best, pool, objective, 0.01) is best  # with less noise 480 is no tie with 492
    assert roomiest(over, pool, objective, 0.1) is over  # a best outside the bound is left to the excess ordering
    assert roomiest(best, pool, Objective("latency", p99_ms=200), 0.1) is best
