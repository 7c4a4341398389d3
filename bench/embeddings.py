"""Embeddings: Ferry's /v1/embeddings under 64 concurrent clients against sentence-transformers in process.

    python -m bench.embeddings [--texts 10000] [--clients 64] [--rounds 3] [--no-record]

The encoder is a random BERT (hidden 256, 4 layers, 4 heads, intermediate 1024, max 512 tokens, mean pooling
+ Normalize; ~3.2M weights outside the embeddings) saved by sentence-transformers (tests/embedding_builders.py).
The texts: `--texts` of 5-500 tokens, long-tailed (log-normal, median ~40 tokens, clipped), the same for
every system. The runs:
- in process: `SentenceTransformer.encode(texts, batch_size=32)` (it sorts the texts by length, its best case),
  twice a round (the A/A control);
- Ferry, bin packing (the embedding backend's default: batches drawn from learned token-count buckets under a
  padded-token budget, the encoder in ONNX Runtime): `--clients` concurrent clients, each POSTing one text at a
  time to /v1/embeddings; and the same with the encoder in torch (`encoder_runtime: torch`);
- Ferry, FIFO dynamic batching on the same model and load (a batch is whatever waits, padded to its longest).
Interleaved over `--rounds`, FIFO once (it is slow). It reports the median texts/s of each, mean batch size
and the ratios (target: served / in process >= 0.8x,
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
    "binpack_torch": 'backend: "embedding"\nparameters { key: "encoder_runtime" value { string_value: "torch" } }\n',
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
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the fast systems")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    texts = make_texts(args.texts, seed=0)
    lengths = np.array([len(t.split()) + 2 for t in texts])
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        for name, config in CONFIGS.items():
            embedding_builders.build_encoder(repo / name / "1", "mean", True, seed=0, hidden=HIDDEN, layers=LAYERS,
                                             heads=HEADS, max_seq_length=MAX_LEN, max_positions=MAX_LEN)
            if config is not None:
                (repo / name / "config.pbtxt").write_text(config)
        folder = repo / "binpack" / "1"
        for _ in range(args.rounds):  # in process twice a round: the A/A control
            for key, run in (("in process", lambda: in_process(folder, texts)),
                             ("binpack", lambda: serve(repo, "binpack", texts, args.clients)),
                             ("binpack_torch", lambda: serve(repo, "binpack_torch", texts, args.clients)),
                             ("in process (A/A)", lambda: in_process(folder, texts))):
                runs.setdefault(key, []).append(run())
                if key.endswith("(A/A)"):
                    runs[key][-1]["system"] = "sentence-transformers in process, again (the A/A control)"
                print(key, runs[key][-1], flush=True)
        runs["fifo"] = [serve(repo, "fifo", texts, args.clients)]  # slow (about 3 minutes): once
        print("fifo", runs["fifo"][-1], flush=True)
    rate = {key: [r["texts/s"] for r in rs] for key, rs in runs.items()}
    per_round = lambda a, b: [x / y for x, y in zip(rate[a], rate[b])]  # noqa: E731
    control = per_round("in process (A/A)", "in process")
    served = per_round("binpack", "in process")
    onnx_gain = per_round("binpack", "binpack_torch")
    rows = [{**rs[0], "texts/s": round(float(np.median(rate[key])), 1), "seconds": round(float(np.median(
        [r["seconds"] for r in rs])), 1), "rounds": len(rs), "per round": " / ".join(f"{v:.0f}" for v in rate[key])}
        for key, rs in runs.items()]
    spread = f"{min(control):.2f}-{max(control):.2f}"
    summary = (f"served (bin packing) / in process: median {np.median(served):.2f}x over {args.rounds} rounds "
               f"(each: {', '.join(f'{v:.2f}' for v in served)}; target >= 0.8x); A/A control (in process twice a "
               f"round): {spread}; encoder in ONNX Runtime / in torch, both served: median {np.median(onnx_gain):.2f}x; "
               f"bin packing / FIFO: {float(np.median(rate['binpack'])) / rate['fifo'][0]:.2f}x (target >= 1.5x)")
    print(summary)
    if args.no_record:
        return
    body = (f"Encoder: random BERT, hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, intermediate {HIDDEN * 4}, max "
            f"{MAX_LEN} tokens, mean pooling + Normalize (sentence-transformers folder). {args.texts} texts of "
            f"{lengths.min()}-{lengths.max()} tokens (median {int(np.median(lengths))}, mean {lengths.mean():.0f}, p99 "
            f"{int(np.percentile(lengths, 99))}), the same texts for every system; Ferry's clients in one process "
            f"(aiohttp) on the same machine. Medians of interleaved rounds (in process, Ferry with the encoder in ONNX "
            f"Runtime, Ferry with it in torch, in process again); FIFO once, after them.\n\n"
            + common.table(rows, ["system", "texts/s", "seconds", "mean batch", "rounds", "per round"]) + f"\n\n{summary}"
            + common.load_note(load, "Systems ran in interleaved rounds."))
    common.append_results("Embeddings: /v1/embeddings against sentence-transformers in process (bench/embeddings.py)", body)


if __name__ == "__main__":
    main()
