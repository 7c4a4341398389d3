"""One prepared check for a session lent a GPU: the CUDA paths work and what they deliver.

    python -m bench.cuda_check [--record]   # first thing on a GPU machine; on a CPU-only one it skips the CUDA parts

Every check prints one line, `PASS|FAIL|SKIP <name>: <figures>`, and the script exits 1 if any failed:
1. device counts: each backend with a CUDA branch (onnx, pytorch, llm) reports as many CUDA devices
   as torch sees (0 here without CUDA, which the loader relies on to refuse KIND_GPU);
2. tests/gpu (ORT really gets the CUDA provider; generation on CUDA equals the CPU's tokens for Llama,
   Qwen3 with its own head_dim, and Mistral decoding past its sliding window);
3. raw ONNX Runtime throughput of the heavy benchmark model, CUDA provider vs CPU, at batch 1..128;
4. generation in bf16 with a 6-layer random Llama: output tokens/s for 1, 16 and 64 sequences
   decoding together (the continuous-batching engine in process, no gRPC);
5. prefix caching (generation.enable_prefix_caching, shared KV blocks): 16 sequences sharing a
   256-token prefix decode the same greedy tokens (float32) with the cache as without, hit the
   cache, and the time of both runs;
6. step isolation (runners/step_isolation.py): a step that raises on one sequence among 8 fails it
   alone in at most 2*ceil(log2 8) re-runs, the other 7 decode what they decode without it.
6b. paged attention kernel (server/backends/llm/paged_kernel.py): on CUDA in bf16 the engine must pick
   PyTorch's paged flash kernel (varlen_attn over the cache in place); 24 sequences of mixed lengths
   decode greedily with it and with the gather + SDPA path, the tokens compared (bf16 kernels may part
   on a near-tie: at least 20/24 identical) and the tokens/s of both. On the CPU the kernel is not
   there: the dry run checks the engine falls back and decodes (its decodes on the in-place CPU decode
   kernel, server/backends/llm/cpu_decode.py, where a C compiler built it).
7. front-end processes (bench/frontends.py's sweep, no CUDA needed but the device machine's cores): the
   light MLP served with --frontend-processes 1, 2, 4, 8 (up to half the cores), closed loop at concurrency
   128 from cores/4 load-generator processes, 2 interleaved rounds of 5 s: req/s and the ratio to N=1 for
   each N, and the engine's loop busy fraction; FAIL if any request failed. On fewer than 8 cores it runs
   N=1 and 2 only, labelled "few cores: direction only". Every N runs on uvloop (the default); one more
   server, N=1 on asyncio's own loop (--event-loop asyncio), shows what uvloop buys where the one loop is
   the limit and spare cores take the load generator.
8. model_warmup (bench/warmup.py, 3 loads): the heavy benchmark model served twice on the GPU
   (KIND_GPU), with a warmup sample of batch 1 run twice per instance and without; each model's first
   request after a load against the median of its next 20, and cold's first over warm's first (what
   warmup saves the first client on CUDA). FAIL if the two answer differently.
Checks 5, 6, 6b and 8 run on the CPU where there is no CUDA, labelled "cpu dry run", so this machine
exercises their code; 2-4 need CUDA and say SKIP. With --record the lines go to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import common, models


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL or SKIP
    figures: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.figures}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ---------------------------------------------------------------- 1-3: devices, tests, ONNX Runtime
def check_device_counts(cuda: bool) -> Outcome:
    import torch

    from server.backends.llm.engine import LLMBackend
    from server.backends.onnx_runtime import OnnxRuntimeBackend
    from server.backends.pytorch import TorchBackend

    expected = torch.cuda.device_count() if cuda else 0
    counts = {cls.name: cls.cuda_devices() for cls in (OnnxRuntimeBackend, TorchBackend, LLMBackend)}
    return Outcome("device counts", verdict(all(n == expected for n in counts.values())),
                   f"torch sees {expected}; " + ", ".join(f"{k}: {v}" for k, v in counts.items()))


def check_gpu_tests(cuda: bool) -> Outcome:
    if not cuda:
        return Outcome("tests/gpu", "SKIP", "no CUDA device")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=common.ROOT, capture_output=True,
                           text=True, timeout=900)
    return Outcome("tests/gpu", verdict(tests.returncode == 0), tests.stdout.strip().splitlines()[-1])


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


def check_ort(cuda: bool, tmp: Path) -> Outcome:
    if not cuda:
        return Outcome("ONNX Runtime CUDA provider", "SKIP", "no CUDA device")
    from server.backends.onnx_runtime import _cuda_works

    heavy = models.heavy_encoder(tmp / "heavy.onnx")
    cpu, gpu = ort_rates(heavy, ["CPUExecutionProvider"]), ort_rates(heavy, ["CUDAExecutionProvider"])
    return Outcome("ONNX Runtime CUDA provider", verdict(_cuda_works()),
                   "heavy model rows/s, batch: CPU / CUDA = " + ", ".join(f"{b}: {cpu[b]:.0f} / {gpu[b]:.0f}" for b in cpu))


# ---------------------------------------------------------------- the generation engine, driven in process
def llm(folder: Path, device, dtype: str, blocks: int = 4096):
    from protos import model_config_pb2 as mc
    from server.backends.llm.engine import LLMBackend

    config = mc.ModelConfig(name="bench", backend="llm")
    config.generation.block_size, config.generation.num_kv_blocks, config.generation.dtype = 16, blocks, dtype
    backend = LLMBackend(config, folder / "config.json", device)
    backend.load()
    return backend


@dataclass
class Decoded:
    tokens: dict[int, list[int]]
    seconds: float
    steps: int
    failed: list[int]
    reruns: int


def decode(backend, pool, prompts: list[list[int]], max_tokens: int, step=None) -> Decoded:
    """Greedy decode of every prompt to exactly `max_tokens`, each step through run_step_isolated as
    the generation runner does, so a step that raises fails only the sequences that make it raise."""
    from server.runners.step_isolation import run_step_isolated
    from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
    from server.scheduling.sequence import SamplingParams, Sequence

    scheduler = ContinuousScheduler(ContinuousSettings(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=1024), pool)
    seqs = [Sequence(i, list(p), len(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.submit(seq)
    failed, reruns, steps, start = [], 0, 0, time.perf_counter()
    while scheduler.running or scheduler.num_waiting:
        plan = scheduler.schedule()
        outcome = run_step_isolated(step or backend.step, plan)
        steps, reruns = steps + 1, reruns + outcome.reruns
        for seq, _ in outcome.failed:
            scheduler.finish(seq, "error")
            failed.append(seq.seq_id)
        scheduler.postprocess(outcome.ran, outcome.sampled)
        for seq in list(scheduler.running):
            if seq.num_output >= max_tokens:
                scheduler.finish(seq, "length")
    return Decoded({s.seq_id: s.token_ids[s.prompt_len:] for s in seqs}, time.perf_counter() - start, steps, failed, reruns)


def check_generation_rates(cuda: bool, folder: Path | None) -> Outcome:
    if not cuda:
        return Outcome("generation tokens/s (bf16)", "SKIP", "no CUDA device")
    from server.backends.base import Device
    from server.scheduling.kv_blocks import KVBlockPool

    backend = llm(folder, Device("cuda", 0), "bfloat16")
    rates = {}
    for count in (1, 16, 64):
        run = decode(backend, KVBlockPool(4096, 16), [list(range(2, 66))] * count, 128)
        rates[count] = sum(len(t) for t in run.tokens.values()) / run.seconds
    backend.unload()
    return Outcome("generation tokens/s (bf16)", verdict(all(r > 0 for r in rates.values())),
                   "output tokens/s by sequences decoding together: " + ", ".join(f"{n}: {r:.0f}" for n, r in rates.items()))


def check_prefix_caching(backend, label: str, max_tokens: int) -> Outcome:
    """With the cache, a warm-up sequence names the shared prefix's blocks; the 16 that follow take them."""
    from server.scheduling.kv_blocks import KVBlockPool

    rng = np.random.default_rng(0)
    prefix = rng.integers(2, 500, 256).tolist()
    prompts = [prefix + rng.integers(2, 500, 16).tolist() for _ in range(16)]
    plain = decode(backend, KVBlockPool(backend.num_kv_blocks, 16, prefix_caching=False), prompts, max_tokens)
    pool = KVBlockPool(backend.num_kv_blocks, 16, prefix_caching=True)
    decode(backend, pool, [prefix + [3]], 1)
    hits_before = pool.cache.stats.hit_tokens
    cached = decode(backend, pool, prompts, max_tokens)
    hit = pool.cache.stats.hit_tokens - hits_before
    same = sum(cached.tokens[i] == plain.tokens[i] for i in range(len(prompts)))
    ok = same == len(prompts) and hit >= 16 * 256
    return Outcome(f"prefix caching ({label})", verdict(ok),
                   f"{same}/16 sequences decode the same tokens with the cache; {hit} prompt tokens from shared blocks "
                   f"(of {16 * 272}); {max_tokens} tokens each in {cached.seconds * 1000:.0f} ms with the cache, "
                   f"{plain.seconds * 1000:.0f} ms without")


def check_step_isolation(backend, label: str, max_tokens: int) -> Outcome:
    """Sequence 3 makes every step it is in raise; the step is split until it is alone."""
    from server.scheduling.kv_blocks import KVBlockPool

    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 500, int(rng.integers(8, 40))).tolist() for _ in range(8)]

    def poisoned(plan):
        if any(seq.seq_id == 3 for seq, _ in plan.entries):
            raise RuntimeError("poisoned sequence")
        return backend.step(plan)

    clean = decode(backend, KVBlockPool(backend.num_kv_blocks, 16), prompts, max_tokens)
    broken = decode(backend, KVBlockPool(backend.num_kv_blocks, 16), prompts, max_tokens, step=poisoned)
    others = [i for i in range(8) if i != 3]
    same = sum(broken.tokens[i] == clean.tokens[i] for i in others)
    bound = 2 * math.ceil(math.log2(8))
    ok = broken.failed == [3] and same == 7 and broken.reruns <= bound
    return Outcome(f"step isolation ({label})", verdict(ok),
                   f"failed {broken.failed} in {broken.reruns} re-runs (bound {bound}); {same}/7 others decode as without it; "
                   f"{broken.steps} steps in {broken.seconds * 1000:.0f} ms vs {clean.steps} in {clean.seconds * 1000:.0f} ms clean")


def check_paged_kernel(backend, label: str, max_tokens: int, cuda: bool) -> Outcome:
    """The same greedy decode with the paged flash kernel and with gather + SDPA (the engine's two paths)."""
    from server.scheduling.kv_blocks import KVBlockPool

    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, 500, int(rng.integers(4, 200))).tolist() for _ in range(24)]
    picked = backend.paged_kernel
    runs = {}
    for kernel in dict.fromkeys((picked, False)):
        backend.paged_kernel = kernel
        runs[kernel] = decode(backend, KVBlockPool(backend.num_kv_blocks, 16), prompts, max_tokens)
    backend.paged_kernel = picked
    rate = {k: sum(len(t) for t in r.tokens.values()) / r.seconds for k, r in runs.items()}
    same = sum(runs[picked].tokens[i] == runs[False].tokens[i] for i in range(len(prompts)))
    ok = (picked and same >= 20) if cuda else (not picked and all(len(t) == max_tokens for t in runs[False].tokens.values()))
    other = "CPU decode kernel" if backend.decode_kernel is not None else "gather + SDPA"  # decodes off the flash kernel
    figures = ", ".join(f"{'paged flash' if k else other} {r:.0f} tokens/s" for k, r in rate.items())
    return Outcome(f"paged attention kernel ({label})", verdict(ok),
                   f"engine picked {backend.describe()['attention']}; {same}/24 sequences decode the same tokens both "
                   f"ways; {figures}")


def engine_checks(cuda: bool, tmp: Path) -> list[Outcome]:
    """Checks 4-6. Without CUDA, 5 and 6 run on the CPU with a tiny Llama so their code is exercised."""
    from server.backends.base import Device

    if cuda:
        from bench.generation import build_model

        folder = tmp / "llm" / "1"
        build_model(folder)
        results = [check_generation_rates(cuda, folder)]
        device, label, max_tokens = Device("cuda", 0), "cuda, float32", 64
    else:
        folder = models.random_llama(tmp / "tiny" / "1", vocab=512, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1)
        results = [check_generation_rates(cuda, None)]
        device, label, max_tokens = Device("cpu"), "cpu dry run, no CUDA device", 8
    backend = llm(folder, device, "float32", blocks=1024)
    results += [check_prefix_caching(backend, label, max_tokens), check_step_isolation(backend, label, max_tokens)]
    backend.unload()
    backend = llm(folder, device, "bfloat16" if cuda else "float32", blocks=1024)
    results.append(check_paged_kernel(backend, label.replace("float32", "bfloat16"), max_tokens, cuda))
    backend.unload()
    return results


# ---------------------------------------------------------------- 7: front-end processes
def check_frontends(tmp: Path) -> Outcome:
    import os
    import statistics

    from bench import frontends

    cores = os.cpu_count() or 1
    counts = [n for n in (1, 2, 4, 8) if n == 1 or n <= max(2, cores // 2)]
    label = "front-end processes" + ("" if cores >= 8 else " (few cores: direction only)")
    args = argparse.Namespace(concurrency=128, clients=max(2, cores // 4), duration=5.0, rounds=2)
    try:
        systems = {**{f"N={n}": (n, None) for n in counts}, "N=1 asyncio": (1, None, "asyncio")}
        runs = frontends.sweep(frontends.build(tmp / "frontends"), systems, args)
    except (RuntimeError, OSError) as exc:  # a server that did not start is this check's failure, not the script's
        return Outcome(label, "FAIL", f"{type(exc).__name__}: {exc}")
    base = statistics.median(p["rps"] for p in runs["N=1"])
    errors = sum(p["errors"] for points in runs.values() for p in points)
    figures = "; ".join(f"{name}: {statistics.median(p['rps'] for p in points):.0f} req/s "
                        f"({statistics.median(p['rps'] for p in points) / base:.2f}x, engine loop "
                        f"{statistics.median(p['engine busy'] for p in points):.0%})" for name, points in runs.items())
    return Outcome(label, verdict(errors == 0), f"{cores} cores, {args.clients} client processes; {figures}; {errors} errors")


def check_warmup(cuda: bool, tmp: Path) -> Outcome:
    from bench import warmup

    label = "model_warmup" + ("" if cuda else " (cpu dry run)")
    try:
        rows, same = warmup.measure(tmp / "warmup", "KIND_GPU" if cuda else "KIND_CPU", rounds=3)
    except (RuntimeError, OSError) as exc:  # a server that did not start is this check's failure
        return Outcome(label, "FAIL", f"{type(exc).__name__}: {exc}")
    return Outcome(label, verdict(same), warmup.summary(rows) + ("" if same else "; the two models answered differently"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    print(f"GPU: {torch.cuda.get_device_name(0)}" if cuda else "no CUDA device here: CUDA checks SKIP, engine checks run on the CPU")
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for check in (lambda: check_device_counts(cuda), lambda: check_gpu_tests(cuda), lambda: check_ort(cuda, Path(tmp))):
            outcomes.append(check())
            print(outcomes[-1].line(), flush=True)
        for outcome in engine_checks(cuda, Path(tmp)):
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
        for check in (lambda: check_frontends(Path(tmp)), lambda: check_warmup(cuda, Path(tmp))):
            outcomes.append(check())
            print(outcomes[-1].line(), flush=True)
    if args.record:
        common.append_results("CUDA check (bench/cuda_check.py)", "\n".join(f"- {o.line()}" for o in outcomes))
    sys.exit(1 if any(o.status == "FAIL" for o in outcomes) else 0)


if __name__ == "__main__":
    main()
