"""Check an ensemble's `ensemble_scheduling` on its own, before anything runs.

What can be checked from the ensemble's config alone is checked at load, naming the step and the
tensor: every step names a model and maps its tensors, every step input is an ensemble input or an
earlier step's output, every ensemble output is produced. Whether the step models exist and accept
those tensors is known only when a request runs (models load and unload independently), so the
runner checks that then, naming the step.
"""

from __future__ import annotations

from protos import model_config_pb2 as mc
from server.repository.config import field_error

ENSEMBLE = "ensemble"


def is_ensemble(config: mc.ModelConfig) -> bool:
    return config.platform == ENSEMBLE or config.backend == ENSEMBLE


def step_order(config: mc.ModelConfig, source: str) -> list[int]:
    """Step indexes in an order where every step's inputs exist before it runs; raises ConfigError."""
    steps = config.ensemble_scheduling.step
    if not steps:
        raise field_error(source, "ensemble_scheduling.step", "is empty; an ensemble needs at least one step")
    available = {t.name for t in config.input}
    _check_steps(config, available, source)
    order, ready = [], set(available)
    while len(order) < len(steps):
        runnable = [i for i, s in enumerate(steps) if i not in order and set(s.input_map.values()) <= ready]
        if not runnable:
            i = next(i for i in range(len(steps)) if i not in order)
            missing = sorted(set(steps[i].input_map.values()) - ready)
            raise field_error(source, f"ensemble_scheduling.step[{i}].input_map",
                              f"reads {missing}, which no ensemble input or other step provides (or steps form a cycle)")
        for i in runnable:
            order.append(i)
            ready.update(steps[i].output_map.values())
    for tensor in config.output:
        if tensor.name not in ready:
            raise field_error(source, "output", f"'{tensor.name}' is produced by no step's output_map")
    return order


def _check_steps(config: mc.ModelConfig, available: set[str], source: str) -> None:
    """Each step names a model other than the ensemble and writes tensors nobody else writes."""
    written: set[str] = set()
    for i, step in enumerate(config.ensemble_scheduling.step):
        where = f"ensemble_scheduling.step[{i}]"
        if not step.model_name:
            raise field_error(source, f"{where}.model_name", "is missing")
        if step.model_name == config.name:
            raise field_error(source, f"{where}.model_name", "names the ensemble itself")
        if not step.output_map:
            raise field_error(source, f"{where}.output_map", f"is empty: step {i} (model '{step.model_name}') produces nothing")
        for tensor in step.output_map.values():
            if tensor in available or tensor in written:
                raise field_error(source, f"{where}.output_map", f"writes tensor '{tensor}' that already has a value")
            written.add(tensor)
