"""A generation step that raises fails only the sequence that made it raise: its neighbours in the
running batch complete token for token as they would have alone, and every KV block comes back.

The model is Ferry's own LLM backend with one fault added (tests/faulty_llm.py): a step that feeds the
poisoned prompt token raises after its forward pass. An endless stream keeps the running batch busy,
so the poisoned request is certainly stepped together with others, whatever the machine's speed.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the test model (test extra)")

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from tests import llm_builders
from tests.conftest import RunningServer

POISON = 3
ENDLESS = 60_000  # tokens: minutes of decoding on any CPU; cancelled by the test long before
MODEL = "faulty"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / MODEL / "1", "llama", max_positions=ENDLESS + 8)
    config = llm_builders.llm_config(block_size=16, num_kv_blocks=ENDLESS // 16 + 64)
    (repo / MODEL / "config.yaml").write_text(config + f"parameters: {{poison_token_id: {{string_value: '{POISON}'}}}}\n")
    running = RunningServer(repo, module="tests.faulty_llm")
    yield running
    running.stop()


def generate(channel, prompt: list[int], max_tokens: int, timeout_s: float = 120):
    request = gen.GenerateRequest(model_name=MODEL, sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    request.token_ids.ids.extend(prompt)
    return gen_grpc.GenerationStub(channel).Generate(request, timeout=timeout_s)


def tokens(channel, prompt: list[int], max_tokens: int) -> list[int]:
    return [t for r in generate(channel, prompt, max_tokens) for t in r.token_ids]


def test_a_raising_sequence_fails_alone_and_its_neighbours_match_their_solo_output(server):
    rng = random.Random(18)
    good = [([rng.choice([t for t in range(4, 300)]) for _ in range(rng.randrange(2, 30))], rng.randrange(8, 24))
            for _ in range(8)]
    poisoned = [40, 41, POISON, 42, 43]

    busy = generate(server.channel, [5, 6, 7], ENDLESS - 8, timeout_s=600)
    assert next(busy).token_ids  # running: every later step has at least two sequences

    def poisoned_call():
        with pytest.raises(grpc.RpcError) as failed:
            tokens(server.channel, poisoned, 16)
        return failed.value

    with ThreadPoolExecutor(9) as pool:
        bad = pool.submit(poisoned_call)
        together = list(pool.map(lambda case: tokens(server.channel, *case), good))
        error = bad.result()
    assert error.code() == grpc.StatusCode.INTERNAL
    assert f"model '{MODEL}' failed" in error.details() and "index out of range" in error.details()
    assert next(busy).token_ids  # the endless neighbour still streams
    busy.cancel()
    assert server.metric("nv_inference_request_failure", model=MODEL, reason="BACKEND") == 1  # the poisoned one only

    assert server.metric("ferry_generation_step_reruns_total", model=MODEL) > 0
    server.wait_for_metric("ferry_kv_blocks_used", 0, timeout_s=60, model=MODEL)
    assert server.metric("ferry_generation_running", model=MODEL) == 0
    server.wait_for_metric("ferry_queued_bytes", 0, timeout_s=60, model=MODEL)  # answered, failed, cancelled: all given back

    alone = [tokens(server.channel, *case) for case in good]  # no poisoned neighbour, one at a time
    assert together == alone
    assert [len(t) for t in together] == [n for _, n in good]
