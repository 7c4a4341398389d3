"""Triton's vLLM backend folders (`backend: "vllm"`, `<version>/model.json`) served by Ferry's generation engine,
driven by the requests of Triton's vLLM sample client and compared with the same model as `backend: llm`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
# find_spec, not import: importing tritonclient here would clash with Ferry's `inference.*` messages
if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc] is not installed (it is part of the test extra)", allow_module_level=True)

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from tests import llm_builders
from tests.conftest import RunningServer

# Triton's samples/model_repository/vllm_model/config.pbtxt, field for field
TRITON_SAMPLE_CONFIG = 'backend: "vllm"\n\ninstance_group [\n  {\n    count: 1\n    kind: KIND_MODEL\n  }\n]\n'
MAPPED = {"max_model_len": 256, "block_size": 8, "max_num_seqs": 4, "enable_prefix_caching": False}
UNAPPLIED = {"swap_space": 4, "kv_cache_dtype": "auto", "max_logprobs": 20}
SILENT = {"enforce_eager": True, "disable_log_requests": True, "tensor_parallel_size": 1}  # what Ferry does anyway
BAD = {  # folder -> model.json beside `model`, and what the load's error must name
    "bad_fraction": ({"gpu_memory_utilization": 1.5}, "'gpu_memory_utilization'"),
    "bad_seqs": ({"max_num_seqs": "four"}, "'max_num_seqs'"),
    "bad_dtype": ({"dtype": "int8"}, "'dtype'"),
}
PROMPTS = ["the ferry leaves when", "batching is what this", "continuous batching joins requests"]
HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 2, 4, 2  # tests/llm_builders.py's tiny Llama


def vllm_folder(repo: Path, name: str, engine_args: dict) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(TRITON_SAMPLE_CONFIG)
    (repo / name / "1" / "model.json").write_text(json.dumps(engine_args, indent=4))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    repo = root / "repo"
    hf = llm_builders.build_model(root / "hf", "llama")  # outside the repository: a folder model.json points at
    shutil.copytree(hf, repo / "llm_model" / "1")
    (repo / "llm_model" / "config.yaml").write_text(llm_builders.llm_config(
        block_size=8, num_kv_blocks=0, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False))
    # `model` relative to the version folder, as Triton users write absolute ones
    vllm_folder(repo, "vllm_model", {"model": "../../../hf", "gpu_memory_utilization": 0.1, **SILENT, **MAPPED,
                                     **UNAPPLIED})
    vllm_folder(repo, "vllm_cached", {"model": str(hf), "block_size": 8, "enable_prefix_caching": True})
    vllm_folder(repo, "hub_name", {"model": "facebook/opt-125m", "gpu_memory_utilization": 0.1, "enforce_eager": True})
    for name, (args, _) in BAD.items():
        vllm_folder(repo, name, {"model": str(hf), **args})
    server = RunningServer(repo)
    yield server
    server.stop()


def sample_client(server: RunningServer, model: str, stream: bool, exclude: bool, **sampling) -> dict:
    """Triton's vLLM sample client's requests (vllm_client_calls.py) for every prompt, in its own process.
    The sample writes sampling values as strings ("0.1"), and so does this call."""
    call = {"model": model, "prompts": PROMPTS, "stream": stream, "exclude": exclude,
            "sampling": {"temperature": "0", "top_p": "0.95", "max_tokens": "24", **sampling}}
    script = Path(__file__).with_name("vllm_client_calls.py")
    done = subprocess.run([sys.executable, str(script), server.address, json.dumps(call)], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def model_config(server: RunningServer, model: str):
    stub = pb_grpc.GRPCInferenceServiceStub(server.channel)
    return stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=30).config


def index_reasons(server: RunningServer) -> dict[str, str]:
    stub = pb_grpc.GRPCInferenceServiceStub(server.channel)
    return {m.name: m.reason for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models}


@pytest.mark.parametrize("stream", [True, False])
def test_sample_client_gets_the_same_greedy_text_as_backend_llm(env, stream):
    vllm = sample_client(env, "vllm_model", stream, exclude=stream)
    llm = sample_client(env, "llm_model", stream, exclude=stream)
    assert vllm["errors"] == [] and llm["errors"] == []
    assert vllm["texts"] == llm["texts"]
    texts = ["".join(pieces) for pieces in vllm["texts"].values()]
    assert len(texts) == len(PROMPTS) and all(texts)
    if stream:  # one response per token, each with its text
        assert all(len(pieces) > 1 for pieces in vllm["texts"].values())
    else:  # Triton's vLLM backend: a non-streamed answer starts with the prompt unless excluded
        assert all(text.startswith(prompt) and len(text) > len(prompt) for prompt, text in zip(PROMPTS, texts))


def test_model_config_shows_the_mapped_engine_arguments(env):
    config = model_config(env, "vllm_model")
    assert config.backend == "vllm"
    g = config.generation
    assert (g.max_model_len, g.block_size, g.max_num_seqs, g.enable_prefix_caching) == (256, 8, 4, False)
    assert g.gpu_memory_utilization == pytest.approx(0.1)
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert {i.name for i in config.input} >= {"text_input", "stream", "sampling_parameters", "exclude_input_in_output"}
    assert [o.name for o in config.output] == ["text_output"]
    assert len(config.instance_group) == 1 and config.instance_group[0].count == 1
    # the engine sized its KV pool with model.json's block_size: 256 MiB (the CPU default) / bytes per block
    per_block = 2 * LAYERS * 8 * KV_HEADS * (HIDDEN // HEADS) * 4
    assert config.parameters["num_kv_blocks"].string_value == str(256 * 2**20 // per_block)
    assert config.parameters["max_model_len"].string_value == "256"


def test_max_model_len_from_model_json_refuses_a_longer_prompt(env):
    """The tiny model knows 512 positions; model.json's max_model_len 256 is what the engine enforces."""
    request = gen.GenerateRequest(model_name="vllm_model", sampling=gen.SamplingParams(max_tokens=1))
    request.token_ids.ids.extend([7] * 300)
    with pytest.raises(grpc.RpcError) as err:
        list(gen_grpc.GenerationStub(env.channel).Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len is 256" in err.value.details()


def test_enable_prefix_caching_from_model_json_decides_whether_prompts_share_blocks(env):
    prompt = list(range(2, 42))  # five full blocks of 8
    for model in ("vllm_model", "vllm_cached"):
        for _ in range(2):
            request = gen.GenerateRequest(model_name=model, sampling=gen.SamplingParams(max_tokens=1))
            request.token_ids.ids.extend(prompt)
            list(gen_grpc.GenerationStub(env.channel).Generate(request, timeout=60))
    assert (env.metric("ferry_prefix_cache_hit_tokens", model="vllm_cached") or 0) >= 32
    assert (env.metric("ferry_prefix_cache_hit_tokens", model="vllm_model") or 0) == 0


def test_one_warning_names_every_argument_ferry_does_not_apply(env):
    warnings = [line for line in env.output.splitlines() if "vllm_model/1/model.json" in line and "WARNING" in line]
    assert len(warnings) == 1, warnings
    named = warnings[0].split("does not apply: ", 1)[1].split("; ", 1)[0].split(", ")
    assert sorted(named) == sorted(UNAPPLIED)  # not the mapped ones, nor those whose value is what Ferry does
    assert not any("vllm_cached/1/model.json" in line for line in env.output.splitlines())


def test_a_bad_value_fails_the_load_naming_the_argument(env):
    reasons = index_reasons(env)
    for name, (args, named) in BAD.items():
        assert named in reasons[name] and f"{name}/1/model.json" in reasons[name], reasons[name]
        assert repr(next(iter(args.values()))) in reasons[name]
    assert reasons["vllm_model"] == reasons["llm_model"] == ""


def test_a_hub_name_is_refused_with_how_to_download_it(env):
    reason = index_reasons(env)["hub_name"]
    assert "'facebook/opt-125m'" in reason and "not a local folder" in reason
    assert "huggingface-cli download facebook/opt-125m" in reason
    assert "/tmp" not in reason and str(Path.home()) not in reason  # no server paths in what clients read


def test_triton_readme_generate_call_answers_as_backend_llm(env):
    """The vLLM backend README's `curl -X POST .../v2/models/vllm_model/generate` request, over HTTP."""
    import urllib.request

    def generate(model: str) -> dict:
        body = {"text_input": PROMPTS[0], "parameters": {"stream": False, "temperature": 0, "max_tokens": 12}}
        request = urllib.request.Request(f"{env.http_url}/v2/models/{model}/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=60).read())

    vllm, llm = generate("vllm_model"), generate("llm_model")
    assert vllm["model_name"] == "vllm_model" and vllm["text_output"].startswith(PROMPTS[0])
    assert vllm["text_output"] == llm["text_output"] and len(vllm["text_output"]) > len(PROMPTS[0])
