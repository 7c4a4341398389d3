"""Offline batch inference: `ferry batch` in-process vs a server's OpenAI API vs transformers' static batching.

    python -m bench.batch [--requests 1000] [--clients 64] [--static-batch 16] [--ray-actors 1,2]
                          [--rss-lines 100000] [--no-ray] [--no-record]

One chat file (OpenAI Batch format) of mixed prompt lengths on one locally saved random Llama with a
chat template, answered four ways, every figure from this one run:
  (a) `ferry batch -i FILE --model-repository REPO`: in-process, no port;
  (b) `ferry serve` and the same bodies sent to its /v1/chat/completions by --clients concurrent
      clients (aiohttp keep-alive), as a user's own client loop would;
  (c) transformers' static batching: batches of --static-batch in file order, prompts left-padded,
      each batch generated until its longest member is done;
  (d) `ferry batch --ray local --ray-actors N` for each N of --ray-actors (actor start-up included).
Output tokens/s counts each request's own max_tokens (ignore_eos), so padding does not count. Ratios
(a)/(b) and (a)/(c) are the issue's goals (>= 1.3x, >= 3x). Peak RSS: `ferry batch` on a --rss-lines
file and on a tenth of it, infer lines to a small ONNX model (bounded in flight: the two should match).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import common, models

VOCAB = 1024
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # prompt = the words, so ids are known


def build_repo(repo: Path) -> Path:
    folder = models.random_llama(repo / "chat" / "1", vocab=VOCAB, hidden=256, intermediate=688, layers=4, heads=4,
                                 kv_heads=2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (repo / "chat" / "config.yaml").write_text(
        "backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 6144, max_num_seqs: 256, "
        "max_num_batched_tokens: 2048, max_model_len: 1024}\n")
    models.light_mlp(repo / "mlp" / "1" / "model.onnx")
    return folder


def chat_file(path: Path, count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """70% short chats (8-32 prompt words, 8-32 out), 30% long (64-256 prompt, 32-64 out); returns the jobs."""
    rng = np.random.default_rng(seed)
    jobs = []
    with open(path, "w") as out:
        for i in range(count):
            short = rng.random() < 0.7
            prompt = rng.integers(2, VOCAB, int(rng.integers(8, 33) if short else rng.integers(64, 257))).tolist()
            n = int(rng.integers(8, 33) if short else rng.integers(32, 65))
            jobs.append((prompt, n))
            body = {"model": "chat", "messages": [{"role": "user", "content": " ".join(f"t{t}" for t in prompt)}],
                    "max_tokens": n, "temperature": 0, "ignore_eos": True}
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    return jobs


def infer_file(path: Path, count: int) -> None:
    line = {"method": "POST", "url": "/v2/models/mlp/infer",
            "body": {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": [0.5] * 256}]}}
    with open(path, "w") as out:
        for i in range(count):
            out.write(json.dumps({"custom_id": f"r{i}", **line}) + "\n")


def ferry_batch(source: Path, output: Path, repo: Path, *extra: str) -> tuple[float, str]:
    """(wall seconds, the summary line) of one `ferry batch` run."""
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "server", "batch", "-i", str(source), "-o", str(output),
                           "--model-repository", str(repo), *extra], cwd=common.ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"ferry batch failed:\n{done.stderr[-3000:]}")
    return wall, done.stderr.strip().splitlines()[-1]


def batch_row(name: str, wall: float, summary: str, tokens: int) -> dict:
    rate = float(re.search(r"\(([\d.]+) tokens/s", summary).group(1))
    return {"run": name, "output tokens/s": round(rate), "wall s (with model load)": round(wall, 1), "tokens": tokens}


async def serve_clients(url: str, source: Path, clients: int) -> tuple[int, float]:
    """Every body of the file to `url`'s OpenAI API from `clients` concurrent clients; (tokens, seconds)."""
    import aiohttp

    bodies = [json.loads(line)["body"] for line in source.read_text().splitlines()]
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    tokens = 0

    async def client(session) -> None:
        nonlocal tokens
        while not queue.empty():
            body = queue.get_nowait()
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                answer = await response.json()
                tokens += answer["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return tokens, time.perf_counter() - start


def served_row(repo: Path, source: Path, clients: int) -> dict:
    lines: list[str] = []
    proc, _ = common.start_server(common.ferry_command(repo), lines=lines)
    try:
        http = re.search(r"serving HTTP on (\S+)", "".join(lines)).group(1)
        tokens, seconds = asyncio.run(serve_clients(f"http://{http}", source, clients))
    finally:
        proc.terminate()
        proc.wait()
    return {"run": f"(b) ferry serve, OpenAI API, {clients} clients", "output tokens/s": round(tokens / seconds),
            "wall s (with model load)": "", "tokens": tokens}


def static_row(folder: Path, jobs: list[tuple[list[int], int]], batch: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(jobs), batch):
            group = jobs[i:i + batch]
            width, longest = max(len(p) for p, _ in group), max(n for _, n in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    seconds = time.perf_counter() - start
    useful = sum(n for _, n in jobs)
    return {"run": f"(c) transformers static batches of {batch}", "output tokens/s": round(useful / seconds),
            "wall s (with model load)": "", "tokens": useful}


def peak_rss_mib(source: Path, output: Path, repo: Path) -> tuple[float, float]:
    """(peak RSS MiB, wall s) of one `ferry batch` run, from that child's own rusage (wait4)."""
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "server", "batch", "-i", str(source), "-o", str(output),
                                 "--model-repository", str(repo)], cwd=common.ROOT, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"ferry batch failed:\n{err.read().decode()[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--ray-actors", default="1,2")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--rss-lines", type=int, default=100_000)
    parser.add_argument("--no-record", action="store_true", help="print only, do not append to bench/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repo = tmp / "repo"
        folder = build_repo(repo)
        rss = rss_rows(tmp, repo, args.rss_lines)
        source = tmp / "chat.jsonl"
        jobs = chat_file(source, args.requests)
        tokens = sum(n for _, n in jobs)
        rows = [batch_row("(a) ferry batch, in-process", *ferry_batch(source, tmp / "a.jsonl", repo), tokens),
                served_row(repo, source, args.clients), static_row(folder, jobs, args.static_batch)]
        if not args.no_ray:
            for actors in map(int, args.ray_actors.split(",")):
                wall, summary = ferry_batch(source, tmp / f"ray{actors}.jsonl", repo, "--ray", "local",
                                            "--ray-actors", str(actors))
                rows.append(batch_row(f"(d) ferry batch --ray local, {actors} actor(s)", wall, summary, tokens))
    report = render(args, jobs, rows, rss)
    print(report)
    if not args.no_record:
        common.append_results("Offline batch (bench/batch.py)", report)


def rss_rows(tmp: Path, repo: Path, lines: int) -> list[dict]:
    rows = []
    for count in (lines // 10, lines):
        source = tmp / f"infer{count}.jsonl"
        infer_file(source, count)
        peak, wall = peak_rss_mib(source, tmp / "rss.jsonl", repo)
        rows.append({"lines": count, "peak RSS MiB": round(peak), "wall s": round(wall, 1)})
        source.unlink()
    return rows


def render(args, jobs, rows: list[dict], rss: list[dict]) -> str:
    rate = {row["run"][:3]: row["output tokens/s"] for row in rows}
    prompt = [len(p) for p, _ in jobs]
    lines = [f"{len(jobs)} chat requests, prompts {min(prompt)}-{max(prompt)} words (median {int(np.median(prompt))}), "
             f"{sum(n for _, n in jobs)} output tokens; random Llama (4 layers, hidden 256), max_num_seqs 256.", "",
             common.table(rows, ["run", "output tokens/s", "wall s (with model load)", "tokens"]), "",
             f"(a)/(b) = {rate['(a)'] / rate['(b)']:.2f}x (goal 1.3x), (a)/(c) = {rate['(a)'] / rate['(c)']:.2f}x (goal 3x)",
             "", "Peak RSS of `ferry batch` (infer lines to a small ONNX MLP, 256 in flight):", "",
             common.table(rss, ["lines", "peak RSS MiB", "wall s"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
