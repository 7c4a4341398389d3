"""Generation benchmark: continuous batching vs static batching vs one at a time vs transformers.

    python -m bench.generation [--requests 48] [--rates 2,4] [--repeat 3] [--max-step-ms 50,100] [--burst-only]
    python -m bench.generation --prefix [--shared-requests 200] [--chats 50] [--chat-system-len 500]
    python -m bench.generation --speculative [--spec-requests 16] [--spec-rounds 3] [--spec-k 4]  (bench/speculative.py)

One run, one locally saved random Llama (transformers' save_pretrained), random-token prompts of mixed
lengths, and four ways to serve them:
  (a) Ferry over gRPC (continuous batching, paged KV cache), all at once without and with each step-time
      target (`generation.max_step_ms`), and at Poisson rates;
  (b) static batching on the same engine: batches of 16 (and one batch of everything) in arrival order,
      prompts padded to the batch's longest, each batch run until its longest member is done (every
      member decodes that long, no one joins mid-batch);
  (c) one request at a time on the same engine;
  (d) transformers' own continuous batching (`init_continuous_batching`), same model and prompts.
Figures: output tokens/s (useful tokens only), time to first token and inter-token latency p50/p99,
KV utilisation. The all-at-once runs of (a) and (d), which the ratios compare, run in interleaved
rounds with fresh prompts each round (the prefix cache must not skip a round's prefill because the
previous round sent the same prompts); each figure is the median over rounds. --burst-only runs just
those. Appended to bench/RESULTS.md.

With --prefix, the prefix-caching workloads instead, each on two copies of the model, caching off and
on: (a) requests sharing a 1,000-token system prompt, (b) multi-turn chats resending the conversation,
(c) the same chats after a system prompt they all share, (d) requests sharing nothing (throughput must
not drop with caching on); with --transformers, (a)-(c) also through transformers' continuous batching.
Figures: prompt tokens computed (from the server's prefix-cache counters) and the fewest any cache of
16-token blocks could leave, time to first token, tokens/s.
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


def kv_sampler(metrics_url: str, stop: threading.Event, samples: list, model: str = "bench") -> None:
    while not stop.is_set():
        page = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        used = re.search(rf'ferry_kv_blocks_used\{{model="{model}",version="1"\}} (\S+)', page)
        total = re.search(rf'ferry_kv_blocks_total\{{model="{model}",version="1"\}} (\S+)', page)
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


def measure_ferry(address, metrics_url, jobs, arrivals, name, model: str = "bench") -> dict:
    samples, stop = [], threading.Event()
    watcher = threading.Thread(target=kv_sampler, args=(metrics_url, stop, samples, model), daemon=True)
    watcher.start()
    wall, ttft, itl = asyncio.run(ferry_run(address, jobs, arrivals, model))
    stop.set()
    watcher.join()
    kv = f"{np.mean(samples):.2f} / {np.max(samples):.2f}" if samples else ""
    return summary(name, sum(n for _, n in jobs), wall, ttft, itl, kv_mean_max=kv)


# ---------------------------------------------------------------- (d): transformers continuous batching
def transformers_manager(folder: Path, warm):
    """transformers' continuous batching on the saved model, started and warmed up (as Ferry's run is) on
    `warm`: prompts unrelated to the measured ones, so its prefix sharing (on by default) gets no head start."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    for prompt, n in warm:
        manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
    for _ in warm:
        manager.get_result(timeout=600)
    return manager


def measure_transformers(folder: Path, jobs, arrivals: list[float], name: str, warm=None) -> dict:
    manager = transformers_manager(folder, jobs[:4] if warm is None else warm)
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


def transformers_chats(folder: Path, scripts, system: list[int], name: str, warm) -> dict:
    """The chats of `chats_run` through transformers' continuous batching: every chat's first turn at
    once, each next turn sent when the previous answer is complete."""
    manager = transformers_manager(folder, warm)
    sent, turns, ttft, itl, produced = {}, {}, [], [], 0

    def send(chat: int, turn: int, history: list[int]) -> None:
        user, n = scripts[chat][turn]
        prompt = history + user
        rid = manager.add_request(prompt, request_id=f"c{chat}t{turn}", max_new_tokens=n, record_timestamps=True,
                                  eos_token_id=-1)
        sent[rid], turns[rid] = time.perf_counter(), (chat, turn, prompt)

    start = time.perf_counter()
    for chat in range(len(scripts)):
        send(chat, 0, list(system))
    remaining = sum(len(script) for script in scripts)
    while remaining:
        result = manager.get_result(timeout=600)
        if result is None or not result.is_finished():
            continue
        remaining -= 1
        produced += len(result.generated_tokens)
        _stamps(result, sent[result.request_id], ttft, itl)
        chat, turn, prompt = turns.pop(result.request_id)
        if turn + 1 < len(scripts[chat]):
            send(chat, turn + 1, prompt + list(result.generated_tokens))
    wall = time.perf_counter() - start
    manager.stop(block=True)
    return summary(name, produced, wall, ttft, itl)


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


async def chats_run(address: str, scripts, model: str, system: list[int] = ()) -> tuple[float, int, list, list]:
    """All chats at once; each turn resends the whole conversation (the system prompt, if any, and every
    user part and answer so far)."""
    ttft, itl, produced = [], [], 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def chat(script):
            nonlocal produced
            history = list(system)
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
    return common.model_totals(metrics_url, model, "ferry_prefix_cache_query_tokens", "ferry_prefix_cache_hit_tokens")


def measure_prefix(address, metrics_url, model: str, name: str, run) -> dict:
    """One workload on one model; prompt tokens computed = looked up - supplied by the cache."""
    queried, hit = prompt_counters(metrics_url, model)
    wall, produced, ttft, itl = run()
    queried2, hit2 = prompt_counters(metrics_url, model)
    return summary(name, produced, wall, ttft, itl, prompt_tokens=int(queried2 - queried),
                   prompt_computed=int((queried2 - queried) - (hit2 - hit)))


def fewest_computed(conversations, system_len: int, block: int) -> tuple[int, int]:
    """(prompt tokens sent, the fewest a prefix cache of `block`-token blocks can leave to compute) over
    `conversations`, each a list of turns (user tokens, answer tokens) after one shared system prompt:
    a turn finds cached at most the full blocks of what was computed before it (the system prompt, once
    any conversation computed it; its own conversation so far except the last answer token, which is
    sampled but never fed) and always computes its last prompt token. Concurrency is ignored: the bound."""
    sent = computed = 0
    for i, conversation in enumerate(conversations):
        history, known = system_len, system_len if i else 0  # the first one computes the system prompt
        for user, answer in conversation:
            prompt = history + user
            cached = min(known, prompt - 1) // block * block
            sent += prompt
            computed += prompt - cached
            history, known = prompt + answer, prompt + answer - 1
    return sent, computed


def prefix_main(args) -> None:
    jobs = system_prompt_jobs(args.shared_requests)
    scripts = chat_scripts(args.chats)
    chat_system = np.random.default_rng(4).integers(2, 2048, size=args.chat_system_len).tolist()
    warm = [(p[:40], 4) for p, _ in workload(4, seed=9)]
    workloads = {  # tag -> (run on a Ferry model, run through transformers, conversations for the bound, system)
        "(a) shared 1,000-token system prompt": (
            lambda address, m: _jobs_run(address, jobs, m),
            lambda folder, name: measure_transformers(folder, jobs, [0.0] * len(jobs), name, warm),
            [[(len(p) - 1000, n)] for p, n in jobs], 1000),
        "(b) 4-turn chats, no system prompt": (
            lambda address, m: asyncio.run(chats_run(address, scripts, m)),
            lambda folder, name: transformers_chats(folder, scripts, [], name, warm),
            [[(len(u), n) for u, n in script] for script in scripts], 0),
        f"(c) 4-turn chats, shared {args.chat_system_len}-token system prompt": (
            lambda address, m: asyncio.run(chats_run(address, scripts, m, chat_system)),
            lambda folder, name: transformers_chats(folder, scripts, chat_system, name, warm),
            [[(len(u), n) for u, n in script] for script in scripts], args.chat_system_len),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        folder = repo / "cached" / "1"
        models.random_llama(folder, vocab=2048, hidden=512, intermediate=1376, layers=6, heads=8,
                            kv_heads=4, max_positions=2048)
        shutil.copytree(folder, repo / "uncached" / "1")
        for model, caching in (("cached", "true"), ("uncached", "false")):
            (repo / model / "config.yaml").write_text(
                "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 1024, max_num_seqs: 64, "
                f"max_num_batched_tokens: 1024, max_model_len: 2048, enable_prefix_caching: {caching}}}\n")
        proc, address, metrics = start_ferry(repo)
        try:
            for model in ("uncached", "cached"):
                asyncio.run(ferry_run(address, warm, [0.0] * len(warm), model))
            for tag, (run, _, _, _) in workloads.items():
                for model, label in (("uncached", "off"), ("cached", "on")):
                    rows.append(shown(measure_prefix(address, metrics, model, f"{tag}, caching {label}",
                                                     lambda m=model, run=run: run(address, m))))
            rows += no_shared_prefix_rows(args, address, metrics)
        finally:
            proc.terminate()
            proc.wait()
        if args.transformers:
            for tag, (_, reference, _, _) in workloads.items():
                rows.append(shown(reference(folder, f"{tag}, transformers CB")))
    report = prefix_report(args, jobs, scripts, workloads, rows)
    print(report)
    if not args.no_record:
        common.append_results("Generation with prefix caching (bench/generation.py --prefix)", report)


NO_SHARED = "(d) no shared prefixes, 48 requests at once"


def no_shared_prefix_rows(args, address, metrics) -> list[dict]:
    """Caching off and on where nothing is shared (fresh random prompts every round, so nothing is
    cached from a previous one either): what the hashing and the cache bookkeeping cost."""
    runs = {"off": [], "on": []}
    for round_ in range(args.repeat):
        jobs = workload(48, seed=100 + round_)
        for model, label in (("uncached", "off"), ("cached", "on")):
            runs[label].append(measure_prefix(address, metrics, model, f"{NO_SHARED}, caching {label}",
                                              lambda m=model, jobs=jobs: _jobs_run(address, jobs, m)))
    return [shown(median_row(rows)) for rows in runs.values()]


def shown(row: dict) -> dict:
    print(row, flush=True)  # as it comes: a long run cut short still leaves its figures
    return row


def prefix_report(args, jobs, scripts, workloads, rows) -> str:
    lines = [f"Workloads: (a) {len(jobs)} requests at once, one 1,000-token system prompt + 20-100 user tokens, "
             f"16 output tokens each; (b) {len(scripts)} chats at once, 4 turns each, 20-60 user tokens and 16-48 "
             "answer tokens a turn, every turn resending the conversation; (c) the chats of (b) after one "
             f"{args.chat_system_len}-token system prompt shared by all, as chat applications send; (d) the 48 "
             f"requests of the main benchmark with fresh random prompts, {args.repeat} interleaved rounds, medians. "
             "Random tokens; model: Llama, 6 layers, hidden 512 (about 20M parameters), float32 on the CPU; "
             "1,024 KV blocks of 16 tokens either way. transformers CB (with --transformers): its continuous batching "
             "with its default prefix sharing (allow_block_sharing), for reference; it reports no prompt-token counts.", "",
             common.table(rows, ["mode", "prompt_tokens", "prompt_computed", "ttft_p50_ms", "ttft_p99_ms",
                                 "itl_p50_ms", "itl_p99_ms", "output_tok_s", "wall_s", "runs"]), ""]
    by = {r["mode"]: r for r in rows}
    for tag, (_, _, conversations, system_len) in workloads.items():
        off, on = by[f"{tag}, caching off"], by[f"{tag}, caching on"]
        sent, fewest = fewest_computed(conversations, system_len, 16)
        lines.append(f"- {tag}, caching on vs off: time to first token p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x "
                     f"lower (target >= 3x), prompt tokens computed {off['prompt_computed'] / max(on['prompt_computed'], 1):.1f}x "
                     f"fewer (target >= 5x; the most any cache of 16-token blocks allows here: {sent / fewest:.1f}x), "
                     f"output tokens/s {on['output_tok_s'] / off['output_tok_s']:.2f}x")
    off, on = by[f"{NO_SHARED}, caching off"], by[f"{NO_SHARED}, caching on"]
    lines.append(f"- {NO_SHARED}: output tokens/s caching on / off {on['output_tok_s'] / off['output_tok_s']:.2f}x "
                 f"(target >= 1x), time to first token p50 {on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}x")
    return "\n".join(lines)


def _jobs_run(address, jobs, model) -> tuple[float, int, list, list]:
    wall, ttft, itl = asyncio.run(ferry_run(address, jobs, [0.0] * len(jobs), model))
    return wall, sum(n for _, n in jobs), ttft, itl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rates", default="2,4", help="Poisson arrival rates, requests/s")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the all-at-once runs; medians are kept")
    parser.add_argument("--max-step-ms", default=DEFAULT_STEP_MS,
                        help="generation.max_step_ms of the Ferry runs with a step-time target (comma-separated: one run each)")
    parser.add_argument("--burst-only", action="store_true",
                        help="only the all-at-once runs (Ferry with and without the target, transformers)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--prefix", action="store_true", help="run only the prefix-caching workloads, caching off and on")
    parser.add_argument("--shared-requests", type=int, default=200, help="--prefix: requests sharing the system prompt")
    parser.add_argument("--chats", type=int, default=50, help="--prefix: concurrent 4-turn chats")
    parser.add_argument("--chat-system-len", type=int, default=500, help="--prefix: system prompt of the chats of (c)")
    parser.add_argument("--transformers", action="store_true",
                        help="--prefix: also run (a)-(c) through transformers' continuous batching (slow on a CPU: "
                             "over 20 minutes and 12 GB for (a) on 2 cores)")
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
            rows = burst_rows(args, address, metrics, folder, jobs)
            if not args.burst_only:
                rows += other_ferry_rows(args, address, metrics, jobs)
        finally:
            proc.terminate()
            proc.wait()
        if not args.burst_only:
            rows += other_engine_rows(args, folder, jobs)
    for row in rows:
        print(row, flush=True)
    report = burst_report(args, jobs, rows)
    print(report)
    if not args.no_record:
        common.append_results("Generation (bench/generation.py)", report)


FERRY, TRANSFORMERS = "(a) Ferry gRPC, all at once", "(d) transformers CB, all at once"


def targets(args) -> list[float]:
    return [float(ms) for ms in str(args.max_step_ms).split(",") if ms]


def target_mode(ms: float) -> str:
    return f"(a) Ferry gRPC, max_step_ms {ms:g}, all at once"


def burst_rows(args, address, metrics, folder, jobs) -> list[dict]:
    """All at once, interleaved rounds: Ferry without and with each step-time target, transformers.
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


def poisson_arrivals(args, count: int) -> dict[float, list[float]]:
    rates = [float(r) for r in args.rates.split(",")]
    return {r: np.cumsum(np.random.default_rng(1).exponential(1 / r, size=count)).tolist() for r in rates}


def other_ferry_rows(args, address, metrics, jobs) -> list[dict]:
    fresh = workload(len(jobs), seed=POISSON_SEED)  # prompts the burst rounds did not leave in the prefix cache
    return [measure_ferry(address, metrics, fresh, arrivals, f"(a) Ferry gRPC, Poisson {r:g}/s")
            for r, arrivals in poisson_arrivals(args, len(jobs)).items()]


def other_engine_rows(args, folder, jobs) -> list[dict]:
    rows = [run_batches(folder, jobs, STATIC_BATCH, f"(b) static batches of {STATIC_BATCH}, all at once"),
            run_batches(folder, jobs, len(jobs), f"(b) static, one batch of {len(jobs)}, all at once"),
            run_batches(folder, jobs, 1, "(c) one at a time")]
    fresh = workload(len(jobs), seed=POISSON_SEED)
    return rows + [measure_transformers(folder, fresh, arrivals, f"(d) transformers CB, Poisson {r:g}/s")
                   for r, arrivals in poisson_arrivals(args, len(jobs)).items()]


def burst_report(args, jobs, rows) -> str:
    by = {r["mode"]: r for r in rows}
    ferry, hf = by[FERRY], by[TRANSFORMERS]
    lines = [
        f"Workload: {len(jobs)} requests, prompts 8-256 tokens, outputs 8-128 tokens (30% long), random tokens; "
        "model: Llama, 6 layers, hidden 512 (about 20M parameters, so per-token compute matters), vocab 2048, "
        f"float32 on the CPU; max_num_batched_tokens 1024; the target runs add max_step_ms {args.max_step_ms}. "
        f"All-at-once rows: medians of {args.repeat} interleaved rounds (tokens/s and inter-token p99 of each in "
        "`runs`, `itl_p99_runs`).", "",
        common.table(rows, ["mode", "output_tok_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                            "kv_mean_max", "runs", "itl_p99_runs"]), "",
        f"- without a target: inter-token p99 / transformers' {ferry['itl_p99_ms'] / hf['itl_p99_ms']:.2f}x "
        f"(target <= 2x); tokens/s / transformers' {ferry['output_tok_s'] / hf['output_tok_s']:.2f}x (target >= 1x)",
    ]
    for ms in targets(args):
        t = by[target_mode(ms)]
        lines.append(
            f"- max_step_ms {ms:g}: inter-token p99 / transformers' {t['itl_p99_ms'] / hf['itl_p99_ms']:.2f}x (target <= 2x); "
            f"against no target: tokens/s {t['output_tok_s'] / ferry['output_tok_s']:.2f}x (target >= 1x), "
            f"time to first token p50 {t['ttft_p50_ms'] / ferry['ttft_p50_ms']:.2f}x, p99 "
            f"{t['ttft_p99_ms'] / ferry['ttft_p99_ms']:.2f}x (target <= 1x); tokens/s / transformers' "
            f"{t['output_tok_s'] / hf['output_tok_s']:.2f}x")
    if f"(b) static batches of {STATIC_BATCH}, all at once" in by:
        tok = ferry["output_tok_s"]
        lines += [
            f"- Ferry (continuous, over gRPC) / static batching: {tok / by[f'(b) static batches of {STATIC_BATCH}, all at once']['output_tok_s']:.2f}x "
            f"tokens/s with batches of {STATIC_BATCH}, {tok / by[f'(b) static, one batch of {len(jobs)}, all at once']['output_tok_s']:.2f}x "
            "with one batch of all (target >= 2x)",
            f"- Ferry / one at a time: {tok / by['(c) one at a time']['output_tok_s']:.2f}x"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
