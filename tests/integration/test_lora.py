"""LoRA adapters over one base model, through the real server: adapters of different ranks built with
`peft` decode exactly as transformers + peft's merged model, while they and the base model share
steps; adapters are loaded and unloaded at run time; an unknown one is a 404 / NOT_FOUND; and the
prefix cache never hands one adapter's blocks to another."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
pytest.importorskip("peft", reason="peft builds the adapters and their references (test extra)")
openai = pytest.importorskip("openai")

from protos import generate_pb2 as gen  # noqa: E402
from protos import generate_pb2_grpc as gen_grpc  # noqa: E402
from tests import llm_builders  # noqa: E402
from tests.conftest import RunningServer  # noqa: E402

# name -> (rank, alpha, target modules): ranks differ, so padding to max_lora_rank is exercised
ADAPTERS = {"alpha": (4, 8, ["q_proj", "v_proj"]),
            "beta": (8, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            "gamma": (2, 4, ["o_proj", "up_proj", "down_proj"])}
PROMPTS = [[random.Random(i).randrange(2, 300) for _ in range(9 + 3 * i)] for i in range(5)]
SHARED = 4  # prompts the other tests send; PROMPTS[4] is the prefix test's own, so no test cached it before
TOKENS = 16
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def build_adapter(base, folder, rank: int, alpha: int, targets: list[str], seed: int) -> None:
    """A PEFT adapter with random A and B (PEFT starts B at zero, which would change nothing)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    wrapped.save_pretrained(str(folder))


def merged_greedy(base, adapter, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers + peft's merged model (weights + scale * B @ A), greedy: the independent reference."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class References(dict):
    """(adapter name or "" for the base, prompt index) -> the reference's greedy tokens, computed when first asked."""

    def __init__(self, base, adapters):
        super().__init__()
        self.base, self.adapters = base, adapters

    def __missing__(self, case):
        name, i = case
        self[case] = (merged_greedy(self.base, self.adapters / name, PROMPTS[i], TOKENS) if name else
                      llm_builders.reference_greedy(self.base, PROMPTS[i], TOKENS))
        return self[case]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    adapters = tmp_path_factory.mktemp("adapters")
    base = llm_builders.build_model(repo / "llama" / "1", "llama")
    (base / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        build_adapter(base, adapters / name, rank, alpha, targets, seed)
    modules = " ".join(f"{name}={adapters / name}" for name in ("alpha", "beta"))  # gamma comes at run time
    params = (f"parameters: {{lora_modules: {{string_value: '{modules}'}}, max_loras: {{string_value: '3'}}, "
              "max_lora_rank: {string_value: '8'}}\n")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=64) + params)
    references = References(base, adapters)
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*", timeout_s=300)
    yield server, adapters, references
    server.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0)


def responses(server, model: str, prompt: list[int], lora_name: str = "") -> list:
    request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt), lora_name=lora_name,
                                  sampling=gen.SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    return list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))


def generate(server, model: str, prompt: list[int], lora_name: str = "") -> list[int]:
    return [t for r in responses(server, model, prompt, lora_name) for t in r.token_ids]


def mixed_steps(server) -> float:
    return server.metric("ferry_lora_mixed_steps_total", model="llama") or 0.0


def test_adapters_and_base_batched_together_match_peft_merged_models(env):
    server, _, references = env
    cases = [(name, i) for i in range(SHARED) for name in ("alpha", "beta", "")]
    before = mixed_steps(server)
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: generate(server, "llama", PROMPTS[c[1]], c[0]), cases))
    for case, tokens in zip(cases, got):
        assert tokens == references[case], case
    for i in range(SHARED):  # the adapters change what is generated, so matching them means something
        assert references[("alpha", i)] != references[("", i)] and references[("beta", i)] != references[("", i)]
    assert mixed_steps(server) > before  # steps carried rows of several adapters and of the base model


def test_openai_api_names_adapters_as_models(env):
    server, _, references = env
    models = {m.id: m for m in client(server).models.list().data}
    assert models["alpha"].model_extra["parent"] == "llama" and models["beta"].model_extra["parent"] == "llama"
    answer = client(server).completions.create(model="beta", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert answer.model == "beta"
    over_grpc = responses(server, "llama", PROMPTS[0], "beta")
    assert [t for r in over_grpc for t in r.token_ids] == references[("beta", 0)]
    assert answer.choices[0].text == "".join(r.text for r in over_grpc)
    text_prompt = gen.GenerateRequest(model_name="llama", text="the ferry leaves", lora_name="alpha",
                                      sampling=gen.SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    over_grpc = "".join(r.text for r in gen_grpc.GenerationStub(server.channel).Generate(text_prompt, timeout=120))
    body = {"text_input": "the ferry leaves", "exclude_input_in_output": True, "lora_name": "alpha",
            "parameters": {"max_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}
    assert post(server, "/v2/models/llama/generate", body).json()["text_output"] == over_grpc  # Triton's generate
    body.pop("lora_name")
    assert post(server, "/v2/models/llama/generate", body).json()["text_output"] != over_grpc  # the base differs
    chat = client(server).chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0)
    assert chat.model == "alpha" and chat.choices[0].message.content is not None


def test_unknown_adapter_is_not_found(env):
    server, _, _ = env
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nosuch", prompt="hi", max_tokens=2)
    with pytest.raises(grpc.RpcError) as caught:
        generate(server, "llama", PROMPTS[0], "nosuch")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "nosuch" in caught.value.details()


def hits(server) -> float:
    return server.metric("ferry_prefix_cache_hit_tokens_total", model="llama") or 0.0


def test_prefix_cache_is_never_shared_across_adapters(env):
    server, _, references = env
    prompt = PROMPTS[4]  # 21 tokens: five full blocks of 4 a later request could find
    assert generate(server, "llama", prompt, "alpha") == references[("alpha", 4)]
    before = hits(server)
    assert generate(server, "llama", prompt, "beta") == references[("beta", 4)]
    assert generate(server, "llama", prompt) == references[("", 4)]
    assert hits(server) == before  # neither beta nor the base found alpha's blocks
    assert generate(server, "llama", prompt, "beta") == references[("beta", 4)]
    assert hits(server) > before  # while beta finds its own: the cache works, per adapter


def post(server, path: str, body: dict):
    import requests

    return requests.post(server.http_url + path, json=body, timeout=60)


def test_adapters_load_and_unload_at_run_time(env):
    server, adapters, references = env
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="gamma", prompt=PROMPTS[1], max_tokens=2)
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters / "gamma")})
    assert loaded.status_code == 200, loaded.text
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters / "gamma")}
                ).status_code == 409
    assert "gamma" in {m.id for m in client(server).models.list().data}
    cases = [("gamma", i) for i in range(SHARED)] + [("alpha", 1), ("", 2)]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda c: generate(server, "llama", PROMPTS[c[1]], c[0]), cases))
    assert got == [references[case] for case in cases]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    assert "gamma" not in {m.id for m in client(server).models.list().data}
    with pytest.raises(grpc.RpcError) as caught:
        generate(server, "llama", PROMPTS[1], "gamma")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 404
    bad = post(server, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(adapters / "missing")})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text


def test_run_time_loading_needs_explicit_model_control(tmp_path, env):
    _, adapters, _ = env
    repo = tmp_path / "repo"
    llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config()
                                                + "parameters: {enable_lora: {string_value: 'true'}}\n")
    server = RunningServer(repo, timeout_s=300)
    try:
        refused = post(server, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(adapters / "gamma")})
        assert refused.status_code == 503 and "--model-control-mode explicit" in refused.text
        assert "gamma" not in {m.id for m in client(server).models.list().data}
    finally:
        server.stop()


def test_more_adapters_than_slots_take_turns_and_stay_exact(tmp_path, env):
    """max_loras 2 with three adapters asked at once: a step never carries more than two (the scheduler
    holds the third back), resident adapters are evicted least recently used first, and every answer
    stays token-exact with its merged reference."""
    _, adapters, references = env
    repo = tmp_path / "repo"
    llm_builders.build_model(repo / "llama" / "1", "llama")
    modules = " ".join(f"{name}={adapters / name}" for name in ADAPTERS)
    (repo / "llama" / "config.yaml").write_text(
        llm_builders.llm_config(max_num_batched_tokens=64) + f"parameters: {{lora_modules: {{string_value: '{modules}'}}, "
        "max_loras: {string_value: '2'}, max_lora_rank: {string_value: '8'}}\n")
    server = RunningServer(repo, timeout_s=300)
    try:
        cases = [(name, i) for i in range(2) for name in ADAPTERS] + [("", 0)]
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda c: generate(server, "llama", PROMPTS[c[1]], c[0]), cases))
        assert got == [references[case] for case in cases]
        for name in ADAPTERS:  # three in turn over two slots: at least one of them is loaded again
            assert generate(server, "llama", PROMPTS[2], name) == references[(name, 2)]
        loads = server.metric("ferry_lora_loads_total", model="llama")
        evictions = server.metric("ferry_lora_evictions_total", model="llama")
        assert loads >= len(ADAPTERS) + 1 and evictions == loads - 2  # two slots: every load past them evicted one
    finally:
        server.stop()
