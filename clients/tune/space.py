"""What `ferry tune` may change in a model's config, and how one candidate differs from the served one.

A candidate is a small dict of knobs (`Knobs`), applied on top of the config the server reports for
the model, so every field the tuner does not own (inputs, outputs, optimization, warm-up, parameters)
stays as the user wrote it. Batching models: max_batch_size, the window (a fixed
max_queue_delay_microseconds, or Ferry's adaptive latency_target_ms), preferred_batch_size and the
instance count. Generation models: max_num_seqs, max_num_batched_tokens (the token budget of a step)
and max_step_ms (the step time target).

The search moves one knob one step at a time along these ladders (`neighbours`), so it can walk from
any seed to any point of the space while measuring only the points next to the best one so far.
"""

from __future__ import annotations

import copy
import os

from protos import model_config_pb2 as mc

Knobs = dict  # knob name -> value; a frozen, hashable form is `key(knobs)`

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WINDOWS_US = (0, 250, 500, 1000, 2000, 4000, 8000, 16000)
INSTANCES = (1, 2, 3, 4, 6, 8)
MAX_NUM_SEQS = (2, 4, 8, 16, 32, 64, 128, 256)
STEP_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)
STEP_MS = (0.0, 10.0, 25.0, 50.0, 100.0, 200.0)
ADAPTIVE = "adaptive"  # the window knob's value for latency_target_ms

BATCHING_KNOBS = ("max_batch_size", "window", "preferred", "instances")
GENERATION_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "max_step_ms")
INTEGER_KNOBS = {"max_batch_size", "instances", "max_num_seqs", "max_num_batched_tokens"}


def is_generation(config: mc.ModelConfig) -> bool:
    return config.HasField("generation") or config.backend == "llm"


def key(knobs: Knobs) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in knobs.items()))


def current(config: mc.ModelConfig) -> Knobs:
    """The knobs of the config being served, in the search's terms."""
    if is_generation(config):
        g = config.generation
        return {"max_num_seqs": g.max_num_seqs or 64, "max_num_batched_tokens": g.max_num_batched_tokens or 2048,
                "max_step_ms": float(g.max_step_ms)}
    knobs = {"max_batch_size": config.max_batch_size, "instances": _instances(config)}
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        knobs["window"] = ADAPTIVE if db.latency_target_ms > 0 else int(db.max_queue_delay_microseconds)
        knobs["preferred"] = list(db.preferred_batch_size)
    else:
        knobs["window"] = None  # no dynamic batcher: every request runs alone
        knobs["preferred"] = []
    return knobs


def _instances(config: mc.ModelConfig) -> int:
    return sum(g.count or 1 for g in config.instance_group) or 1


def apply(base: mc.ModelConfig, knobs: Knobs, latency_target_ms: float) -> mc.ModelConfig:
    """`base` with `knobs` set; `latency_target_ms` is what the adaptive window is given."""
    config = copy.deepcopy(base)
    if is_generation(config):
        g = config.generation
        for name in GENERATION_KNOBS:
            if name in knobs:
                setattr(g, name, knobs[name])
        return config
    if "max_batch_size" in knobs:
        config.max_batch_size = knobs["max_batch_size"]
    if "instances" in knobs:
        if not config.instance_group:
            config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU)
        del config.instance_group[1:]
        config.instance_group[0].count = knobs["instances"]
    window = knobs.get("window", "keep")
    if window is None or config.max_batch_size == 0:
        config.ClearField("dynamic_batching")
        return config
    if window != "keep" or "preferred" in knobs:
        db = config.dynamic_batching
        db.SetInParent()
        if window == ADAPTIVE:
            db.latency_target_ms, db.max_queue_delay_microseconds = latency_target_ms, 0
        elif window != "keep":
            db.latency_target_ms, db.max_queue_delay_microseconds = 0, int(window)
        if "preferred" in knobs:
            del db.preferred_batch_size[:]
            db.preferred_batch_size.extend(knobs["preferred"])
    return config


def seeds(base: Knobs, generation: bool, clients: int, largest: int = 1) -> list[Knobs]:
    """The coarse grid measured first: for batching, small and large batches against no window, a short
    fixed window and the adaptive one; for generation, few and many sequences against a step target.
    `clients`: requests in flight at once; `largest`: the most rows one request carries (no batch size
    below it is tried: the server would refuse those requests)."""
    if generation:
        seqs = _at_most(MAX_NUM_SEQS, max(clients, 2))
        return [{**base, "max_num_seqs": seqs},
                {**base, "max_num_seqs": seqs, "max_step_ms": 50.0},
                {**base, "max_num_seqs": _step(MAX_NUM_SEQS, seqs, -2), "max_num_batched_tokens": 512}]
    floor = _at_least(BATCH_SIZES, largest)
    big = max(_at_most(BATCH_SIZES, max(clients * largest, 1)), floor)
    small = max(_step(BATCH_SIZES, big, -2), floor)
    return [{**base, "max_batch_size": big, "window": 0, "preferred": []},
            {**base, "max_batch_size": big, "window": ADAPTIVE, "preferred": []},
            {**base, "max_batch_size": big, "window": 2000, "preferred": []},
            {**base, "max_batch_size": small, "window": 1000, "preferred": []}]


def neighbours(knobs: Knobs, generation: bool, clients: int, largest: int = 1) -> list[Knobs]:
    """Every candidate one step away along one knob, nearest-to-the-load first."""
    out = []
    if generation:
        for name, ladder in (("max_num_seqs", MAX_NUM_SEQS), ("max_num_batched_tokens", STEP_TOKENS),
                             ("max_step_ms", STEP_MS)):
            out += [{**knobs, name: v} for v in _around(ladder, knobs[name])]
        return out
    cap = _at_least(BATCH_SIZES, max(clients * largest, 1))  # a batch larger than the clients can never fill
    out += [{**knobs, "max_batch_size": v, "preferred": [v] if knobs["preferred"] else []}  # preferred follows the size
            for v in _around(BATCH_SIZES, knobs["max_batch_size"]) if largest <= v <= cap]
    window = knobs["window"]
    if window == ADAPTIVE:
        out += [{**knobs, "window": w} for w in (0, 1000)]
    else:
        out += [{**knobs, "window": w} for w in _around(WINDOWS_US, window or 0)] + [{**knobs, "window": ADAPTIVE}]
    cores = os.cpu_count() or 1
    out += [{**knobs, "instances": v} for v in _around(INSTANCES, knobs["instances"]) if v <= max(cores, 1)]
    preferred = [] if knobs["preferred"] else [knobs["max_batch_size"]]
    out.append({**knobs, "preferred": preferred})
    return out


def _around(ladder: tuple, value) -> list:
    """The ladder's values just below and just above `value` (which need not be on it)."""
    below = [v for v in ladder if v < value]
    above = [v for v in ladder if v > value]
    return [v for v in (below[-1] if below else None, above[0] if above else None) if v is not None]


def _step(ladder: tuple, value, steps: int):
    i = ladder.index(value) if value in ladder else 0
    return ladder[min(max(i + steps, 0), len(ladder) - 1)]


def _at_most(ladder: tuple, value):
    return max([v for v in ladder if v <= value] or [ladder[0]])


def _at_least(ladder: tuple, value):
    return min([v for v in ladder if v >= value] or [ladder[-1]])


def parse(text: str, generation: bool, base: Knobs) -> Knobs:
    """`--candidate KEY=VALUE,...` (e.g. max_batch_size=16,window=2000,preferred=8/16): one more point
    to measure, on top of the served config. Values are checked by the server when it loads them."""
    knobs = dict(base)
    allowed = GENERATION_KNOBS if generation else BATCHING_KNOBS
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in allowed:
            raise ValueError(f"--candidate {text!r}: expected KEY=VALUE pairs with KEY one of {', '.join(allowed)}")
        knobs[name] = _value(name, value.strip(), text)
    return knobs


def _value(name: str, value: str, text: str):
    try:
        if name == "window":
            return None if value == "none" else ADAPTIVE if value == ADAPTIVE else int(value)
        if name == "preferred":
            return [int(v) for v in value.split("/") if v]
        return int(value) if name in INTEGER_KNOBS else float(value)
    except ValueError:
        raise ValueError(f"--candidate {text!r}: {name}={value!r} is not a valid value") from None


def summary(knobs: Knobs) -> str:
    """One short line a table can show: `bs 16 win 2000us pref 16 x2`."""
    if "max_num_seqs" in knobs:
        step = f" step {knobs['max_step_ms']:g}ms" if knobs.get("max_step_ms") else ""
        return f"seqs {knobs['max_num_seqs']} tokens {knobs['max_num_batched_tokens']}{step}"
    window = knobs.get("window")
    shown = "none" if window is None else "adaptive" if window == ADAPTIVE else f"{window}us"
    pref = f" pref {'/'.join(map(str, knobs['preferred']))}" if knobs.get("preferred") else ""
    return f"bs {knobs['max_batch_size']} win {shown}{pref} x{knobs['instances']}"
