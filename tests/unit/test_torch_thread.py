"""Generation models on the CPU load and step on one thread shared by all of them (torch_thread.py), so the
process holds one OpenMP team; on CUDA each model keeps a step thread of its own."""

from __future__ import annotations

import threading

from protos import model_config_pb2 as mc
from server.backends.base import Device
from server.backends.llm import torch_thread
from server.backends.llm.engine import LLMBackend
from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence
from tests import llm_builders

CPU = Device("cpu")


def spied_backend(folder, seen: dict, name: str) -> LLMBackend:
    """A real backend whose load and steps note the thread they ran on."""
    config = mc.ModelConfig(name=name, backend="llm")
    config.generation.num_kv_blocks, config.generation.block_size = 16, 4
    backend = LLMBackend(config, folder / "config.json", CPU)
    load, step = backend._load, backend.step
    backend._load = lambda: (seen.setdefault(f"{name} load", threading.get_ident()), load())[1]
    backend.step = lambda plan: (seen.setdefault(f"{name} step", threading.get_ident()), step(plan))[1]
    return backend


def test_cpu_models_load_and_step_on_the_one_shared_thread(tmp_path):
    folder = llm_builders.build_model(tmp_path / "llama" / "1")
    seen: dict[str, int] = {}
    first, second = spied_backend(folder, seen, "a"), spied_backend(folder, seen, "b")
    first.load()  # called here, run there
    second.load()
    for backend in (first, second):
        executor, owned = torch_thread.step_thread(backend.device, "unused")
        assert not owned
        scheduler = ContinuousScheduler(ContinuousSettings(max_model_len=64), KVBlockPool(16, 4))
        scheduler.submit(Sequence(1, [5, 6, 7], 3, SamplingParams(max_tokens=2)))
        sampled = executor.submit(backend.step, scheduler.schedule()).result()
        assert set(sampled) == {1}  # a real step ran and sampled the sequence's next token
    shared = torch_thread.shared().submit(threading.get_ident).result()
    assert shared != threading.get_ident()
    assert seen == {"a load": shared, "b load": shared, "a step": shared, "b step": shared}


def test_work_handed_to_the_shared_thread_from_itself_runs_inline():
    """A load started on the shared thread (a model loaded by another's step) must not wait on itself."""
    inner = torch_thread.shared().submit(torch_thread.run, CPU, threading.get_ident).result(timeout=30)
    assert inner == torch_thread.shared().submit(threading.get_ident).result()


def test_a_cuda_model_steps_on_a_thread_of_its_own_and_loads_where_it_is_called():
    first, owned = torch_thread.step_thread(Device("cuda", 0), "m-1-llm")
    second, _ = torch_thread.step_thread(Device("cuda", 0), "n-1-llm")
    try:
        assert owned and first is not second and first is not torch_thread.shared()
        assert torch_thread.run(Device("cuda", 0), threading.get_ident) == threading.get_ident()
    finally:
        first.shutdown()
        second.shutdown()
