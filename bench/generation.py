"""Generation benchmark: continuous batching vs static batching vs one at a time vs transformers.

    python -m bench.generation [--requests 48] [--rates 2,4] [--repeat 3] [--max-step-ms 50,100]
                               [--burst-only | --poisson-only]
    python -m bench.generation --prefix [--shared-requests 200] [--chats 50] [--chat-system-len 500]
                               [--transformers [--reference-scale 0.25]]  (bench/prefix.py)
    python -m bench.generation --speculative [--spec-requests 16] [--spec-rounds 3] [--spec-k 4] [--copy-steps 1500]
                               [--no-random]  (bench/speculative.py, the copying model: bench/copy_model.py)

One run, one locally saved random Llama (transformers' save_pretrained), random-token prompts of mixed
lengths, and four ways to serve them:
  (a) Ferry over gRPC (continuous batching, paged KV cache), all at once in the default config (the
      automatic step-time target, scheduling/step_budget.py) and with each fixed one
      (`generation.max_step_ms`), and at Poisson rates;
  (b) static batching on the same engine: batches of 16 (and one batch of everything) in arrival order,
      prompts padded to the batch's longest, each batch run until its longest member is done (every
      member decodes that long, no one joins mid-batch);
  (c) one request at a time on the same engine;
  (d) transformers' own continuous batching (`init_continuous_batching`), same model and prompts.
Figures: output tokens/s (useful tokens only), time to first token and inter-token latency p50/p99,
KV utilisation. The all-at-once runs of (a) and (d), which the ratios compare, run in interleaved
rounds with fresh prompts each round (the prefix cache must not skip a round's prefill because the
previous round sent the same prompts); each figure is the median over rounds. --burst-only runs just
those. The Poisson runs of (a) and (d) are interleaved the same way, each round with fresh prompts and
its own arrival times (a p99 of 48 requests is nearly their maximum: one unlucky arrival moves it);
--poisson-only runs just those. Appended to bench/RESULTS.md.

With --prefix, the prefix-caching workloads instead (bench/prefix.py), caching off and on, and with
--transformers the same through transformers' continuous batching on workloads cut to --reference-scale.
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
WARM_SEED, POISSON_SEED = 900, 500
DEFAULT_STEP_MS = "50,100"  # the step-time targets the burst is run with, unless --max-step-ms says otherwise


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


def median_row(rows: list[dict]) -> dict:
    """One row of per-figure medians over repeated runs of one mode (tokens/s and inter-token p99 of
    every run listed): a single few-second run on a shared machine is off by 20% often enough to flip a ratio."""
    merged = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and all(isinstance(r[key], (int, float)) for r in rows):
            merged[key] = round(float(np.median([r[key] for r in rows])), 2)
    merged["runs"] = "/".join(f"{r['output_tok_s']:.0f}" for r in rows)
    merged["itl_p99_runs"] = "/".join(f"{r['itl_p99_ms']:.0f}" for r in rows)
    return merged


def interleaved(measures: dict, repeat: int) -> list[dict]:
    """Run every measurement once per round, `repeat` rounds, so a slow spell of a shared machine hits
    them all alike; one median row per measurement. Each measurement takes the round's number."""
    runs = {name: [] for name in measures}
    for round_ in range(repeat):
        for name, measure in measures.items():
            runs[name].append(measure(round_))
    return [median_row(rows) for rows in runs.values()]


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


KV_SAMPLE_S = 0.25  # a scrape costs the server ~4 ms of CPU under its GIL (3 models' metrics here); at
# 20 a second, as until 2026-12-03, that was ~8% of a core taken from the step thread mid-run, where
# Prometheus scrapes every 15-60 s. The Poisson runs, whose KV use is near nothing, are not sampled:
# there a scrape's GIL hold lands on a few decode steps of ~10 ms and moves the inter-token p99.


def kv_sampler(metrics_url: str, stop: threading.Event, samples: list, model: str = "bench") -> None:
    while not stop.is_set():
        page = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        used = re.search(rf'ferry_kv_blocks_used\{{model="{model}",version="1"\}} (\S+)', page)
        total = re.search(rf'ferry_kv_blocks_total\{{model="{model}",version="1"\}} (\S+)', page)
        if used and total and float(total.group(1)):
            samples.append(float(used.group(1)) / float(total.group(1)))
        stop.wait(KV_SAMPLE_S)


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


def measure_ferry(address, metrics_url, jobs, arrivals, name, model: str = "bench") -> dict:
    """One run; KV use sampled from `metrics_url` meanwhile (None: not sampled, and nothing perturbed)."""
    samples, stop = [], threading.Event()
    watcher = threading.Thread(target=kv_sampler, args=(metrics_url, stop, samples, model), daemon=True) if metrics_url else None
    if watcher is not None:
        watcher.start()
    wall, ttft, itl = asyncio.run(ferry_run(address, jobs, arrivals, model))
    stop.set()
    if watcher is not None:
        watcher.join()
    kv = f"{np.mean(samples):.2f} / {np.max(samples):.2f}" if samples else ""
    return summary(name, sum(n for _, n in jobs), wall, ttft, itl, kv_mean_max=kv)


# ---------------------------------------------------------------- (d): transformers continuous batching
def transformers_manager(folder: Path, warm, kv: tuple[int, int, int] | None = None):
    """transformers' continuous batching on the saved model, started and warmed up (as Ferry's run is) on
    `warm`: prompts unrelated to the measured ones, so its prefix sharing (on by default) gets no head start.
    `kv`: (blocks, tokens a block, tokens a step), Ferry's num_kv_blocks, block_size and
    max_num_batched_tokens; None lets transformers size its cache from free memory (on a CPU: most of
    the RAM, with step masks as wide as that cache)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=-1)
    sizing = None
    if kv is not None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        sizing = ContinuousBatchingConfig(num_blocks=kv[0], page_size=kv[1], max_batch_tokens=kv[2])
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=sizing)
    manager.start()
    for prompt, n in warm:
        manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
    for _ in warm:
        manager.get_result(timeout=600)
    return manager


def measure_transformers(folder: Path, jobs, arrivals: list[float], name: str, warm=None, kv=None) -> dict:
    """One transformers run in a process of its own that exits after it: run in this one, it left
    something behind (its cache, sized from free RAM without `kv`, or its threads) that slowed the
    Ferry round after it (inter-token p99 at Poisson 2/s 43-54 ms against 26-27 alone, the server's own
    histogram too)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_measure_transformers, (folder, jobs, arrivals, name, warm, kv))


def _measure_transformers(folder: Path, jobs, arrivals: list[float], name: str, warm=None, kv=None) -> dict:
    manager = transformers_manager(folder, jobs[:4] if warm is None else warm, kv)
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
        _stamps(result, sent[result.request_id], ttft, itl)
    wall = time.perf_counter() - start
    manager.stop(block=True)
    return summary(name, tokens, wall, ttft, itl)


def _stamps(result, sent: float, ttft: list, itl: list) -> None:
    stamps = result.timestamps or []
    if stamps:
        ttft.append(stamps[0] - sent)
        itl.extend(np.diff(stamps).tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rates", default="2,4", help="Poisson arrival rates, requests/s")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the all-at-once runs; medians are kept")
    parser.add_argument("--max-step-ms", default=DEFAULT_STEP_MS,
                        help="generation.max_step_ms of the Ferry runs with a step-time target (comma-separated: one run each)")
    parser.add_argument("--poisson-only", action="store_true", help="only the Poisson rounds of Ferry and transformers")
    parser.add_argument("--burst-only", action="store_true",
                        help="only the all-at-once runs (Ferry with and without the target, transformers)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--prefix", action="store_true", help="run only the prefix-caching workloads, caching off and on")
    parser.add_argument("--shared-requests", type=int, default=200, help="--prefix: requests sharing the system prompt")
    parser.add_argument("--chats", type=int, default=50, help="--prefix: concurrent 4-turn chats")
    parser.add_argument("--chat-system-len", type=int, default=500, help="--prefix: system prompt of the chats of (c)")
    parser.add_argument("--transformers", action="store_true",
                        help="--prefix: also run (a)-(c) through transformers' continuous batching, on the workloads "
                             "cut to --reference-scale, beside Ferry on the same cut workloads")
    parser.add_argument("--reference-scale", type=float, default=0.25,
                        help="--prefix --transformers: share of the requests and chats the reference runs get")
    parser.add_argument("--speculative", action="store_true", help="run only speculative decoding, drafts off and on")
    parser.add_argument("--spec-requests", type=int, default=16, help="--speculative: requests at once")
    parser.add_argument("--spec-rounds", type=int, default=3, help="--speculative: interleaved rounds (median kept)")
    parser.add_argument("--spec-k", type=int, default=4, help="--speculative: num_speculative_tokens")
    parser.add_argument("--copy-steps", type=int, default=1500,
                        help="--speculative: training steps of the copying model (cached per setting under ~/.cache/ferry-bench)")
    parser.add_argument("--no-random", action="store_true", help="--speculative: only the copying model, not the random one")
    args = parser.parse_args()
    if args.speculative:
        from bench import speculative

        speculative.main(args, start_ferry)
        return
    if args.prefix:
        from bench import prefix

        prefix.main(args)
        return
    jobs = workload(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        folder = repo / "bench" / "1"
        build_model(folder)
        base = "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 1024, max_num_seqs: 64, " \
               "max_num_batched_tokens: 1024, max_model_len: 1024"
        (repo / "bench" / "config.yaml").write_text(base + "}\n")
        for ms in targets(args):
            shutil.copytree(folder, repo / f"bench_{ms:g}ms" / "1")
            (repo / f"bench_{ms:g}ms" / "config.yaml").write_text(base + f", max_step_ms: {ms}}}\n")
        proc, address, metrics = start_ferry(repo)
        try:
            rows = [] if args.poisson_only else burst_rows(args, address, metrics, folder, jobs)
            if not args.burst_only:
                rows += poisson_rows(args, address, folder, len(jobs))
        finally:
            proc.terminate()
            proc.wait()
        if not (args.burst_only or args.poisson_only):
            rows += other_engine_rows(folder, jobs)
    for row in rows:
        print(row, flush=True)
    text = report(args, jobs, rows)
    print(text)
    if not args.no_record:
        common.append_results("Generation (bench/generation.py)", text)


FERRY, TRANSFORMERS = "(a) Ferry gRPC, all at once", "(d) transformers CB, all at once"


def targets(args) -> list[float]:
    return [float(ms) for ms in str(args.max_step_ms).split(",") if ms]


def target_mode(ms: float) -> str:
    return f"(a) Ferry gRPC, max_step_ms {ms:g}, all at once"


def burst_rows(args, address, metrics, folder, jobs) -> list[dict]:
    """All at once, interleaved rounds: Ferry in the default config and with each fixed step-time target, transformers.
    Every round draws its prompts afresh (round 0: `jobs`), the same for every mode: a round that
    resent the previous one's prompts would find them in the prefix cache and skip their prefill."""
    at_once = [0.0] * len(jobs)
    warm = workload(4, seed=WARM_SEED)
    rounds = [jobs] + [workload(len(jobs), seed=r) for r in range(1, args.repeat)]
    models = {FERRY: "bench", **{target_mode(ms): f"bench_{ms:g}ms" for ms in targets(args)}}
    for model in models.values():
        measure_ferry(address, metrics, warm, at_once[:4], "warmup", model)
    measures = {mode: (lambda r, mode=mode, model=model: measure_ferry(address, metrics, rounds[r], at_once, mode, model))
                for mode, model in models.items()}
    measures[TRANSFORMERS] = lambda r: measure_transformers(folder, rounds[r], at_once, TRANSFORMERS, warm)
    return interleaved(measures, args.repeat)


def poisson_modes(rate: float) -> tuple[str, str]:
    return f"(a) Ferry gRPC, Poisson {rate:g}/s", f"(d) transformers CB, Poisson {rate:g}/s"


def poisson_rows(args, address, folder, count: int) -> list[dict]:
    """Each rate in `--repeat` interleaved rounds of Ferry and transformers; every round of every rate
    draws prompts no other run sent (seed POISSON_SEED + its number: the prefix cache must not skip
    their prefill) and arrivals of its own. Ferry's KV use is not sampled here (KV_SAMPLE_S says why)."""
    warm = workload(4, seed=WARM_SEED)
    rows = []
    for k, rate in enumerate(float(r) for r in args.rates.split(",")):
        rounds = [workload(count, seed=POISSON_SEED + k * args.repeat + r) for r in range(args.repeat)]
        times = [np.cumsum(np.random.default_rng(1 + r).exponential(1 / rate, size=count)).tolist()
                 for r in range(args.repeat)]
        ferry, hf = poisson_modes(rate)
        rows += interleaved({
            ferry: lambda r, ferry=ferry, rounds=rounds, times=times: measure_ferry(address, None, rounds[r], times[r], ferry),
            hf: lambda r, hf=hf, rounds=rounds, times=times: measure_transformers(folder, rounds[r], times[r], hf, warm),
        }, args.repeat)
    return rows


def other_engine_rows(folder, jobs) -> list[dict]:
    return [run_batches(folder, jobs, STATIC_BATCH, f"(b) static batches of {STATIC_BATCH}, all at once"),
            run_batches(folder, jobs, len(jobs), f"(b) static, one batch of {len(jobs)}, all at once"),
            run_batches(folder, jobs, 1, "(c) one at a time")]


def report(args, jobs, rows) -> str:
    by = {r["mode"]: r for r in rows}
    lines = [
        f"Workload: {len(jobs)} requests, prompts 8-256 tokens, outputs 8-128 tokens (30% long), random tokens; "
        "model: Llama, 6 layers, hidden 512 (about 20M parameters, so per-token compute matters), vocab 2048, "
        f"float32 on the CPU; max_num_batched_tokens 1024; the target runs add max_step_ms {args.max_step_ms}. "
        f"All-at-once and Poisson rows of (a) and (d): medians of {args.repeat} interleaved rounds (tokens/s and "
        "inter-token p99 of each in `runs`, `itl_p99_runs`).", "",
        common.table(rows, ["mode", "output_tok_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                            "kv_mean_max", "runs", "itl_p99_runs"]), ""]
    if FERRY in by:
        lines += burst_lines(args, jobs, by)
    for rate in (float(r) for r in args.rates.split(",")):
        ferry, hf = (by.get(mode) for mode in poisson_modes(rate))
        if ferry and hf:
            lines.append(
                f"- Poisson {rate:g}/s, Ferry / transformers (target < 1x): time to first token p99 "
                f"{ferry['ttft_p99_ms'] / hf['ttft_p99_ms']:.2f}x, inter-token p99 {ferry['itl_p99_ms'] / hf['itl_p99_ms']:.2f}x")
    return "\n".join(lines)


def burst_lines(args, jobs, by: dict) -> list[str]:
    ferry, hf = by[FERRY], by[TRANSFORMERS]
    lines = [
        f"- default config (the automatic step-time target): inter-token p99 / transformers' "
        f"{ferry['itl_p99_ms'] / hf['itl_p99_ms']:.2f}x (target <= 1.5x); tokens/s / transformers' "
        f"{ferry['output_tok_s'] / hf['output_tok_s']:.2f}x (target >= 1.3x)",
    ]
    for ms in targets(args):
        t = by[target_mode(ms)]
        lines.append(
            f"- max_step_ms {ms:g}: inter-token p99 / transformers' {t['itl_p99_ms'] / hf['itl_p99_ms']:.2f}x; "
            f"against the default: tokens/s {t['output_tok_s'] / ferry['output_tok_s']:.2f}x, "
            f"time to first token p50 {t['ttft_p50_ms'] / ferry['ttft_p50_ms']:.2f}x, p99 "
            f"{t['ttft_p99_ms'] / ferry['ttft_p99_ms']:.2f}x; tokens/s / transformers' "
            f"{t['output_tok_s'] / hf['output_tok_s']:.2f}x")
    if f"(b) static batches of {STATIC_BATCH}, all at once" in by:
        tok = ferry["output_tok_s"]
        lines += [
            f"- Ferry (continuous, over gRPC) / static batching: {tok / by[f'(b) static batches of {STATIC_BATCH}, all at once']['output_tok_s']:.2f}x "
            f"tokens/s with batches of {STATIC_BATCH}, {tok / by[f'(b) static, one batch of {len(jobs)}, all at once']['output_tok_s']:.2f}x "
            "with one batch of all (target >= 2x)",
            f"- Ferry / one at a time: {tok / by['(c) one at a time']['output_tok_s']:.2f}x"]
    return lines

if __name__ == "__main__":
    main()
