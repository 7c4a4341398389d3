"""Speculative decoding (prompt lookup) on and off, in one run: output tokens/s and the acceptance rate.

    python -m bench.generation --speculative [--spec-requests 16] [--spec-rounds 3] [--spec-k 4]

Prompt lookup pays where the output repeats earlier text (summaries, code edits, extraction, loops).
A random model does not copy its prompt the way a summariser does, so the acceptance rate here is
whatever its greedy output happens to repeat, measured honestly, on two models, each served twice
(drafts on, drafts off), same weights: (1) the benchmark's random 20M Llama as saved (its small
initialisation makes greedy output fall into loops), and (2) the same model with its attention
output projections zeroed, whose next token depends on the current one only: a chain through the
vocabulary that repeats only once it closes a cycle. The workload is
`--spec-requests` requests at once, each a random 32-token passage said three times, 64 output tokens,
greedy. Rounds interleave on/off (order alternating); the median tokens/s per mode is kept, and the
outputs with and without drafts are checked to be identical.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
from pathlib import Path

import grpc
import numpy as np

from bench import common, models
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc

OUT_TOKENS = 64


def build(repo: Path, k: int) -> None:
    import torch
    import transformers

    base = repo / "random_on" / "1"
    models.random_llama(base, vocab=2048, hidden=512, intermediate=1376, layers=6, heads=8, kv_heads=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(str(repo / "no-attention_on" / "1"))
    shutil.copy(base / "tokenizer.json", repo / "no-attention_on" / "1" / "tokenizer.json")
    for name in ("random", "no-attention"):
        shutil.copytree(repo / f"{name}_on" / "1", repo / f"{name}_off" / "1")
        for mode in ("on", "off"):
            spec = f", speculative: {{method: ngram, num_speculative_tokens: {k}, prompt_lookup_max: 4}}" if mode == "on" else ""
            (repo / f"{name}_{mode}" / "config.yaml").write_text(
                "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 512, max_num_seqs: 64, "
                f"max_num_batched_tokens: 1024, max_model_len: 1024{spec}}}\n")


def jobs(count: int, seed: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 2048, size=32).tolist() * 3 for _ in range(count)]


async def run(address: str, model: str, prompts) -> tuple[float, list[list[int]]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)

        async def one(prompt):
            request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                                          sampling=gen.SamplingParams(max_tokens=OUT_TOKENS, ignore_eos=True))
            return [t async for r in stub.Generate(request, timeout=1200) for t in r.token_ids]

        start = asyncio.get_running_loop().time()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        return asyncio.get_running_loop().time() - start, outputs


def counters(metrics_url: str, model: str) -> tuple[float, float]:
    return common.model_totals(metrics_url, model, "ferry_spec_decode_num_draft_tokens",
                               "ferry_spec_decode_num_accepted_tokens")


def main(args, start_ferry) -> None:
    prompts = jobs(args.spec_requests)
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build(repo, args.spec_k)
        proc, address, metrics = start_ferry(repo)
        try:
            for name in ("random", "no-attention"):
                for mode in ("off", "on"):  # warm up both
                    asyncio.run(run(address, f"{name}_{mode}", prompts[:2]))
                rates = {"off": [], "on": []}
                outputs = {}
                drafted0, accepted0 = counters(metrics, f"{name}_on")
                for i in range(args.spec_rounds):
                    for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                        wall, outputs[mode] = asyncio.run(run(address, f"{name}_{mode}", prompts))
                        rates[mode].append(len(prompts) * OUT_TOKENS / wall)
                drafted, accepted = (b - a for a, b in zip((drafted0, accepted0), counters(metrics, f"{name}_on")))
                off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
                rows.append({"model": name, "tok_s_off": round(off, 1), "tok_s_on": round(on, 1),
                             "speedup": f"{on / off:.2f}x", "drafted": int(drafted), "accepted": int(accepted),
                             "acceptance": f"{accepted / drafted:.2f}" if drafted else "-",
                             "accepted_per_output_token": f"{accepted / (args.spec_rounds * len(prompts) * OUT_TOKENS):.2f}",
                             "identical_output": outputs["on"] == outputs["off"],
                             "runs_off/on": "/".join(f"{r:.0f}" for r in rates["off"]) + " ; "
                                            + "/".join(f"{r:.0f}" for r in rates["on"])})
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait()
    lines += [f"Workload: {len(prompts)} requests at once, each a random 32-token passage said three times, "
              f"{OUT_TOKENS} output tokens, greedy; ngram drafts k={args.spec_k}, prompt_lookup_max 4, min 1; "
              f"{args.spec_rounds} interleaved rounds, median. Model: Llama, 6 layers, hidden 512 (about 20M "
              "parameters), float32 on the CPU; `no-attention` is the same model with attention outputs zeroed "
              "(next token a function of the current one).", "",
              common.table(rows, ["model", "tok_s_off", "tok_s_on", "speedup", "drafted", "accepted", "acceptance",
                                  "accepted_per_output_token", "identical_output", "runs_off/on"])]
    report = "\n".join(lines)
    print(report)
    if not args.no_record:
        common.append_results("Speculative decoding, prompt lookup (bench/generation.py --speculative)", report)
