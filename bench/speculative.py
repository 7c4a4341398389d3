"""Speculative decoding (prompt lookup) on and off, in one run: output tokens/s and the acceptance rate.

    python -m bench.generation --speculative [--spec-requests 16] [--spec-rounds 3] [--spec-k 4]
                                             [--copy-steps 1500] [--no-random]

Prompt lookup pays where the output repeats earlier text (summaries, code edits, extraction, loops).
The main rows are a model that really copies its prompt: a small Llama trained here, seeded, on a copy
task with edits (bench/copy_model.py: prompt = a random span and a separator, answer = the span again
with a fixed tenth of the vocabulary renamed, as a code edit renames identifiers; cached under
~/.cache/ferry-bench, so only the first run trains), served as trained (`copy-small`: its steps are
so cheap that drafting's own cost shows) and embedded exactly in a model of the benchmark's 20M size
(`copy-20M`: copy_model.widened; same tokens, a realistic step cost). Their workload is `--spec-requests` requests at once,
each a fresh random span of 32-48 tokens, answered in full (as many output tokens as the span). The
report says how well the model copies (output tokens equal to the edited span) and which share of its
output prompt lookup could have proposed at all, beside the acceptance the server counted.

The second row (unless --no-random) is the earlier provisional one: the benchmark's random 20M Llama,
whose greedy output happens to fall into loops, on a random 32-token passage said three times, 64
output tokens. Each model is served twice, drafts on and off, same weights; rounds interleave on/off
(order alternating), the median tokens/s per mode is kept, and the outputs with and without drafts
must be identical (the run stops if they are not).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
from pathlib import Path

import grpc
import numpy as np

from bench import common, copy_model, models
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc

RANDOM_OUT_TOKENS = 64


def config(k: int, on: bool, max_model_len: int) -> str:
    spec = f", speculative: {{method: ngram, num_speculative_tokens: {k}, prompt_lookup_max: 4}}" if on else ""
    return ("backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 512, max_num_seqs: 64, "
            f"max_num_batched_tokens: 1024, max_model_len: {max_model_len}{spec}}}\n")


def serve_twice(repo: Path, name: str, folder: Path, k: int, max_model_len: int) -> None:
    """`name`_on (drafts) and `name`_off (none), the same weights."""
    for mode in ("on", "off"):
        shutil.copytree(folder, repo / f"{name}_{mode}" / "1")
        (repo / f"{name}_{mode}" / "config.yaml").write_text(config(k, mode == "on", max_model_len))


def copy_jobs(count: int, s: copy_model.CopySettings, seed: int = 5) -> list[tuple[list[int], list[int]]]:
    """(prompt, the answer a perfect copier gives) per request: fresh random spans of 32-48 tokens."""
    rng, table = np.random.default_rng(seed), copy_model.edit_map(s)
    return [copy_model.prompt_and_answer(copy_model.spans(rng, s, 1, int(rng.integers(32, 49)))[0], table)
            for _ in range(count)]


def random_jobs(count: int, seed: int = 4) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(2, 2048, size=32).tolist() * 3, RANDOM_OUT_TOKENS) for _ in range(count)]


async def run(address: str, model: str, jobs) -> tuple[float, list[list[int]]]:
    """`jobs`: (prompt, output tokens) all at once; wall seconds and every output."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)

        async def one(prompt, n):
            request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                                          sampling=gen.SamplingParams(max_tokens=n, ignore_eos=True))
            return [t async for r in stub.Generate(request, timeout=1200) for t in r.token_ids]

        start = asyncio.get_running_loop().time()
        outputs = await asyncio.gather(*(one(p, n) for p, n in jobs))
        return asyncio.get_running_loop().time() - start, outputs


def counters(metrics_url: str, model: str) -> tuple[float, float]:
    return common.model_totals(metrics_url, model, "ferry_spec_decode_num_draft_tokens",
                               "ferry_spec_decode_num_accepted_tokens")


def measure(address: str, metrics: str, name: str, jobs, rounds: int) -> tuple[dict, list[list[int]]]:
    """Drafts off and on in interleaved rounds; the row, and the outputs (identical either way)."""
    for mode in ("off", "on"):  # warm up both
        asyncio.run(run(address, f"{name}_{mode}", jobs[:2]))
    rates, outputs = {"off": [], "on": []}, {}
    drafted0, accepted0 = counters(metrics, f"{name}_on")
    produced = sum(n for _, n in jobs)
    for i in range(rounds):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            wall, outputs[mode] = asyncio.run(run(address, f"{name}_{mode}", jobs))
            rates[mode].append(produced / wall)
    if outputs["on"] != outputs["off"]:
        raise SystemExit(f"{name}: outputs with drafts differ from those without: speculative decoding is broken")
    drafted, accepted = (b - a for a, b in zip((drafted0, accepted0), counters(metrics, f"{name}_on")))
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    row = {"model": name, "tok_s_off": round(off, 1), "tok_s_on": round(on, 1), "speedup": f"{on / off:.2f}x",
           "drafted": int(drafted), "accepted": int(accepted),
           "acceptance": f"{accepted / drafted:.2f}" if drafted else "-",
           "accepted_per_output_token": f"{accepted / (rounds * produced):.2f}",
           "lookup_share": f"{np.mean([copy_model.lookup_share(p, o) for (p, _), o in zip(jobs, outputs['on'])]):.2f}",
           "identical_output": True,
           "runs_off/on": "/".join(f"{r:.0f}" for r in rates["off"]) + " ; " + "/".join(f"{r:.0f}" for r in rates["on"])}
    return row, outputs["on"]


def copied_share(answers: list[list[int]], outputs: list[list[int]]) -> float:
    """Output tokens equal to the perfect copier's at the same place."""
    return float(np.mean([np.mean(np.array(o) == np.array(a)) for a, o in zip(answers, outputs)]))


def main(args, start_ferry) -> None:
    settings = copy_model.CopySettings(steps=args.copy_steps)
    copier = copy_model.trained(settings)
    copies = copy_jobs(args.spec_requests, settings)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        copy_len = 4 * settings.span_max + 16
        serve_twice(repo, "copy-20M", copy_model.widened(copier, repo / "widened_src"), args.spec_k, copy_len)
        serve_twice(repo, "copy-small", copier, args.spec_k, copy_len)
        if not args.no_random:
            models.random_llama(repo / "random_src", vocab=2048, hidden=512, intermediate=1376, layers=6, heads=8,
                                kv_heads=4)
            serve_twice(repo, "random", repo / "random_src", args.spec_k, 1024)
        proc, address, metrics = start_ferry(repo)
        try:
            for name in ("copy-20M", "copy-small"):
                row, outputs = measure(address, metrics, name, [(p, len(a)) for p, a in copies], args.spec_rounds)
                row["copied"] = f"{copied_share([a for _, a in copies], outputs):.2f}"
                rows.append(row)
                print(row, flush=True)
            if not args.no_random:
                rows.append(measure(address, metrics, "random", random_jobs(args.spec_requests), args.spec_rounds)[0])
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait()
    report = "\n".join(describe(args, settings) + ["", common.table(rows, [
        "model", "tok_s_off", "tok_s_on", "speedup", "drafted", "accepted", "acceptance", "accepted_per_output_token",
        "lookup_share", "copied", "identical_output", "runs_off/on"])])
    print(report)
    if not args.no_record:
        common.append_results("Speculative decoding, prompt lookup (bench/generation.py --speculative)", report)


def describe(args, s: copy_model.CopySettings) -> list[str]:
    return [
        f"Workloads: `copy-*`: {args.spec_requests} requests at once, each `BOS, span, SEP` with a fresh random span "
        f"of 32-48 tokens, answered in full (as many output tokens as the span), greedy. `copy-small` is a Llama "
        f"trained here to copy the span with a fixed {s.edit_share:.0%} of the vocabulary renamed ({s.layers} layers, "
        f"hidden {s.hidden}, vocab {s.vocab}, {s.steps} steps of {s.batch} spans of {s.span_min}-{s.span_max} tokens, "
        f"seed {s.seed}; bench/copy_model.py); `copy-20M` is the same model embedded exactly in one of the benchmark "
        "model's size (6 layers, hidden 512, intermediate 1376; 19.5M parameters; the added width and layers are "
        "zero and add nothing), so its steps cost what a 20M model's do. `random`: the benchmark's random 20M "
        "Llama (6 layers, hidden 512), "
        f"whose greedy output falls into loops, on a random 32-token passage said three times, "
        f"{RANDOM_OUT_TOKENS} output tokens. ngram drafts k={args.spec_k}, prompt_lookup_max 4, min 1; "
        f"{args.spec_rounds} interleaved rounds, median; float32 on the CPU.",
        "`acceptance`: drafted tokens the model kept (server counters); `accepted_per_output_token`: tokens that "
        "came free per output token; `lookup_share`: output tokens that prompt lookup could have proposed from "
        "everything before them (what any k could reach); `copied`: output tokens equal to the edited span "
        "(how well the model learned the task); outputs with and without drafts are checked identical."]
