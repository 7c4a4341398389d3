"""One prepared check for a session lent a GPU: the CUDA paths work and what they deliver.

    python -m bench.cuda_check            # on the GPU machine; on a CPU-only machine it says so and exits 0

1. runs tests/gpu (ORT really gets the CUDA provider; generation on CUDA equals the CPU's tokens);
2. raw ONNX Runtime throughput of the heavy benchmark model, CUDA provider vs CPU, at batch 1..128;
3. generation on CUDA in bf16 with a 6-layer random Llama: output tokens/s for 1, 16 and 64 sequences
   decoding together (the continuous-batching engine in process, no gRPC).
Prints a table; with --record appends it to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import common, models


def ort_rates(path: Path, providers: list[str]) -> dict[int, float]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=providers)
    rates = {}
    for size in (1, 8, 32, 128):
        x = np.random.default_rng(0).standard_normal((size, 32, 512)).astype(np.float32)
        session.run(None, {"x": x})
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.0:
            session.run(None, {"x": x})
            runs += 1
        rates[size] = runs * size / (time.perf_counter() - start)
    return rates


def generation_rates(folder: Path) -> dict[int, float]:
    from protos import model_config_pb2 as mc
    from server.backends.base import Device
    from server.backends.llm.engine import LLMBackend
    from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
    from server.scheduling.kv_blocks import KVBlockPool
    from server.scheduling.sequence import SamplingParams, Sequence

    config = mc.ModelConfig(name="bench", backend="llm")
    config.generation.block_size, config.generation.num_kv_blocks, config.generation.dtype = 16, 4096, "bfloat16"
    backend = LLMBackend(config, folder / "config.json", Device("cuda", 0))
    backend.load()
    rates = {}
    for count in (1, 16, 64):
        scheduler = ContinuousScheduler(ContinuousSettings(max_num_seqs=64, max_num_batched_tokens=8192,
                                                           max_model_len=1024), KVBlockPool(4096, 16))
        for i in range(count):
            scheduler.submit(Sequence(i, list(range(2, 66)), 64, SamplingParams(max_tokens=128, ignore_eos=True)))
        start, tokens = time.perf_counter(), 0
        while scheduler.running or scheduler.num_waiting:
            plan = scheduler.schedule()
            sampled = backend.step(plan)
            scheduler.postprocess(plan, sampled)
            tokens += len(sampled)
            for seq in list(scheduler.running):
                if seq.num_output >= 128:
                    scheduler.finish(seq, "length")
        rates[count] = tokens / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check")
        return
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=common.ROOT, capture_output=True, text=True)
    lines = [f"GPU: {torch.cuda.get_device_name(0)}", f"tests/gpu: {tests.stdout.strip().splitlines()[-1]}"]
    with tempfile.TemporaryDirectory() as tmp:
        heavy = models.heavy_encoder(Path(tmp) / "heavy.onnx")
        cpu, cuda = ort_rates(heavy, ["CPUExecutionProvider"]), ort_rates(heavy, ["CUDAExecutionProvider"])
        lines.append("ONNX Runtime heavy model rows/s, batch: CPU / CUDA = " + ", ".join(
            f"{b}: {cpu[b]:.0f} / {cuda[b]:.0f}" for b in cpu))
        from bench.generation import build_model

        folder = Path(tmp) / "llm" / "1"
        build_model(folder)
        gen = generation_rates(folder)
        lines.append("generation on CUDA (bf16), output tokens/s by sequences decoding together: " + ", ".join(
            f"{n}: {r:.0f}" for n, r in gen.items()))
    report = "\n".join(f"- {line}" for line in lines)
    print(report)
    if args.record:
        common.append_results("CUDA check (bench/cuda_check.py)", report)


if __name__ == "__main__":
    main()
