"""CUDA paths, run only where a CUDA device works (a lent GPU machine); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_onnx_runtime_really_gets_the_cuda_provider(tmp_path):
    from protos import model_config_pb2 as mc
    from server.backends.base import Device
    from server.backends.onnx_runtime import OnnxRuntimeBackend
    from tests import builders

    path = builders.add_sub(tmp_path / "m" / "1" / "model.onnx")
    config = mc.ModelConfig(name="m")
    OnnxRuntimeBackend.complete_config(config, path, 4)
    assert OnnxRuntimeBackend.cuda_devices() >= 1
    backend = OnnxRuntimeBackend(config, path, Device("cuda", 0))
    backend.load()
    assert backend.describe()["execution_provider"] == "CUDAExecutionProvider"


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("qwen3", {"head_dim": 24}),
                                               ("mistral", {"sliding_window": 8})])
def test_generation_on_cuda_matches_the_cpu(tmp_path, family, overrides):
    """Qwen3's q/k norms and head_dim, and the sliding-window masks (prompt + output pass the window of 8)."""
    pytest.importorskip("transformers", reason="builds the test model")
    from protos import model_config_pb2 as mc
    from server.backends.base import Device
    from server.backends.llm.engine import LLMBackend
    from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
    from server.scheduling.kv_blocks import KVBlockPool
    from server.scheduling.sequence import SamplingParams, Sequence
    from tests.llm_builders import build_model

    folder = build_model(tmp_path / "m" / "1", family, **overrides)
    outputs = {}
    for device in (Device("cpu"), Device("cuda", 0)):
        config = mc.ModelConfig(name="m", backend="llm")
        config.generation.block_size, config.generation.num_kv_blocks, config.generation.dtype = 4, 128, "float32"
        backend = LLMBackend(config, folder / "config.json", device)
        backend.load()
        scheduler = ContinuousScheduler(ContinuousSettings(max_num_batched_tokens=32), KVBlockPool(128, 4))
        seqs = [Sequence(i, [5 + i, 17, 42, 99], 4, SamplingParams(max_tokens=10)) for i in range(4)]
        for seq in seqs:
            scheduler.submit(seq)
        while scheduler.running or scheduler.num_waiting:
            plan = scheduler.schedule()
            scheduler.postprocess(plan, backend.step(plan))
            for seq in list(scheduler.running):
                if seq.num_output >= 10:
                    scheduler.finish(seq, "length")
        outputs[device.kind] = [s.output_ids for s in seqs]
    assert outputs["cuda"] == outputs["cpu"]


def test_kv_pool_sized_from_gpu_memory_when_not_given(tmp_path):
    pytest.importorskip("transformers", reason="builds the test model")
    from protos import model_config_pb2 as mc
    from server.backends.base import Device
    from server.backends.llm.engine import LLMBackend
    from tests.llm_builders import build_model

    folder = build_model(tmp_path / "m" / "1")
    config = mc.ModelConfig(name="m", backend="llm")
    config.generation.gpu_memory_utilization = 0.5
    backend = LLMBackend(config, folder / "config.json", Device("cuda", 0))
    backend.load()
    free, total = torch.cuda.mem_get_info(0)
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in backend.caches)
    assert backend.num_kv_blocks > 1000 and kv_bytes <= total * 0.5
