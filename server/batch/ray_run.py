"""`ferry batch --ray`: Ray Data reads INPUT and an actor pool, one in-process Ferry engine per actor,
answers it; the driver appends the answers to the one OUTPUT as blocks come back, or, with `-o DIR/`,
each actor appends the answers of every batch it is handed to a shard of its own in DIR (one shard per
block; DIR must be on storage every node can write) and hands the driver only the counts.

Ray is the distributed engine: it splits the file into blocks, schedules them on actors, moves the
answers back and retries what a lost node held. Each actor runs a block's lines through the same
`run_lines` as a single-process run (bounded in flight, answers from the HTTP door's app), so the
answers are the same. The resume rule is the driver's: ids already in OUTPUT are filtered out before
any actor sees them (ids in any shard of DIR, for a folder), and each file has one writer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from pathlib import Path

import ray
import ray.data

from server.batch.output import AnswerWriter, Collected, ShardWriter
from server.batch.progress import Progress, Tally
from server.batch.requests import parse
from server.batch.run import run_lines

log = logging.getLogger("ferry.batch")
_COUNTS = ("ok", "refused", "prompt_tokens", "completion_tokens")  # what an actor writing shards reports per batch


class EngineActor:
    """One in-process engine on its own event loop thread; Ray calls it with blocks of input lines."""

    def __init__(self, repository: str, in_flight: int, folder: str | None = None):
        from server.batch.local import LocalEngine

        self.in_flight, self.folder = in_flight, folder
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="ferry-engine", daemon=True).start()
        self.engine = LocalEngine(Path(repository))
        self._wait(self.engine.__aenter__())

    def _wait(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def __call__(self, batch: dict) -> dict:
        lines = [parse(0, text) for text in batch["text"]]  # the driver validated the file
        tally = Tally(len(lines))
        if self.folder is None:
            collected = Collected()
            self._wait(run_lines(self.engine, lines, collected, tally, self.in_flight))
            return {"answer": collected.lines}
        with ShardWriter(Path(self.folder)) as shard:
            self._wait(run_lines(self.engine, lines, shard, tally, self.in_flight))
        return {name: [getattr(tally, name)] for name in _COUNTS}


def run_on_ray(args, done: set[str], tally: Tally) -> None:
    """Answer every line of args.input not in `done` on Ray, appending to args.output."""
    _connect(args.ray, args.ray_actors * args.ray_cpus_per_actor)
    try:
        lines = ray.data.read_text(str(args.input.resolve()), drop_empty_lines=True)
        if done:
            lines = lines.filter(lambda row: _custom_id(row["text"]) not in done)
        answers = lines.map_batches(
            EngineActor, fn_constructor_kwargs={
                "repository": str(args.model_repository.resolve()), "in_flight": args.max_in_flight,
                "folder": str(args.output.resolve()) if args.folder else None},
            batch_size=args.ray_batch_size, compute=ray.data.ActorPoolStrategy(size=args.ray_actors),
            num_cpus=args.ray_cpus_per_actor, num_gpus=args.ray_gpus_per_actor or None)
        progress = Progress(tally)
        tally.started = time.perf_counter()
        if args.folder:
            for batch in answers.iter_batches(batch_size=None, batch_format="numpy"):
                for name in _COUNTS:
                    setattr(tally, name, getattr(tally, name) + int(batch[name].sum()))
                progress()
        else:
            _append(answers, args.output, tally, progress)
        tally.unanswered = tally.total - tally.ok - tally.refused  # lines an actor left for the rerun (a lasting 503)
    finally:
        ray.shutdown()


def _append(answers, output: Path, tally: Tally, progress) -> None:
    with AnswerWriter(output) as writer:
        for batch in answers.iter_batches(batch_size=None, batch_format="numpy"):
            for text in batch["answer"]:
                writer.write_line(str(text))
                response = json.loads(text)["response"]
                usage = response["body"].get("usage") if isinstance(response["body"], dict) else None
                tally.add(response["status_code"], (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
                          if isinstance(usage, dict) else (0, 0))
            writer.flush()
            progress()


def _connect(address: str, actor_cpus: float) -> None:
    """`local` starts Ray here with room for the actors and Ray Data's read tasks; anything else joins."""
    if address == "local":
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(actor_cpus) + 1), include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ferry batch draws its own progress line
    if not log.isEnabledFor(logging.INFO):
        logging.getLogger("ray").setLevel(logging.WARNING)


def _custom_id(text: str) -> str:
    return json.loads(text)["custom_id"]
