"""Sliding-window decode cost: a Mistral whose every layer slides against the same weights without a window.

    python -m bench.sliding_window [--contexts 512,2048] [--window 256] [--seqs 8] [--rounds 5] [--no-record]

One random Mistral (transformers' save_pretrained) in two folders: `sliding_window` set, and None.
Both engines run in process (scheduler + `LLMBackend.step`, no gRPC), each with the same prompts of
`context` tokens; once the prompts are in, rounds of 8 decode steps alternate between the two and
the median step time of each is kept. When every layer slides, a decode gathers only the last
`window` keys, so its step time should stay flat as the context grows while full attention's grows:
the figure is full / windowed step time at each context. Beside it, the KV blocks each engine holds
at the end: the windowed one gives back the blocks behind its window (kv_blocks.py), the full one keeps
every sequence's whole length. Appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench import common, models

STEPS_PER_ROUND = 8


def build(folder: Path, window: int, max_positions: int) -> tuple[Path, Path]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions,
                                        sliding_window=window, bos_token_id=0, eos_token_id=1)
    windowed = folder / "window" / "1"
    transformers.MistralForCausalLM(config).save_pretrained(str(windowed))
    models.word_tokenizer(windowed, 2048)
    full = folder / "full" / "1"
    shutil.copytree(windowed, full)
    raw = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    return windowed, full


class Engine:
    """One backend and its scheduler, decoding `seqs` prompts of `context` tokens without end."""

    def __init__(self, folder: Path, context: int, seqs: int):
        from protos import model_config_pb2 as mc
        from server.backends.base import Device
        from server.backends.llm.engine import LLMBackend
        from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
        from server.scheduling.kv_blocks import KVBlockPool
        from server.scheduling.sequence import SamplingParams, Sequence

        blocks = seqs * (context + 32 * STEPS_PER_ROUND) // 16 + 64
        config = mc.ModelConfig(name="bench", backend="llm")
        config.generation.block_size, config.generation.num_kv_blocks = 16, blocks
        self.backend = LLMBackend(config, folder / "config.json", Device("cpu"))
        self.backend.load()
        settings = ContinuousSettings(max_num_seqs=seqs, max_num_batched_tokens=2048, max_model_len=self.backend.max_model_len)
        pool = KVBlockPool(blocks, 16, prefix_caching=False, window=self.backend.released_window)
        self.scheduler = ContinuousScheduler(settings, pool)
        for i in range(seqs):
            prompt = [2 + (i * 7919 + j * 104729) % 2000 for j in range(context)]
            self.scheduler.submit(Sequence(i, prompt, context, SamplingParams(max_tokens=10**6, ignore_eos=True)))
        while self.scheduler.num_waiting or any(s.num_output == 0 for s in self.scheduler.running):
            self.step()

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.scheduler.postprocess(plan, self.backend.step(plan))

    def timed_round(self) -> list[float]:
        times = []
        for _ in range(STEPS_PER_ROUND):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times


def measure(windowed: Path, full: Path, context: int, seqs: int, rounds: int) -> dict:
    engines = {"window": Engine(windowed, context, seqs), "full": Engine(full, context, seqs)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):  # interleaved, so a burst of load from elsewhere hits both
        for name, engine in engines.items():
            times[name] += engine.timed_round()
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    held = {name: engine.scheduler.pool.num_used for name, engine in engines.items()}
    return {"context": context, "windowed step (ms)": f"{medians['window']:.1f}", "full step (ms)": f"{medians['full']:.1f}",
            "full / windowed": f"{medians['full'] / medians['window']:.2f}",
            "KV blocks held, windowed / full": f"{held['window']} / {held['full']}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        windowed, full = build(Path(tmp), args.window, max(contexts) + 32 * STEPS_PER_ROUND * args.rounds)
        for context in contexts:
            rows.append(measure(windowed, full, context, args.seqs, args.rounds))
            print(rows[-1], flush=True)
    report = (f"Random Mistral (4 layers, hidden 256, 8 heads / 2 KV heads), window {args.window}, {args.seqs} sequences "
              f"decoding together, fp32 on the CPU; median of {args.rounds} interleaved rounds of {STEPS_PER_ROUND} "
              f"decode steps each.\n\n" + common.table(rows, list(rows[0])))
    print(report)
    if not args.no_record:
        common.append_results("Sliding-window decode (bench/sliding_window.py)", report)


if __name__ == "__main__":
    main()
