"""Generation benchmark: continuous batching vs static batching vs one at a time vs transformers.

    python -m bench.generation [--requests 48] [--rates 2,4]
    python -m bench.generation --prefix [--shared-requests 200] [--chats 50]
    python -m bench.generation --speculative [--spec-requests 16] [--spec-rounds 3] [--spec-k 4]  (bench/speculative.py)

One run, one locally saved random Llama (transformers' save_pretrained), one set of random-token
prompts of mixed lengths, and four ways to serve them:
  (a) Ferry over gRPC (continuous batching, paged KV cache), all at once and at Poisson rates;
  (b) static batching on the same engine: batches of 16 (and one batch of everything) in arrival order,
      prompts padded to the batch's longest, each batch run until its longest member is done (every
      member decodes that long, no one joins mid-batch);
  (c) one request at a time on the same engine;
  (d) transformers' own continuous batching (`init_continuous_batching`), same model and prompts.
Figures: output tokens/s (useful tokens only), time to first token and inter-token latency p50/p99,
KV utilisation. The all-at-once runs of (a) and (d), which the ratios compare, are repeated and the
median kept. Appended to bench/RESULTS.md.

With --prefix, the prefix-caching workloads instead, each on two copies of the model, caching off and
on: (a) requests sharing a 1,000-token system prompt, (b) multi-turn chats resending the conversation.
Figures: prompt tokens computed (from the server's prefix-cache counters), time to first token, tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from bench import common, models
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc

STATIC_BATCH = 16


def build_model(folder: Path) -> None:
    models.random_llama(folder, vocab=2048, hidden=512, intermediate=1376, layers=6, heads=8, kv_heads=4)


def workload(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """70% short chats (8-32 prompt, 8-32 out), 30% long ones (64-256 prompt, 64-128 out)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for _ in range(count):
        long = rng.random() < 0.3
        prompt_len = int(rng.integers(64, 257) if long else rng.integers(8, 33))
        out_len = int(rng.integers(64, 129) if long else rng.integers(8, 33))
        jobs.append((rng.integers(2, 2048, size=prompt_len).tolist(), out_len))
    return jobs


def summary(name: str, tokens: int, wall_s: float, ttft_s: list[float], itl_s: list[float], **extra) -> dict:
    pct = lambda xs, q: round(float(np.percentile(xs, q)) * 1000, 1) if xs else ""  # noqa: E731
    return {"mode": name, "output_tok_s": round(tokens / wall_s, 1), "wall_s": round(wall_s, 2),
            "ttft_p50_ms": pct(ttft_s, 50), "ttft_p99_ms": pct(ttft_s, 99),
            "itl_p50_ms": pct(itl_s, 50), "itl_p99_ms": pct(itl_s, 99), **extra}


def median_run(measure, repeat: int) -> dict:
    """Run a measurement `repeat` times and keep the median one by tokens/s (all of them listed in
    `runs`): a single few-second run on a shared machine is off by 20% often enough to flip a ratio."""
    rows = sorted((measure() for _ in range(repeat)), key=lambda r: r["output_tok_s"])
    return {**rows[len(rows) // 2], "runs": "/".join(f"{r['output_tok_s']:.0f}" for r in rows)}


# ---------------------------------------------------------------- (b), (c): the same engine, in process
def engine(folder: Path, max_seqs: int):
    from protos import model_config_pb2 as mc
    from server.backends.base import Device
    from server.backends.llm.engine import LLMBackend
    from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
    from server.scheduling.kv_blocks import KVBlockPool

    config = mc.ModelConfig(name="bench", backend="llm")
    config.generation.block_size, config.generation.num_kv_blocks = 16, 1024
    backend = LLMBackend(config, folder / "config.json", Device("cpu"))
    backend.load()
    settings = ContinuousSettings(max_num_seqs=max_seqs, max_num_batched_tokens=4096, max_model_len=1024)
    return backend, ContinuousScheduler(settings, KVBlockPool(1024, 16))


def run_batches(folder: Path, jobs, batch: int, name: str) -> dict:
    """Admit `batch` requests together and run them until the longest is done; then the next batch.
    With batch 1 this is serving one request at a time (nothing to pad)."""
    from server.scheduling.sequence import SamplingParams, Sequence

    backend, scheduler = engine(folder, batch)
    ttft, itl, useful = [], [], 0
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i : i + batch]
        longest = max(n for _, n in group)
        width = max(len(p) for p, _ in group)
        padded = [[0] * (width - len(p)) + p for p, _ in group]  # prompts padded to the longest, as a static batch is
        seqs = [Sequence(i + j, p, len(p), SamplingParams(max_tokens=longest, ignore_eos=True))
                for j, p in enumerate(padded)]
        for seq in seqs:
            scheduler.submit(seq)
        last = {}
        while scheduler.running or scheduler.num_waiting:
            plan = scheduler.schedule()
            sampled = backend.step(plan)
            scheduler.postprocess(plan, sampled)
            now = time.perf_counter()
            for seq, (_, own) in zip(seqs, group):
                if seq.seq_id in sampled and seq.num_output <= own:
                    (itl.append(now - last[seq.seq_id]) if seq.seq_id in last else ttft.append(now - start))
                    last[seq.seq_id] = now
            for seq in list(scheduler.running):
                if seq.num_output >= longest:
                    scheduler.finish(seq, "length")
        useful += sum(n for _, n in group)
    return summary(name, useful, time.perf_counter() - start, ttft, itl)


# ---------------------------------------------------------------- (a): Ferry over gRPC
def start_ferry(repo: Path):
    cmd = common.ferry_command(repo)
    cmd[cmd.index("--metrics-port") + 1] = "0"
    proc = subprocess.Popen(cmd, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = ""
    for line in proc.stdout:
        text += line
        if line.startswith("ferry: ready"):
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    address = re.search(r"serving gRPC on (\S+)", text).group(1)
    metrics = re.search(r"serving metrics on (\S+)", text).group(1)
    return proc, address, metrics


def kv_sampler(metrics_url: str, stop: threading.Event, samples: list) -> None:
    while not stop.is_set():
        page = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        used = re.search(r'ferry_kv_blocks_used\{model="bench",version="1"\} (\S+)', page)
        total = re.search(r'ferry_kv_blocks_total\{model="bench",version="1"\} (\S+)', page)
        if used and total and float(total.group(1)):
            samples.append(float(used.group(1)) / float(total.group(1)))
        stop.wait(0.05)


async def ferry_run(address: str, jobs, arrivals: list[float], model: str = "bench") -> tuple[float, list, list]:
    ttft, itl = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(prompt, n, at):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = last = time.perf_counter()
            request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                                          sampling=gen.SamplingParams(max_tokens=n, ignore_eos=True))
            first = True
            async for response in stub.Generate(request, timeout=600):
                now = time.perf_counter()
                if response.token_ids:
                    (ttft.append(now - sent) if first else itl.append(now - last))
                    first, last = False, now

        await asyncio.gather(*(one(p, n, at) for (p, n), at in zip(jobs, arrivals)))
        return time.perf_counter() - start, ttft, itl


def measure_ferry(address, metrics_url, jobs, arrivals, name) -> dict:
    samples, stop = [], threading.Event()
    watcher = threading.Thread(target=kv_sampler, args=(metrics_url, stop, samples), daemon=True)
    watcher.start()
    wall, ttft, itl = asyncio.run(ferry_run(address, jobs, arrivals))
    stop.set()
    watcher.join()
    kv = f"{np.mean(samples):.2f} / {np.max(samples):.2f}" if samples else ""
    return summary(name, sum(n for _, n in jobs), wall, ttft, itl, kv_mean_max=kv)


# ---------------------------------------------------------------- (d): transformers continuous batching
def measure_transformers(folder: Path, jobs, arrivals: list[float], name: str) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    for prompt, n in jobs[:4]:  # warm up, as Ferry's run is
        manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
    for _ in range(4):
        manager.get_result(timeout=600)
    sent = {}
    start = time.perf_counter()
    for i, ((prompt, n), at) in enumerate(zip(jobs, arrivals)):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        rid = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
        sent[rid] = time.perf_counter()
    ttft, itl, done, tokens = [], [], 0, 0
    while done < len(jobs):
        result = manager.get_result(timeout=600)
        if result is None or not result.is_finished():
            continue
        done += 1
        tokens += len(result.generated_tokens)
        stamps = result.timestamps or []
        if stamps:
            ttft.append(stamps[0] - sent[result.request_id])
            itl.extend(np.diff(stamps).tolist())
    wall = time.perf_counter() - start
    manager.stop(block=True)
    return summary(name, tokens, wall, ttft, itl)


# ---------------------------------------------------------------- prefix caching: shared prompts, chats
def system_prompt_jobs(count: int, system_len: int = 1000, out_len: int = 16, seed: int = 2):
    """Workload (a): one system prompt shared by every request, then a 20-100-token user part."""
    rng = np.random.default_rng(seed)
    system = rng.integers(2, 2048, size=system_len).tolist()
    return [(system + rng.integers(2, 2048, size=int(rng.integers(20, 101))).tolist(), out_len) for _ in range(count)]


def chat_scripts(count: int, turns: int = 4, seed: int = 3) -> list[list[tuple[list[int], int]]]:
    """Workload (b): per chat, per turn, the user's new tokens (20-60) and the answer's length (16-48)."""
    rng = np.random.default_rng(seed)
    return [[(rng.integers(2, 2048, size=int(rng.integers(20, 61))).tolist(), int(rng.integers(16, 49)))
             for _ in range(turns)] for _ in range(count)]


async def chats_run(address: str, scripts, model: str) -> tuple[float, int, list, list]:
    """All chats at once; each turn resends the whole conversation (every user part and answer so far)."""
    ttft, itl, produced = [], [], 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def chat(script):
            nonlocal produced
            history = []
            for user, n in script:
                history += user
                sent = last = time.perf_counter()
                answer = []
                request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=history),
                                              sampling=gen.SamplingParams(max_tokens=n, ignore_eos=True))
                async for response in stub.Generate(request, timeout=1200):
                    now = time.perf_counter()
                    if response.token_ids:
                        (itl.append(now - last) if answer else ttft.append(now - sent))
                        last = now
                        answer += response.token_ids
                history += answer
                produced += len(answer)

        await asyncio.gather(*(chat(s) for s in scripts))
        return time.perf_counter() - start, produced, ttft, itl


def prompt_counters(metrics_url: str, model: str) -> tuple[float, float]:
    page = urllib.request.urlopen(metrics_url, timeout=10).read().decode()

    def value(name):
        found = re.search(rf'{name}_total\{{model="{model}",version="1"\}} (\S+)', page)
        return float(found.group(1)) if found else 0.0

    return value("ferry_prefix_cache_query_tokens"), value("ferry_prefix_cache_hit_tokens")


def measure_prefix(address, metrics_url, model: str, name: str, run) -> dict:
    """One workload on one model; prompt tokens computed = looked up - supplied by the cache."""
    queried, hit = prompt_counters(metrics_url, model)
    wall, produced, ttft, itl = run()
    queried2, hit2 = prompt_counters(metrics_url, model)
    return summary(name, produced, wall, ttft, itl, prompt_tokens=int(queried2 - queried),
                   prompt_computed=int((queried2 - queried) - (hit2 - hit)))


def prefix_main(args) -> None:
    jobs = system_prompt_jobs(args.shared_requests)
    scripts = chat_scripts(args.chats)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        models.random_llama(repo / "cached" / "1", vocab=2048, hidden=512, intermediate=1376, layers=6, heads=8,
                            kv_heads=4, max_positions=2048)
        shutil.copytree(repo / "cached" / "1", repo / "uncached" / "1")
        for model, caching in (("cached", "true"), ("uncached", "false")):
            (repo / model / "config.yaml").write_text(
                "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 1024, max_num_seqs: 64, "
                f"max_num_batched_tokens: 1024, max_model_len: 2048, enable_prefix_caching: {caching}}}\n")
        proc, address, metrics = start_ferry(repo)
        try:
            for model, label in (("uncached", "off"), ("cached", "on")):
                warm = [(p[:40], 4) for p, _ in workload(4, seed=9)]
                asyncio.run(ferry_run(address, warm, [0.0] * len(warm), model))
                rows.append(measure_prefix(address, metrics, model, f"(a) shared 1,000-token system prompt, caching {label}",
                                           lambda m=model: _jobs_run(address, jobs, m)))
                rows.append(measure_prefix(address, metrics, model, f"(b) 4-turn chats, caching {label}",
                                           lambda m=model: asyncio.run(chats_run(address, scripts, m))))
        finally:
            proc.terminate()
            proc.wait()
    for row in rows:
        print(row, flush=True)
    lines = [f"Workloads: (a) {len(jobs)} requests at once, one 1,000-token system prompt + 20-100 user tokens, "
             f"16 output tokens each; (b) {len(scripts)} chats at once, 4 turns each, 20-60 user tokens and 16-48 "
             "answer tokens a turn, every turn resending the conversation. Random tokens; model: Llama, 6 layers, "
             "hidden 512 (about 20M parameters), float32 on the CPU; 1,024 KV blocks of 16 tokens either way.", "",
             common.table(rows, ["mode", "prompt_tokens", "prompt_computed", "ttft_p50_ms", "ttft_p99_ms",
                                 "itl_p50_ms", "itl_p99_ms", "output_tok_s", "wall_s"]), ""]
    by = {r["mode"]: r for r in rows}
    for tag, title in (("(a) shared 1,000-token system prompt", "(a)"), ("(b) 4-turn chats", "(b)")):
        off, on = by[f"{tag}, caching off"], by[f"{tag}, caching on"]
        lines.append(f"- {title} caching on vs off: time to first token p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x lower "
                     f"(target >= 3x), prompt tokens computed {off['prompt_computed'] / max(on['prompt_computed'], 1):.1f}x fewer "
                     f"(target >= 5x), output tokens/s {on['output_tok_s'] / off['output_tok_s']:.2f}x")
    report = "\n".join(lines)
    print(report)
    if not args.no_record:
        common.append_results("Generation with prefix caching (bench/generation.py --prefix)", report)


def _jobs_run(address, jobs, model) -> tuple[float, int, list, list]:
    wall, ttft, itl = asyncio.run(ferry_run(address, jobs, [0.0] * len(jobs), model))
    return wall, sum(n for _, n in jobs), ttft, itl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rates", default="2,4", help="Poisson arrival rates, requests/s")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each all-at-once measurement; the median is kept")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--prefix", action="store_true", help="run only the prefix-caching workloads, caching off and on")
    parser.add_argument("--shared-requests", type=int, default=200, help="--prefix: requests sharing the system prompt")
    parser.add_argument("--chats", type=int, default=50, help="--prefix: concurrent 4-turn chats")
    parser.add_argument("--speculative", action="store_true", help="run only speculative decoding, drafts off and on")
    parser.add_argument("--spec-requests", type=int, default=16, help="--speculative: requests at once")
    parser.add_argument("--spec-rounds", type=int, default=3, help="--speculative: interleaved rounds (median kept)")
    parser.add_argument("--spec-k", type=int, default=4, help="--speculative: num_speculative_tokens")
    args = parser.parse_args()
    if args.speculative:
        from bench import speculative

        speculative.main(args, start_ferry)
        return
    if args.prefix:
        prefix_main(args)
        return
    jobs = workload(args.requests)
    rates = [float(r) for r in args.rates.split(",")]
    poisson = {r: np.cumsum(np.random.default_rng(1).exponential(1 / r, size=len(jobs))).tolist() for r in rates}
    at_once = [0.0] * len(jobs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        folder = repo / "bench" / "1"
        build_model(folder)
        (repo / "bench" / "config.yaml").write_text(
            "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 1024, max_num_seqs: 64, "
            "max_num_batched_tokens: 1024, max_model_len: 1024}\n")
        proc, address, metrics = start_ferry(repo)
        try:
            measure_ferry(address, metrics, jobs[:4], at_once[:4], "warmup")
            rows.append(median_run(lambda: measure_ferry(address, metrics, jobs, at_once, "(a) Ferry gRPC, all at once"),
                                   args.repeat))
            for r in rates:
                rows.append(measure_ferry(address, metrics, jobs, poisson[r], f"(a) Ferry gRPC, Poisson {r:g}/s"))
        finally:
            proc.terminate()
            proc.wait()
        rows.append(run_batches(folder, jobs, STATIC_BATCH, f"(b) static batches of {STATIC_BATCH}, all at once"))
        rows.append(run_batches(folder, jobs, len(jobs), f"(b) static, one batch of {len(jobs)}, all at once"))
        rows.append(run_batches(folder, jobs, 1, "(c) one at a time"))
        rows.append(median_run(lambda: measure_transformers(folder, jobs, at_once, "(d) transformers CB, all at once"),
                               args.repeat))
        for r in rates:
            rows.append(measure_transformers(folder, jobs, poisson[r], f"(d) transformers CB, Poisson {r:g}/s"))
    for row in rows:
        print(row, flush=True)
    by = {r["mode"]: r["output_tok_s"] for r in rows}
    ferry = by["(a) Ferry gRPC, all at once"]
    lines = [
        f"Workload: {len(jobs)} requests, prompts 8-256 tokens, outputs 8-128 tokens (30% long), random tokens; "
        "model: Llama, 6 layers, hidden 512 (about 20M parameters, so per-token compute matters), vocab 2048, "
        "float32 on the CPU.", "",
        common.table(rows, ["mode", "output_tok_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "kv_mean_max",
                            "runs"]),
        "", f"- Ferry (continuous, over gRPC) / static batching: {ferry / by[f'(b) static batches of {STATIC_BATCH}, all at once']:.2f}x tokens/s "
        f"with batches of {STATIC_BATCH}, {ferry / by[f'(b) static, one batch of {len(jobs)}, all at once']:.2f}x with one batch of all "
        "(target >= 2x)",
        f"- Ferry / one at a time: {ferry / by['(c) one at a time']:.2f}x",
        f"- Ferry / transformers continuous batching: {ferry / by['(d) transformers CB, all at once']:.2f}x (target >= 1x)",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_record:
        common.append_results("Generation (bench/generation.py)", report)


if __name__ == "__main__":
    main()
