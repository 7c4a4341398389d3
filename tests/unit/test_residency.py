"""The memory budget's bookkeeping (which models to evict, what a footprint is) and the rate limiter's
resource counting, without a server."""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from server.errors import ConfigError, ResourceExhaustedError
from server.repository import footprint
from server.repository.footprint import Footprint
from server.repository.residency import Residency, parse_budget
from server.runners.settings import instance_needs
from server.scheduling.rate_limiter import GLOBAL, Need, RateLimiter, parse_resource

MiB = 2**20


@pytest.mark.parametrize("text, nbytes", [("512MiB", 512 * MiB), ("2GB", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30)),
                                          ("1048576", MiB), (" 10 mib ", 10 * MiB)])
def test_sizes(text, nbytes):
    assert footprint.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "lots", "10XB", "-5MiB", "MiB"])
def test_bad_sizes_name_the_text(text):
    with pytest.raises(ValueError, match="is not a size|names no size"):
        parse_budget([text])


def test_budget_places():
    assert parse_budget(["8GiB", "cuda:0=30GiB,cuda:1=1GiB"]) == {"host": 8 * 2**30, "cuda:0": 30 * 2**30, "cuda:1": 2**30}
    with pytest.raises(ValueError, match="not a place"):
        parse_budget(["gpu0=1GiB"])


def test_declared_footprint_and_its_errors():
    config = mc.ModelConfig()
    assert footprint.declared(config, "m/config.pbtxt") is None
    config.parameters["memory_bytes"].string_value = "host=200MiB,cuda:0=3GiB"
    assert footprint.declared(config, "m").bytes_by_place == {"host": 200 * MiB, "cuda:0": 3 * 2**30}
    config.parameters["memory_bytes"].string_value = "a lot"
    with pytest.raises(ConfigError, match="m/config.pbtxt: parameter memory_bytes"):
        footprint.declared(config, "m/config.pbtxt")


def test_measured_takes_the_larger_host_growth_and_each_device():
    before = {"host": 100, "_heap": 50, "cuda:0": 1000}
    after = {"host": 110, "_heap": 80, "cuda:0": 1600}
    assert footprint.measured(before, after).bytes_by_place == {"host": 30, "cuda:0": 600}
    assert footprint.measured(after, before).bytes_by_place == {"host": 0, "cuda:0": 0}  # never negative


def _config(**params: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    for key, value in params.items():
        config.parameters[key].string_value = value
    return config


def test_plan_evicts_least_recently_used_idle_unpinned_first():
    residency = Residency({"host": 50 * MiB})
    for name in "abcde":
        residency.admit(name, Footprint({"host": 10 * MiB}), _config(pinned="true") if name == "a" else None)
    residency.touch("b")  # b is now the most recently used
    busy = {"c"}
    assert residency.plan("f", Footprint({"host": 20 * MiB}), lambda n: n not in busy) == ["d", "e"]
    with pytest.raises(ResourceExhaustedError, match="can be freed"):  # a pinned, c busy, the rest cannot make 45 MiB
        residency.plan("g", Footprint({"host": 45 * MiB}), lambda n: n not in busy)
    with pytest.raises(ResourceExhaustedError, match="even with every other model unloaded"):
        residency.plan("h", Footprint({"host": 51 * MiB}), lambda n: True)


def test_eviction_priority_comes_before_recency():
    residency = Residency({"host": 20 * MiB})
    residency.admit("old_but_important", Footprint({"host": 10 * MiB}), _config(eviction_priority="5"))
    residency.admit("new", Footprint({"host": 10 * MiB}), None)
    assert residency.plan("x", Footprint({"host": 10 * MiB}), lambda n: True) == ["new"]


def test_device_budgets_are_separate_from_host():
    residency = Residency({"host": 100 * MiB, "cuda:0": 10 * MiB})
    residency.admit("gpu", Footprint({"host": MiB, "cuda:0": 8 * MiB}), None)
    assert residency.plan("cpu_only", Footprint({"host": 50 * MiB}), lambda n: True) == []
    assert residency.plan("gpu2", Footprint({"host": MiB, "cuda:0": 4 * MiB}), lambda n: True) == ["gpu"]


def test_rate_limiter_counts_per_device_and_reserves_for_the_better_priority():
    limiter = RateLimiter({("R", None): 1})
    cpu, low, high = Need(((("R", "cpu"), 1),), 0), Need(((("R", "cpu"), 1),), 5), Need(((("R", "cpu"), 1),), 1)
    gpu = Need(((("R", "cuda:0"), 1),))
    assert limiter.try_acquire(cpu) and not limiter.try_acquire(low)
    assert limiter.try_acquire(gpu)  # another device's R
    granted = []
    limiter.wait("low", low, lambda: granted.append("low"))
    limiter.wait("high", high, lambda: granted.append("high"))
    limiter.release(cpu)
    assert granted == ["high"]  # reserved for it: the releasing side cannot take it back
    assert not limiter.try_acquire(cpu)
    limiter.release(high)
    assert granted == ["high", "low"]


def test_unnamed_resources_count_the_largest_ask_and_global_ones_span_devices():
    config = mc.ModelConfig()
    group = config.instance_group.add(count=2)
    group.rate_limiter.resources.add(name="R", count=2)
    shared = group.rate_limiter.resources.add(name="G", count=1)
    setattr(shared, "global", True)
    group.rate_limiter.priority = 3
    needs = instance_needs(config, [0, 0], ["cuda:0", "cuda:1"])
    assert needs[0] == Need(((("R", "cuda:0"), 2), (("G", GLOBAL), 1)), 3)
    limiter = RateLimiter()
    limiter.register(needs)
    assert limiter.capacity(("R", "cuda:0")) == 2 and limiter.capacity(("G", GLOBAL)) == 1
    assert limiter.try_acquire(needs[0]) and not limiter.try_acquire(needs[1])  # G is one for both devices


def test_rate_limit_resource_flag():
    assert parse_resource("R1:4") == (("R1", None), 4)
    assert parse_resource("R1:1:0") == (("R1", "cuda:0"), 1)
    assert parse_resource("R1:2:global") == (("R1", GLOBAL), 2)
    for bad in ("R1", "R1:x", "R1:1:gpu"):
        with pytest.raises(ValueError):
            parse_resource(bad)


def test_a_busy_model_colder_than_the_victim_is_named():
    """The load waits for these: evicting the hot idle model while a one-off model is busy costs the hot one."""
    residency = Residency({"host": 30 * MiB})
    for name in ("hot1", "hot2", "oneoff"):
        residency.admit(name, Footprint({"host": 10 * MiB}), None)
    for name in ("hot1", "hot2", "hot1", "hot2", "oneoff"):
        residency.touch(name)
    busy = {"oneoff"}
    victims = residency.plan("next", Footprint({"host": 10 * MiB}), lambda n: n not in busy)
    assert victims == ["hot1"]
    assert residency.colder_busy(victims, lambda n: n not in busy) == ["oneoff"]
    assert residency.plan("next", Footprint({"host": 10 * MiB}), lambda n: True) == ["oneoff"]
    assert residency.colder_busy(["oneoff"], lambda n: n not in {"hot1"}) == []  # a hotter busy one is no reason


def test_a_steadily_requested_model_outranks_one_with_two_requests_just_now():
    """Ranked by the second-to-last request (LRU-2), `tail` (two requests in a row, just now) would stay and
    `hot` (ten, spread out) would go; the decayed count keeps the hot one."""
    residency = Residency({"host": 20 * MiB})
    for name in ("hot", "tail"):
        residency.admit(name, Footprint({"host": 10 * MiB}), None)
    for i in range(10):
        residency.touch("hot")
        residency.touch(f"other{i}")
    residency.touch("tail")
    residency.touch("tail")
    assert residency.heat("hot") > residency.heat("tail") > 0
    assert residency.plan("new", Footprint({"host": 10 * MiB}), lambda n: True) == ["tail"]


def test_a_model_nobody_asks_for_any_more_fades_below_a_recent_one_off():
    from server.repository.residency import HALF_LIFE

    residency = Residency({"host": 20 * MiB})
    for name in ("was_hot", "one_off"):
        residency.admit(name, Footprint({"host": 10 * MiB}), None)
    for _ in range(50):
        residency.touch("was_hot")
    for _ in range(8 * HALF_LIFE):  # other models' traffic: 8 half-lives, 50 requests weigh 50 / 256 now
        residency.touch("elsewhere")
    residency.touch("one_off")
    assert residency.heat("was_hot") < 1 <= residency.heat("one_off")
    assert residency.plan("new", Footprint({"host": 10 * MiB}), lambda n: True) == ["was_hot"]


def test_load_turns_go_to_the_hottest_waiting_but_never_keep_one_waiting_past_the_bound():
    import asyncio

    from server.repository.on_demand import LoadTurns

    async def scenario() -> list[str]:
        now = [0.0]
        turns, order, gate = LoadTurns(starve_s=2.0, clock=lambda: now[0]), [], asyncio.Event()

        async def load(name: str, heat: float, asked: asyncio.Event, hold: asyncio.Event | None = None) -> None:
            asked.set()  # from here to its first wait for the turn nothing yields: queued when the test resumes
            async with turns.turn(heat):
                order.append(name)
                now[0] += 0.5  # each load takes half a second of the test's clock
                if hold is not None:
                    await hold.wait()

        async def start(name: str, heat: float, hold: asyncio.Event | None = None) -> asyncio.Task:
            asked = asyncio.Event()
            task = asyncio.create_task(load(name, heat, asked, hold))
            await asked.wait()
            return task

        tasks = [await start("first", 0, gate)]  # holds the turn until the gate opens
        for name, heat in (("cold", 0.5), ("warm", 3), ("hot", 9), ("hot2", 9), ("hot3", 9), ("hot4", 9), ("hot5", 9)):
            tasks.append(await start(name, heat))
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return order

    # hotter first, whatever the line's depth; once cold and warm have waited 2 s (they queued while first
    # ran; hot to hot4 took half a second each) they go first, in arrival order, before the hot one left
    assert asyncio.run(scenario()) == ["first", "hot", "hot2", "hot3", "hot4", "cold", "warm", "hot5"]
