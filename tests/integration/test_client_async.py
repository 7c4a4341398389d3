"""The asyncio Python client (clients.AsyncInferenceClient) against a real server: every call, every error path."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from clients import AsyncInferenceClient, FerryClientError
from tests.conftest import approx_fp32, serve_client_test_models



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = serve_client_test_models(tmp_path_factory.mktemp("repo"))
    yield server
    server.gate.touch()  # never leave an execution waiting while the server drains
    server.stop()


def run(server, body, **options):
    """Run `body(client)` in a fresh event loop with a client made inside it."""

    async def main():
        async with AsyncInferenceClient(server.address, **options) as client:
            return await body(client)

    return asyncio.run(main())


async def raises(awaitable) -> FerryClientError:
    with pytest.raises(FerryClientError) as info:
        await awaitable
    return info.value


def test_health_metadata_config_and_index(server):
    async def body(client):
        assert await client.is_live() and await client.is_ready()
        meta = await client.server_metadata()
        assert meta.name == "ferry" and "model_configuration" in meta.extensions
        assert await client.is_model_ready("classifier")
        classifier = await client.model_metadata("classifier")
        assert [(t.name, t.datatype, t.shape) for t in classifier.inputs] == [("features", "FP32", (-1, 32))]
        assert [(t.name, t.shape) for t in classifier.outputs] == [("probabilities", (-1, 4))]
        config = await client.model_config("simple", version="1")
        assert config.max_batch_size == 8 and list(config.dynamic_batching.preferred_batch_size) == [4, 8]
        index = {(m.name, m.version, m.state) for m in await client.repository_index()}
        assert {("simple", "1", "READY"), ("types", "1", "READY")} <= index
        assert len(await client.repository_index(ready_only=True)) == len(index)

    run(server, body, timeout_s=60)


def test_infer_raw_tensors_statistics_and_concurrent_calls(server):
    async def body(client):
        before = sum(s.inference_count for s in await client.model_statistics("classifier"))
        rows = [np.random.default_rng(i).standard_normal((1, 32)).astype(np.float32) for i in range(16)]
        answers = await asyncio.gather(*(client.infer("classifier", {"features": r}) for r in rows))
        one_batch = await client.infer("classifier", {"features": np.concatenate(rows)}, outputs=["probabilities"])
        for i, answer in enumerate(answers):  # each caller gets its own row back, whatever was batched
            assert answer["probabilities"][0] == approx_fp32(one_batch["probabilities"][i])
        after = sum(s.inference_count for s in await client.model_statistics("classifier"))
        assert after - before == 32
        inputs = {f"IN_{t}": np.zeros((1, 2), d) for t, d in NUMERIC.items()}
        inputs.update(IN_BYTES=np.array([["a", "ünï"]]), IN_UINT64=np.array([[2**64 - 1, 0]], np.uint64))
        out = await client.infer("types", inputs, outputs=["OUT_BYTES", "OUT_UINT64"], request_id="x",
                                 parameters={"priority": 1})
        assert out["OUT_BYTES"].tolist() == [[b"a", "ünï".encode()]]
        assert out["OUT_UINT64"].tolist() == [[2**64 - 1, 0]]

    run(server, body, timeout_s=60)


NUMERIC = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "INT8": np.int8,
           "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16, "FP32": np.float32,
           "FP64": np.float64}


def test_errors_carry_status_and_server_message(server):
    async def body(client):
        a = np.ones((1, 16), np.float32)
        err = await raises(client.infer("nope", {"INPUT0": a}))
        assert err.status == grpc.StatusCode.NOT_FOUND and "nope" in err.message
        err = await raises(client.infer("simple", {"INPUT0": a}))
        assert err.status == grpc.StatusCode.INVALID_ARGUMENT and "INPUT1" in err.message
        err = await raises(client.model_config("nope"))
        assert err.status == grpc.StatusCode.NOT_FOUND
        for call in (client.load_model("nope"), client.unload_model("nope")):
            assert (await raises(call)).status == grpc.StatusCode.NOT_FOUND
        err = await raises(anext(client.generate("simple", "hello")))
        assert err.status == grpc.StatusCode.INVALID_ARGUMENT and "not a generation model" in err.message

    run(server, body, timeout_s=60)


def test_per_call_timeout_overrides_the_clients_default(server):
    held = {"X": np.full((1, 2), -1, np.float32)}  # the gated model holds it until the gate file exists

    async def body(client):
        err = await raises(client.infer("gated", held))
        assert err.status == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await client.is_live(timeout_s=60)
        asyncio.get_running_loop().call_later(1.0, server.gate.touch)  # well past the 0.3 s default
        out = await client.infer("gated", held, timeout_s=60)
        assert out["Y"].tolist() == [[-1, -1]]

    run(server, body, timeout_s=0.3)


def test_generate_streams_deltas_then_usage(server):
    async def body(client):
        deltas = [d async for d in client.generate("tiny_llama", "the ferry leaves", max_tokens=10, ignore_eos=True)]
        assert len(deltas) > 1 and all(not d.last for d in deltas[:-1])
        final = deltas[-1]
        assert final.finish_reason == "length" and final.usage.completion_tokens == 10
        assert sum(len(d.token_ids) for d in deltas) == 10 and final.timings.total_ms > 0
        streams = [client.generate("tiny_llama", [5, 6, 7], max_tokens=4, ignore_eos=True, seed=i) for i in range(4)]
        finals = await asyncio.gather(*(last(s) for s in streams))
        assert all(f.usage.prompt_tokens == 3 and f.usage.completion_tokens == 4 for f in finals)
        early = client.generate("tiny_llama", "the ferry", max_tokens=200, ignore_eos=True)
        assert not (await anext(early)).last
        await early.aclose()  # cancels the RPC
        after = await last(client.generate("tiny_llama", "x", max_tokens=2, ignore_eos=True))
        assert after.usage.completion_tokens == 2

    run(server, body, timeout_s=120)


async def last(stream):
    final = None
    async for delta in stream:
        final = delta
    return final
