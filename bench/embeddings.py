"""Embeddings: Ferry's /v1/embeddings under 64 concurrent clients against sentence-transformers in process.

    python -m bench.embeddings [--texts 10000] [--clients 64] [--no-record]

The encoder is a random BERT (hidden 256, 4 layers, 4 heads, intermediate 1024, max 512 tokens, mean pooling
+ Normalize; ~3.2M weights outside the embeddings) saved by sentence-transformers (tests/embedding_builders.py).
The texts: `--texts` of 5-500 tokens, long-tailed (log-normal, median ~40 tokens, clipped), the same for
every system. Three runs:
- in process: `SentenceTransformer.encode(texts, batch_size=32)` (it sorts the texts by length, its best case);
- Ferry, bin packing (the embedding backend's default: batches drawn from learned token-count buckets under a
  padded-token budget): `--clients` concurrent clients, each POSTing one text at a time to /v1/embeddings;
- Ferry, FIFO dynamic batching on the same model and load (a batch is whatever waits, padded to its longest).
It reports texts/s of each, mean batch size and the two ratios (target: served / in process >= 0.8x,
bin packing / FIFO >= 1.5x), and appends them to RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench import common
from tests import embedding_builders

HIDDEN, LAYERS, HEADS, MAX_LEN = 256, 4, 4, 512
CONFIGS = {
    "binpack": None,  # no config file: recognised from modules.json, bin packing by token count (the default)
    "fifo": 'backend: "embedding"\nmax_batch_size: 64\ndynamic_batching {}\n',
}


def make_texts(count: int, seed: int) -> list[str]:
    """Texts of 5-500 tokens (2 special tokens + one token a word), long-tailed."""
    rng = np.random.default_rng(seed)
    tokens = np.clip(np.round(rng.lognormal(np.log(40), 0.9, count)), 5, 500).astype(int)
    words = np.array(embedding_builders.WORDS)
    return [" ".join(words[rng.integers(0, len(words), n - 2)]) for n in tokens]


async def clients(url: str, model: str, texts: list[str], concurrency: int) -> float:
    import aiohttp

    queue = list(reversed(texts))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client() -> None:
            while queue:
                text = queue.pop()
                async with session.post(f"{url}/v1/embeddings", json={"model": model, "input": text}) as answer:
                    body = await answer.json()
                    if answer.status != 200:
                        raise RuntimeError(body)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return time.perf_counter() - start


def serve(repo: Path, model: str, texts: list[str], concurrency: int) -> dict:
    lines: list[str] = []
    proc, address = common.start_server(common.ferry_command(repo, "--model-control-mode", "explicit",
                                                             "--load-model", model), lines=lines)
    try:
        http = next(m.group(1) for line in lines if (m := re.search(r"ferry: serving HTTP on (\S+)", line)))
        url = f"http://{http}"
        asyncio.run(clients(url, model, texts[:concurrency], concurrency))  # warm-up
        with grpc.insecure_channel(address) as channel:
            before = common.model_counts(channel, model)
            seconds = asyncio.run(clients(url, model, texts, concurrency))
            after = common.model_counts(channel, model)
    finally:
        proc.terminate()
        proc.wait(30)
    rows, batches = after[0] - before[0], after[1] - before[1]
    return {"system": f"Ferry, {model} ({concurrency} clients, one text a request)", "texts/s": round(len(texts) / seconds, 1),
            "seconds": round(seconds, 1), "mean batch": round(rows / max(batches, 1), 1)}


def in_process(folder: Path, texts: list[str]) -> dict:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model.encode(texts[:64], batch_size=32)  # warm-up
    start = time.perf_counter()
    model.encode(texts, batch_size=32, convert_to_numpy=True)
    seconds = time.perf_counter() - start
    return {"system": "sentence-transformers in process (encode, sorted batches of 32)",
            "texts/s": round(len(texts) / seconds, 1), "seconds": round(seconds, 1), "mean batch": 32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--texts", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    texts = make_texts(args.texts, seed=0)
    lengths = np.array([len(t.split()) + 2 for t in texts])
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        for name, config in CONFIGS.items():
            embedding_builders.build_encoder(repo / name / "1", "mean", True, seed=0, hidden=HIDDEN, layers=LAYERS,
                                             heads=HEADS, max_seq_length=MAX_LEN, max_positions=MAX_LEN)
            if config is not None:
                (repo / name / "config.pbtxt").write_text(config)
        rows = [in_process(repo / "binpack" / "1", texts)]
        print(rows[-1], flush=True)
        for name in CONFIGS:
            rows.append(serve(repo, name, texts, args.clients))
            print(rows[-1], flush=True)
    base, packed, fifo = (r["texts/s"] for r in rows)
    summary = (f"served (bin packing) / in process: {packed / base:.2f}x (target >= 0.8x); "
               f"bin packing / FIFO: {packed / fifo:.2f}x (target >= 1.5x)")
    print(summary)
    if args.no_record:
        return
    body = (f"Encoder: random BERT, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, intermediate {HIDDEN * 4}, max "
            f"{MAX_LEN} tokens, mean pooling + Normalize (sentence-transformers folder). {args.texts} texts of "
            f"{lengths.min()}-{lengths.max()} tokens (median {int(np.median(lengths))}, mean {lengths.mean():.0f}, p99 "
            f"{int(np.percentile(lengths, 99))}), the same texts for every system; Ferry's clients in one process "
            f"(aiohttp) on the same machine.\n\n"
            + common.table(rows, ["system", "texts/s", "seconds", "mean batch"]) + f"\n\n{summary}"
            + common.load_note(load))
    common.append_results("Embeddings: /v1/embeddings against sentence-transformers in process (bench/embeddings.py)", body)


if __name__ == "__main__":
    main()
