"""An unload walks the whole heap only where a cycle keeps the unloaded model.

Handing the parked heap back to the collector stalled the event loop 75-95 ms on every explicit unload
or reload (server/heap.py). The registry watches what each backend holds (its ONNX session, its torch
module) through weak references: a model that reference counting frees costs no collection at all, and
one that a cycle among parked objects keeps is still freed by the full one."""

from __future__ import annotations

import asyncio
import gc

from server import heap
from server.app import ServerConfig
from server.engine import build_engine
from tests import builders


class Trap:
    """A reference cycle that also keeps whatever it is handed: only the cycle collector frees it."""

    def __init__(self, kept):
        self.me, self.kept = self, kept


def _repository(root):
    builders.add_sub(root / "onnx_m" / "1" / "model.onnx")
    builders.torch_affine(root / "torch_m" / "1")
    (root / "torch_m" / "config.yaml").write_text("backend: pytorch\n" + builders.TORCH_AFFINE_CONFIG)


def _unloads(root, trapped: str | None) -> tuple[list[int], list]:
    """Load both models, park the heap as `serve` does after start-up, unload both; the collections of the
    oldest generation during the unloads, and weak references to what the models held."""
    seen: list[int] = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(info["generation"])

    async def main():
        engine = build_engine(ServerConfig(model_repository=root, metrics_port=None))
        registry = engine.registry
        for name in ("onnx_m", "torch_m"):
            await registry.load(name)
        held = {name: [obj for b in registry.get(name).backends for obj in b.held()] for name in ("onnx_m", "torch_m")}
        assert all(held.values())  # each backend names what holds its weights
        watched = heap.watch(held["onnx_m"] + held["torch_m"])
        trap = Trap(held[trapped]) if trapped is not None else None
        del held
        heap.park()  # the trap is parked with the rest; unreachable from here on, only a full collection frees it
        del trap
        gc.callbacks.append(count)
        try:
            for name in ("onnx_m", "torch_m"):
                await registry.unload(name)
        finally:
            gc.callbacks.remove(count)
        await engine.close(0)
        return watched

    try:
        watched = asyncio.run(main())
    finally:
        heap.unpark()
    return seen, watched


def test_unloading_models_reference_counting_frees_walks_nothing(tmp_path):
    _repository(tmp_path)
    seen, watched = _unloads(tmp_path, trapped=None)
    assert all(ref() is None for ref in watched)  # session and module freed by the unloads
    assert seen == []  # and no full collection ran for it


def test_a_model_a_parked_cycle_keeps_is_still_freed_by_its_unload(tmp_path):
    _repository(tmp_path)
    seen, watched = _unloads(tmp_path, trapped="onnx_m")
    assert all(ref() is None for ref in watched)  # the trapped session too: the full collection ran
    assert seen  # at least once
