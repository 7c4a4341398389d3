"""Cancel storms: does a server that saw thousands of abandoned generation streams keep their memory?

A storm is `--streams` gRPC Generate streams on a tiny Llama, 32 at a time, each abandoned at a random
point: before its first token (cancelled a random 0-20 ms after the call), mid-stream (after a random
1-40 tokens) or on a timer (a client deadline of 5-80 ms). Three storms run one after another against
one `ferry serve`; after each the script waits for every KV block to come back and samples the server's
RSS, glibc's in-use heap and (with --inspect) the live Python objects by type, so growth can be told
apart: RSS growth with a flat heap and flat object counts is pages the allocator keeps for the next
peak (server/heap.py), growth of objects or of the heap from storm to storm is a leak.

With --inspect the server runs inside this script's wrapper (`python -m bench.cancel_storm --serve`),
which answers SIGUSR1 by writing gc-tracked objects counted by type, tracemalloc's top allocation
sites (the wrapper starts tracemalloc when FERRY_STORM_TRACEMALLOC is set) and mallinfo2 to a file.

    python -m bench.cancel_storm [--streams 1000] [--storms 3] [--inspect] [--no-record]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import ctypes.util
import gc
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench import common, models
from bench.soak import Server
from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc

MODEL = "llm"
CONFIG = 'backend: llm\ngeneration: {block_size: 16, num_kv_blocks: 512, max_num_seqs: 32}\n'
CONCURRENCY = 32
DUMP_ENV = "FERRY_STORM_DUMP"  # where the wrapped server writes its SIGUSR1 report


def build_repository(root: Path) -> Path:
    models.random_llama(root / MODEL / "1", vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    (root / MODEL / "config.yaml").write_text(CONFIG)
    return root


# ------------------------------------------------------------------ the wrapped server (--inspect)
class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_in_use_mb() -> float:
    """glibc's bytes handed out and not freed (mallinfo2's uordblks + hblkhd), every arena."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallinfo2.restype = _Mallinfo2
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20
    except (OSError, AttributeError):
        return float("nan")


def _report(*_) -> None:
    gc.collect()
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    report = {"objects": sum(counts.values()), "by_type": dict(counts.most_common(60)),
              "heap_in_use_mb": round(heap_in_use_mb(), 1)}
    import tracemalloc

    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        report["traced_mb"] = round(sum(s.size for s in snapshot.statistics("filename")) / 2**20, 1)
        report["top_sites"] = [(str(s.traceback), s.size, s.count) for s in snapshot.statistics("lineno")[:25]]
    partial = Path(os.environ[DUMP_ENV] + ".partial")
    partial.write_text(json.dumps(report))
    partial.replace(os.environ[DUMP_ENV])  # whole or absent


def serve_wrapped(argv: list[str]) -> None:
    if os.environ.get("FERRY_STORM_TRACEMALLOC"):
        import tracemalloc

        tracemalloc.start(int(os.environ["FERRY_STORM_TRACEMALLOC"]))
    signal.signal(signal.SIGUSR1, lambda *a: _report())
    from server.__main__ import main as ferry_main

    ferry_main(argv)


def inspect(server: Server, dump: Path) -> dict:
    dump.unlink(missing_ok=True)
    os.kill(server.proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 600  # a tracemalloc snapshot of a busy server takes minutes
    while not dump.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return json.loads(dump.read_text())


class StormServer(Server):
    """bench.soak's server, run inside this script's wrapper when inspected."""

    def __init__(self, repo: Path, wrapped: bool):
        lines: list[str] = []
        cmd = common.ferry_command(repo)
        cmd[cmd.index("--metrics-port") + 1] = "0"
        if wrapped:
            cmd[1:3] = ["-m", "bench.cancel_storm", "--serve"]
        self.proc, self.address = common.start_server(cmd, lines=lines)
        self.metrics_url = re.search(r"serving metrics on (\S+)", "".join(lines)).group(1)


# ------------------------------------------------------------------ the storm
async def storm(address: str, streams: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    ends: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(i: int) -> None:
            how = ("before", "mid", "timer")[i % 3]
            timeout = rng.uniform(0.005, 0.08) if how == "timer" else 120
            request = gen.GenerateRequest(model_name=MODEL, token_ids=gen.TokenIds(
                ids=[rng.randrange(3, 512) for _ in range(rng.randrange(4, 64))]),
                sampling=gen.SamplingParams(max_tokens=rng.randrange(50, 200), ignore_eos=True))
            async with gate:
                call = stub.Generate(request, timeout=timeout)
                try:
                    if how == "before":
                        await asyncio.sleep(rng.uniform(0, 0.02))
                    else:
                        after = rng.randrange(1, 40)
                        async for _ in call:
                            after -= 1
                            if how == "mid" and after == 0:
                                break
                    call.cancel()
                    ends[how] += 1
                except grpc.aio.AioRpcError as exc:
                    ends[f"{how}:{exc.code().name}"] += 1

        await asyncio.gather(*(one(i) for i in range(streams)))
    return ends


def settle(server: Server) -> float:
    deadline = time.monotonic() + 60
    while (used := server.metric("ferry_kv_blocks_used", model=MODEL)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # let the loop finish what the last cancellations left
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--storms", type=int, default=3)
    parser.add_argument("--inspect", action="store_true", help="count live objects by type after each storm")
    parser.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                        help="with --inspect: trace allocations, this many frames deep, and print the top sites")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp) / "repo")
        dump = Path(tmp) / "report.json"
        env_before = dict(os.environ)
        if args.inspect:
            os.environ[DUMP_ENV] = str(dump)
            if args.tracemalloc:
                os.environ["FERRY_STORM_TRACEMALLOC"] = str(args.tracemalloc)
        server = StormServer(repo, args.inspect)
        os.environ.clear()
        os.environ.update(env_before)
        rows, reports = [], []
        try:
            # a few streams first: the first steps of each shape are the model's warm-up, not the storm's
            asyncio.run(storm(server.address, 64, args.seed + 99))
            settle(server)
            rows.append({"after": "warm-up (64 streams)", "rss_mb": round(server.memory_mb())})
            if args.inspect:
                reports.append(inspect(server, dump))
                rows[-1].update(objects=reports[-1]["objects"], heap_mb=reports[-1]["heap_in_use_mb"])
            for n in range(args.storms):
                started = time.monotonic()
                ends = asyncio.run(storm(server.address, args.streams, args.seed + n))
                used = settle(server)
                row = {"after": f"storm {n + 1}", "rss_mb": round(server.memory_mb()), "kv_blocks_used": f"{used:g}",
                       "seconds": round(time.monotonic() - started, 1), "ends": dict(sorted(ends.items()))}
                if args.inspect:
                    reports.append(inspect(server, dump))
                    row.update(objects=reports[-1]["objects"], heap_mb=reports[-1]["heap_in_use_mb"])
                rows.append(row)
                print(json.dumps(row), flush=True)
            peak = round(server.memory_mb("VmHWM"))
        finally:
            server.stop()
    if args.inspect and len(reports) >= 2:
        first, last = reports[1], reports[-1]
        grew = {t: last["by_type"].get(t, 0) - first["by_type"].get(t, 0) for t in last["by_type"]}
        grown = sorted(((t, d) for t, d in grew.items() if d), key=lambda kv: -kv[1])[:20]
        print("objects grown from storm 1 to the last:", json.dumps(dict(grown)))
        if "top_sites" in last:  # the sites that hold most now, with what they held after storm 1
            earlier = {site: size for site, size, _ in first["top_sites"]}
            for site, size, count in last["top_sites"][:15]:
                print(f"   {size / 2**20:8.1f} MB ({(size - earlier.get(site, 0)) / 2**20:+.1f}) in {count} blocks: {site}")
    columns = ["after", "rss_mb", "kv_blocks_used", "seconds"] + (["objects", "heap_mb"] if args.inspect else [])
    print(common.table(rows, columns))
    base = rows[1]["rss_mb"]
    later = [r["rss_mb"] - base for r in rows[2:]]
    verdict = (f"RSS after storm 1: {base} MB; after the later storms: "
               + ", ".join(f"{d:+d} MB" for d in later) + f" (target: within 50 MB); peak {peak} MB")
    print(verdict)
    if args.no_record:
        return
    body = "\n".join([
        f"`python -m bench.cancel_storm --streams {args.streams} --storms {args.storms}"
        f"{' --inspect' if args.inspect else ''}`: random Llama (2 layers, hidden 64), {CONCURRENCY} streams at a "
        "time, a third cancelled before the first token, a third mid-stream, a third by a client deadline.",
        "", common.table(rows, columns), "", verdict,
        "Ends by kind: " + "; ".join(f"storm {i + 1}: {r['ends']}" for i, r in enumerate(rows[1:])),
    ])
    common.append_results("Cancel storms (bench/cancel_storm.py)", body)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve_wrapped(sys.argv[2:])
    else:
        main()
