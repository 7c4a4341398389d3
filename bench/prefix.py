"""Prefix caching workloads, caching off and on, and the same through transformers for reference.

    python -m bench.generation --prefix [--shared-requests 200] [--chats 50] [--chat-system-len 500]
                                        [--transformers [--reference-scale 0.25]]

Each workload runs on two copies of the model, caching off and on: (a) requests sharing a 1,000-token
system prompt, (b) multi-turn chats resending the conversation, (c) the same chats after a system
prompt they all share, (d) requests sharing nothing (throughput must not drop with caching on).
Figures: prompt tokens computed (from the server's prefix-cache counters) and the fewest any cache of
16-token blocks could leave, time to first token, tokens/s.

With --transformers, (a)-(c) also go through transformers' continuous batching, given the same KV
capacity and step token budget as Ferry's models (left to size itself on a CPU it takes most of the
RAM and builds step masks that wide: over 20 minutes and 12 GB for the full (a) on 2 cores). The
reference runs on the workloads cut to `--reference-scale` (their first requests and chats, so the
same shape), and Ferry runs those cut workloads too, in the same run on fresh models, so each
comparison with transformers is like for like; the full-size caching off/on rows are unchanged.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench import common, models
from bench.generation import (_stamps, ferry_run, measure_transformers, median_row, start_ferry, summary,
                              transformers_manager, workload)
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc

KV = (1024, 16, 1024)  # num_kv_blocks, block_size, max_num_batched_tokens: Ferry's models and transformers' alike


def transformers_chats(folder: Path, scripts, system: list[int], name: str, warm, kv=None) -> dict:
    """The chats of `chats_run` through transformers' continuous batching: every chat's first turn at
    once, each next turn sent when the previous answer is complete."""
    manager = transformers_manager(folder, warm, kv)
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


def workloads(args, jobs, scripts, chat_system: list[int], warm) -> dict:
    """tag -> (run on a Ferry model, run through transformers, conversations for the bound, system length)."""
    return {
        "(a) shared 1,000-token system prompt": (
            lambda address, m: _jobs_run(address, jobs, m),
            lambda folder, name: measure_transformers(folder, jobs, [0.0] * len(jobs), name, warm, KV),
            [[(len(p) - 1000, n)] for p, n in jobs], 1000),
        "(b) 4-turn chats, no system prompt": (
            lambda address, m: asyncio.run(chats_run(address, scripts, m)),
            lambda folder, name: transformers_chats(folder, scripts, [], name, warm, KV),
            [[(len(u), n) for u, n in script] for script in scripts], 0),
        f"(c) 4-turn chats, shared {args.chat_system_len}-token system prompt": (
            lambda address, m: asyncio.run(chats_run(address, scripts, m, chat_system)),
            lambda folder, name: transformers_chats(folder, scripts, chat_system, name, warm, KV),
            [[(len(u), n) for u, n in script] for script in scripts], args.chat_system_len),
    }


def scaled(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def main(args) -> None:
    jobs = system_prompt_jobs(args.shared_requests)
    scripts = chat_scripts(args.chats)
    chat_system = np.random.default_rng(4).integers(2, 2048, size=args.chat_system_len).tolist()
    warm = [(p[:40], 4) for p, _ in workload(4, seed=9)]
    full = workloads(args, jobs, scripts, chat_system, warm)
    # The reference's workloads: the first requests and chats of the full ones (same system prompts, same
    # length distributions), so a reduced run has the full run's shape; Ferry runs them too, on fresh models.
    reduced = workloads(args, jobs[:scaled(len(jobs), args.reference_scale)],
                        scripts[:scaled(len(scripts), args.reference_scale)], chat_system, warm) if args.transformers else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        folder = build_models(repo, ["cached", "uncached"] + (["cached_ref", "uncached_ref"] if reduced else []))
        proc, address, metrics = start_ferry(repo)
        try:
            for model in ("uncached", "cached") + (("uncached_ref", "cached_ref") if reduced else ()):
                asyncio.run(ferry_run(address, warm, [0.0] * len(warm), model))
            rows += ferry_rows(address, metrics, full, "")
            rows += no_shared_prefix_rows(args, address, metrics)
            rows += ferry_rows(address, metrics, reduced, reference_label(args), "_ref")
        finally:
            proc.terminate()
            proc.wait()
        for tag, (_, reference, _, _) in reduced.items():
            rows.append(shown(reference(folder, f"{tag}{reference_label(args)}, transformers CB")))
    report = prefix_report(args, jobs, scripts, full, rows) + reference_report(args, reduced, rows)
    print(report)
    if not args.no_record:
        common.append_results("Generation with prefix caching (bench/generation.py --prefix)", report)


def build_models(repo: Path, names: list[str]) -> Path:
    """One random model saved under every name, caching on for `cached*`; the folder of the first."""
    folder = repo / names[0] / "1"
    models.random_llama(folder, vocab=2048, hidden=512, intermediate=1376, layers=6, heads=8, kv_heads=4,
                        max_positions=2048)
    for name in names:
        if name != names[0]:
            shutil.copytree(folder, repo / name / "1")
        (repo / name / "config.yaml").write_text(
            f"backend: llm\ngeneration: {{block_size: {KV[1]}, num_kv_blocks: {KV[0]}, max_num_seqs: 64, "
            f"max_num_batched_tokens: {KV[2]}, max_model_len: 2048, "
            f"enable_prefix_caching: {'true' if name.startswith('cached') else 'false'}}}\n")
    return folder


def ferry_rows(address, metrics, runs: dict, label: str, models_suffix: str = "") -> list[dict]:
    rows = []
    for tag, (run, _, _, _) in runs.items():
        for model, caching in (("uncached", "off"), ("cached", "on")):
            model += models_suffix
            rows.append(shown(measure_prefix(address, metrics, model, f"{tag}{label}, caching {caching}",
                                             lambda m=model, run=run: run(address, m))))
    return rows


def reference_label(args) -> str:
    return f", x{args.reference_scale:g} size"


def reference_report(args, reduced: dict, rows: list[dict]) -> str:
    if not reduced:
        return ""
    by, label = {r["mode"]: r for r in rows}, reference_label(args)
    lines = ["", f"Against transformers' continuous batching, on the workloads cut to x{args.reference_scale:g} "
             f"({scaled(args.shared_requests, args.reference_scale)} requests for (a), "
             f"{scaled(args.chats, args.reference_scale)} chats for (b) and (c); the first ones of the full workloads), "
             "Ferry on the same cut workloads in the same run, on fresh models (nothing cached from the full runs):"]
    for tag in reduced:
        hf = by[f"{tag}{label}, transformers CB"]
        for caching in ("off", "on"):
            ferry = by[f"{tag}{label}, caching {caching}"]
            lines.append(f"- {tag}{label}, Ferry caching {caching} / transformers CB: time to first token p50 "
                         f"{hf['ttft_p50_ms'] / ferry['ttft_p50_ms']:.1f}x lower, output tokens/s "
                         f"{ferry['output_tok_s'] / hf['output_tok_s']:.2f}x")
    return "\n".join(lines)


NO_SHARED = "(d) no shared prefixes, 48 requests at once"


def no_shared_prefix_rows(args, address, metrics) -> list[dict]:
    """Caching off and on where nothing is shared (fresh random prompts every round, so nothing is
    cached from a previous one either): what the hashing and the cache bookkeeping cost."""
    runs = {"off": [], "on": []}
    for round_ in range(args.repeat):
        jobs = workload(48, seed=100 + round_)
        pair = (("uncached", "off"), ("cached", "on"))
        for model, label in pair if round_ % 2 == 0 else pair[::-1]:  # neither always runs second
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
