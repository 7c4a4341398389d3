"""A storm of abandoned generation streams leaves nothing behind: every KV block free, and no request,
stream or sequence object alive in the server (counted by class in the server process, not judged by
its memory; bench/cancel_storm.py measures the memory)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from tests import llm_builders
from tests.conftest import RunningServer, wait_for

MODEL = "llama"
STREAMS = 150  # per storm: a third before the first token, a third mid-stream, a third by a deadline
# What one generation stream is made of in the server, front door to engine.
PER_STREAM = ("server.request.InferRequest", "server.runners.generation.GenerationRequest",
              "server.runners.generation._Stream", "server.scheduling.sequence.Sequence")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / MODEL / "1", "llama")
    (repo / MODEL / "config.yaml").write_text(llm_builders.llm_config(max_num_seqs=8, num_kv_blocks=256))
    dump = tmp_path_factory.mktemp("dump") / "live.json"
    running = RunningServer(repo, module="tests.live_objects", env={"FERRY_LIVE_OBJECTS": str(dump),
                                                                             "FERRY_LIVE_TRACE": ",".join(PER_STREAM)})
    running.dump = dump
    yield running
    running.stop()


def live(server) -> dict[str, int]:
    server.dump.unlink(missing_ok=True)
    os.kill(server.proc.pid, signal.SIGUSR1)
    wait_for(server.dump.exists, 60, what="the server to count its objects")
    return json.loads(server.dump.read_text())


async def storm(address: str, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    ends: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        gate = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            how = ("before", "mid", "timer")[i % 3]
            request = gen.GenerateRequest(model_name=MODEL, token_ids=gen.TokenIds(
                ids=[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))]),
                sampling=gen.SamplingParams(max_tokens=200, ignore_eos=True))
            async with gate:
                call = stub.Generate(request, timeout=rng.uniform(0.01, 0.2) if how == "timer" else 120)
                try:
                    if how == "before":
                        await asyncio.sleep(rng.uniform(0, 0.01))
                    else:
                        after = rng.randrange(1, 20)
                        async for _ in call:
                            after -= 1
                            if how == "mid" and after == 0:
                                break
                    call.cancel()
                    ends[how] = ends.get(how, 0) + 1
                except grpc.aio.AioRpcError as exc:
                    ends[exc.code().name] = ends.get(exc.code().name, 0) + 1

        await asyncio.gather(*(one(i) for i in range(STREAMS)))
    return ends


def settled(server) -> dict[str, int]:
    """The per-stream objects still alive, once every block is back (waited for with a generous bound)."""
    server.wait_for_metric("ferry_kv_blocks_used", 0, timeout_s=120, model=MODEL)
    deadline = time.monotonic() + 60
    while True:
        counts = live(server)
        left: dict = {name: counts.get(name, 0) for name in PER_STREAM if counts.get(name, 0)}
        if not left:
            return left
        if time.monotonic() > deadline:
            return {**left, "held by": counts.get("holders")}
        time.sleep(0.5)


def test_cancelled_streams_leave_no_object_and_no_block_behind(server):
    before = live(server)
    assert not any(before.get(name) for name in PER_STREAM)
    for seed in range(2):
        ends = asyncio.run(storm(server.address, seed))
        assert sum(ends.values()) == STREAMS and not set(ends) - {"before", "mid", "timer", "DEADLINE_EXCEEDED"}, ends
        assert settled(server) == {}
    assert server.metric("ferry_kv_blocks_used", model=MODEL) == 0
    counts = live(server)
    # Nothing else grows with the streams either: no class has 100 more live objects than before them.
    grown = {name: n - before.get(name, 0) for name, n in counts.items()
             if isinstance(n, int) and n - before.get(name, 0) >= 100}
    assert grown == {}
    # and the server still serves
    stub = gen_grpc.GenerationStub(server.channel)
    out = list(stub.Generate(gen.GenerateRequest(model_name=MODEL, token_ids=gen.TokenIds(ids=[3, 4, 5]),
                                                 sampling=gen.SamplingParams(max_tokens=4, ignore_eos=True)),
                             timeout=120))
    assert sum(len(r.token_ids) for r in out) == 4
