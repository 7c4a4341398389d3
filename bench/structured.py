"""Structured outputs: what a JSON-schema constraint costs a continuous batch.

    python -m bench.structured [--requests 48] [--tokens 64] [--rounds 3] [--vocab 16384]

A random Llama of the generation benchmark's size (bench/generation.py), but with a byte-level BPE
tokenizer of `--vocab` tokens trained here on JSON-like text (a grammar mask is computed over the
whole vocabulary, so a word-level toy tokenizer would flatter it). Two bursts of `--requests` requests
at once, `--tokens` output tokens each, over gRPC Generate:
  free:  every request unconstrained;
  mixed: half of them constrained to a JSON schema (nested objects, arrays, enums, bounded numbers)
         whose minItems keeps the object open past `--tokens`, so both bursts generate the same count.
  control: every request unconstrained again (an A/A twin of free: the spread of control/free is the
         machine's noise; a mixed/free ratio inside it is a tie).
Rounds interleave the three bursts (order rotated) with fresh prompts; each figure is the median over rounds. Printed:
output tokens/s and inter-token p50/p99 of each, the mixed/free ratios, the time steps waited for
masks after their forward pass (the server's ferry_structured_output_mask_wait_us_total), and per
schema the compile time on first use and on a cached use (in process, the server's own guided.py).
Appended to bench/RESULTS.md with --record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from bench import common, generation, models
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number", "minimum": -10, "maximum": 10},
    "role": {"enum": ["admin", "user", "guest", "owner"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}
BURST_SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 200}},
                "required": ["people"], "additionalProperties": False}
WIDE = {"type": "object", "properties": {f"field_{i}": ({"type": "integer", "minimum": 0, "maximum": i + 5} if i % 3 == 0 else
                                                       {"enum": [f"v{i}a", f"v{i}b", f"v{i}c"]} if i % 3 == 1 else
                                                       {"type": "array", "items": {"type": "string"}})
                                         for i in range(40)}, "required": [f"field_{i}" for i in range(0, 40, 2)]}
SCHEMAS = {"person (nested, enums, bounds)": PERSON, "burst (array of persons)": BURST_SCHEMA, "wide (40 fields)": WIDE,
           "json_object": {"type": "object"}}
WORDS = ["ferry", "harbour", "tide", "north", "south", "cargo", "deck", "crew", "ticket", "island", "wave", "anchor"]


def corpus(rng: random.Random, count: int) -> list[str]:
    """JSON records and sentences over a made-up lexicon: what the tokenizer's merges are learnt from."""
    lexicon = WORDS + ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
                       for _ in range(6000)]
    lines = []
    for _ in range(count):
        record = {rng.choice(lexicon): rng.choice([rng.randint(0, 99999), rng.choice(lexicon), rng.random() * 100,
                                                   [rng.choice(lexicon) for _ in range(3)], None, True])
                  for _ in range(rng.randint(2, 6))}
        lines.append(json.dumps(record) if rng.random() < 0.6 else " ".join(rng.choice(lexicon) for _ in range(12)))
    return lines


def build_model(folder: Path, vocab: int) -> int:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(corpus(random.Random(0), 60000), vocab_size=vocab, min_frequency=2,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    size = tok.get_vocab_size()
    models.random_llama(folder, vocab=size, hidden=512, intermediate=1376, layers=6, heads=8, kv_heads=4)
    tok.save(str(folder / "tokenizer.json"))  # over the word-level one random_llama writes
    return size


def jobs(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(count)]


async def burst(address: str, prompts: list[str], tokens: int, constrained: set[int]) -> dict:
    ttft, itl, counts = [], [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)

        async def one(i: int, prompt: str):
            sampling = gen.SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=i)
            if i in constrained:
                sampling.json_schema = json.dumps(BURST_SCHEMA)
            sent = last = time.perf_counter()
            n = 0
            async for response in stub.Generate(gen.GenerateRequest(model_name="bench", text=prompt, sampling=sampling),
                                                timeout=600):
                now = time.perf_counter()
                if response.token_ids:
                    (itl if n else ttft).append(now - (last if n else sent))
                    n, last = n + len(response.token_ids), now
            counts.append(n)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return generation.summary("", sum(counts), wall, ttft, itl)


def mask_wait_ms(metrics: str) -> float:
    page = urllib.request.urlopen(metrics, timeout=5).read().decode()
    found = re.search(r'ferry_structured_output_mask_wait_us_total\{model="bench",version="1"\} (\S+)', page)
    return float(found.group(1)) / 1000 if found else 0.0


def compile_times(folder: Path, vocab: int) -> dict[str, tuple[float, float]]:
    """Per schema: (first use ms, cached use ms) through the server's own Guides, on this tokenizer."""
    from tokenizers import Tokenizer

    from server.backends.llm.guided import Guides
    from server.runners.constraints import constraint_of

    guides = Guides(Tokenizer.from_file(str(folder / "tokenizer.json")), vocab, (1,))
    out = {}
    for name, schema in SCHEMAS.items():
        constraint = constraint_of({"guided_json": schema})
        times = []
        for _ in range(6):
            started = time.perf_counter()
            guide = guides.start(constraint)
            guides._fill([(guide, [])])  # the first mask too: llguidance builds its lexer lazily
            times.append((time.perf_counter() - started) * 1e3)
        out[name] = (times[0], float(np.median(times[1:])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--record", action="store_true", help="append the results to bench/RESULTS.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="ferry-structured-"))
    try:
        folder = work / "repo" / "bench" / "1"
        vocab = build_model(folder, args.vocab)
        (work / "repo" / "bench" / "config.yaml").write_text(
            "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 1024, max_num_seqs: 64, "
            "max_num_batched_tokens: 2048, max_model_len: 512}\n")
        compiles = compile_times(folder, vocab)
        proc, address, metrics = generation.start_ferry(work / "repo")
        try:
            rows = run(args, address, metrics)
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, vocab, rows, compiles) + common.load_note(load, "The two bursts of a round ran one after the other.")
    print(text)
    if args.record:
        common.append_results("Structured outputs, a burst half of it JSON-schema constrained (bench/structured.py)", text)


def run(args, address: str, metrics: str) -> dict:
    asyncio.run(burst(address, jobs(args.requests, 999), args.tokens, set(range(0, args.requests, 2))))  # warm
    runs = {"free": [], "mixed": [], "control": []}
    waits = []
    for round_ in range(args.rounds):
        prompts = jobs(args.requests, round_)
        names = list(runs)
        for name in names[round_ % 3:] + names[:round_ % 3]:  # each burst takes each place in turn
            before = mask_wait_ms(metrics)
            constrained = set(range(0, args.requests, 2)) if name == "mixed" else set()
            runs[name].append(asyncio.run(burst(address, prompts, args.tokens, constrained)))
            if name == "mixed":
                waits.append(mask_wait_ms(metrics) - before)
    def paired(other: str) -> list[tuple[float, float]]:
        return [(o["output_tok_s"] / f["output_tok_s"], o["itl_p99_ms"] / f["itl_p99_ms"]) for f, o in zip(runs["free"], runs[other])]
    return {name: generation.median_row(rows) for name, rows in runs.items()} | {
        "mask_wait_ms": float(np.median(waits)), "paired": paired("mixed"), "control": paired("control")}


def report(args, vocab: int, rows: dict, compiles: dict) -> str:
    free, mixed = rows["free"], rows["mixed"]
    lines = [f"`python -m bench.structured --requests {args.requests} --tokens {args.tokens} --rounds {args.rounds} "
             f"--vocab {args.vocab}`: random 20M Llama, byte-level BPE of {vocab} tokens, {args.tokens} output tokens "
             "a request, temperature 1; medians over rounds (each round's figure after the slash list).", "",
             "| burst | tokens/s | inter-token p50 ms | inter-token p99 ms | runs tok/s | runs p99 ms |",
             "|---|---|---|---|---|---|"]
    for name, row in (("free (48 unconstrained)", free), ("mixed (24 with the schema)", mixed),
                      ("control (free again, A/A)", rows["control"])):
        lines.append(f"| {name} | {row['output_tok_s']} | {row['itl_p50_ms']} | {row['itl_p99_ms']} | {row['runs']} | "
                     f"{row['itl_p99_runs']} |")
    lines += ["", f"mixed / free: tokens/s **{mixed['output_tok_s'] / free['output_tok_s']:.2f}x** (goal >= 0.9), "
              f"inter-token p99 **{mixed['itl_p99_ms'] / free['itl_p99_ms']:.2f}x** (goal <= 1.2); steps waited "
              f"{rows['mask_wait_ms']:.0f} ms in all for masks after their forward pass in a mixed burst "
              f"(of {mixed['wall_s']:.1f} s). Round by round (the two bursts of a round ran back to back, so a busy "
              "spell of the shared machine hits both): tokens/s "
              + "/".join(f"{t:.2f}" for t, _ in rows["paired"]) + f" (median **{np.median([t for t, _ in rows['paired']]):.2f}x**), "
              "inter-token p99 " + "/".join(f"{p:.2f}" for _, p in rows["paired"])
              + f" (median **{np.median([p for _, p in rows['paired']]):.2f}x**).", "", "| schema | first use: compile + first mask, ms | cached: copy + first mask, ms (median of 5) |", "|---|---|---|"]
    lines += [f"| {name} | {first:.1f} | {cached:.2f} |" for name, (first, cached) in compiles.items()]
    control = rows["control"]
    lines += ["", "A/A control (control / free, round by round): tokens/s " + "/".join(f"{t:.2f}" for t, _ in control)
              + f" (median {np.median([t for t, _ in control]):.2f}x, spread {min(t for t, _ in control):.2f}-"
              f"{max(t for t, _ in control):.2f}), inter-token p99 " + "/".join(f"{p:.2f}" for _, p in control)
              + f" (median {np.median([p for _, p in control]):.2f}x, spread {min(p for _, p in control):.2f}-"
              f"{max(p for _, p in control):.2f}): a mixed/free ratio inside that spread is a tie."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
