"""Multi-LoRA benchmark: one base model serving 4 adapters in shared steps vs the base alone vs 4 merged copies.

    python -m bench.lora [--requests 48] [--repeat 3] [--rank 16] [--targets q_proj,k_proj,...] [--no-record]

bench/generation.py's random Llama (20M parameters) and workload (random-token prompts, 70% short, 30%
long), all requests at once over gRPC Generate, three ways:
  (a) the base model alone: every request without an adapter;
  (b) the same burst spread over 4 adapters (request i uses adapter i % 4), on the same server and
      model: every step carries rows of all 4, each Linear adding the rows' low-rank products
      (server/backends/llm/lora.py);
  (c) the same burst spread over 4 separately loaded models, each the base with one adapter merged in
      (peft's merge_and_unload): 4 weight copies, 4 KV pools, 4 schedulers taking turns on the CPU.
(a) and (b) run on one server, in interleaved rounds with fresh prompts; (c) on a server of its own
afterwards. Figures: output tokens/s (median over rounds), and each server's resident memory (VmRSS
after its rounds) beside the bytes of weights it holds. Appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import common
from bench.generation import build_model, start_ferry, summary, workload

ADAPTERS = 4
KV = "generation: {block_size: 16, num_kv_blocks: 1024, max_num_batched_tokens: 2048}\n"
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def build_adapters(base: Path, folder: Path, rank: int, targets: list[str]) -> list[Path]:
    import peft
    import torch
    import transformers

    paths = []
    for i in range(ADAPTERS):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                             lora_dropout=0.0))
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero; random, so every adapter changes the output
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        wrapped.save_pretrained(str(folder / f"adapter{i}"))
        paths.append(folder / f"adapter{i}")
    return paths


def merged_copy(base: Path, adapter: Path, folder: Path) -> None:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().save_pretrained(str(folder))
    shutil.copy(base / "tokenizer.json", folder / "tokenizer.json")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def weights_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20


def burst(address: str, jobs, models: list[str], adapters: list[str], name: str) -> dict:
    """All `jobs` at once; job i goes to models[i % len] with adapters[i % len] ("" for none)."""
    wall, ttft, itl = asyncio.run(ferry_run_lora(address, jobs, models, adapters))
    row = summary(name, sum(n for _, n in jobs), wall, ttft, itl)
    print(f"{name}: {row['output_tok_s']} tokens/s ({row['wall_s']} s)", flush=True)
    return row


async def ferry_run_lora(address, jobs, models, adapters):
    from protos import generate_pb2 as gen
    import grpc
    from protos import generate_pb2_grpc as gen_grpc

    ttft, itl = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(i, prompt, n):
            sent = last = time.perf_counter()
            request = gen.GenerateRequest(model_name=models[i % len(models)], token_ids=gen.TokenIds(ids=prompt),
                                          lora_name=adapters[i % len(adapters)],
                                          sampling=gen.SamplingParams(max_tokens=n, ignore_eos=True))
            first = True
            async for response in stub.Generate(request, timeout=900):
                now = time.perf_counter()
                if response.token_ids:
                    (ttft.append(now - sent) if first else itl.append(now - last))
                    first, last = False, now

        await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(jobs)))
        return time.perf_counter() - start, ttft, itl


def median(rows: list[dict]) -> dict:
    out = dict(rows[0])
    out["output_tok_s"] = round(float(np.median([r["output_tok_s"] for r in rows])), 1)
    out["itl_p50_ms"] = round(float(np.median([r["itl_p50_ms"] for r in rows])), 1)
    out["itl_p99_ms"] = round(float(np.median([r["itl_p99_ms"] for r in rows])), 1)
    out["runs"] = "/".join(f"{r['output_tok_s']:.0f}" for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_TARGETS)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    targets = args.targets.split(",")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "lora" / "bench" / "1"
        build_model(base)
        adapters = build_adapters(base, tmp / "adapters", args.rank, targets)
        modules = " ".join(f"a{i}={path}" for i, path in enumerate(adapters))
        (tmp / "lora" / "bench" / "config.yaml").write_text(
            "backend: llm\n" + KV + f"parameters: {{lora_modules: {{string_value: '{modules}'}}, "
            f"max_loras: {{string_value: '{ADAPTERS}'}}, max_lora_rank: {{string_value: '{args.rank}'}}}}\n")
        for i, path in enumerate(adapters):
            merged_copy(base, path, tmp / "copies" / f"m{i}" / "1")
            (tmp / "copies" / f"m{i}" / "config.yaml").write_text("backend: llm\n" + KV)
        names = [f"a{i}" for i in range(ADAPTERS)]
        copies = [f"m{i}" for i in range(ADAPTERS)]

        proc, address, _ = start_ferry(tmp / "lora")
        try:
            burst(address, workload(8, seed=900), ["bench"], names, "warm")  # loads every adapter once
            runs = {"base": [], "adapters": []}
            for round_ in range(args.repeat):
                jobs = workload(args.requests, seed=round_)
                runs["base"].append(burst(address, jobs, ["bench"], [""], "(a) base model alone"))
                jobs = workload(args.requests, seed=100 + round_)
                runs["adapters"].append(burst(address, jobs, ["bench"], names, f"(b) {ADAPTERS} adapters, one batch"))
            lora_rss = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
        proc, address, _ = start_ferry(tmp / "copies")
        try:
            burst(address, workload(8, seed=900), copies, [""], "warm")
            runs["copies"] = [burst(address, workload(args.requests, seed=100 + r), copies, [""],
                                    f"(c) {ADAPTERS} merged copies") for r in range(args.repeat)]
            copies_rss = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
        weights = weights_mib(base)
        adapter_mib = sum(weights_mib(p) for p in adapters)
    load.append(os.getloadavg()[0])
    rows = [median(runs["base"]), median(runs["adapters"]), median(runs["copies"])]
    rows[0].update(server_rss_mib=round(lora_rss, 1), weights_mib=f"{weights:.1f}")
    rows[1].update(server_rss_mib=round(lora_rss, 1), weights_mib=f"{weights:.1f} + {adapter_mib:.1f} adapters")
    rows[2].update(server_rss_mib=round(copies_rss, 1), weights_mib=f"{ADAPTERS} x {weights:.1f}")
    columns = ["mode", "output_tok_s", "runs", "itl_p50_ms", "itl_p99_ms", "weights_mib", "server_rss_mib"]
    text = common.table(rows, columns)
    ratio = rows[1]["output_tok_s"] / rows[0]["output_tok_s"]
    versus = rows[1]["output_tok_s"] / rows[2]["output_tok_s"]
    text += (f"\n\n{args.requests} requests at once, adapters rank {args.rank} on {', '.join(targets)}; medians of "
             f"{args.repeat} rounds.\n\n(b) / (a) tokens/s: {ratio:.2f}x (target >= 0.75x: "
             f"{'met' if ratio >= 0.75 else 'MISSED'}); (b) / (c): {versus:.2f}x tokens/s, "
             f"{lora_rss / copies_rss:.2f}x resident memory.\n\nMachine load average (1 min) at the start and end "
             f"of the run: {load[0]:.1f}, {load[1]:.1f}.\n")
    print(text)
    if not args.no_record:
        common.append_results("Multi-LoRA: adapters in one batch vs base vs merged copies (bench/lora.py)", text)


if __name__ == "__main__":
    main()
