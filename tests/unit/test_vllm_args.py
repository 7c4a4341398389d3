"""model.json (vLLM engine arguments) -> Ferry's generation settings: each mapping, each refusal."""

from __future__ import annotations

import json

import pytest

from server.backends.llm import vllm_args
from server.errors import ConfigError


@pytest.fixture
def folder(tmp_path):
    """A version folder beside a (file-level) Hugging Face folder: `model` can name it relatively."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "m" / "1").mkdir(parents=True)
    return tmp_path


def read(folder, **args):
    path = folder / "m" / "1" / "model.json"
    path.write_text(json.dumps({"model": "../../hf", **args}))
    return vllm_args.read(path, "m/1/model.json")


def test_every_mapped_argument_lands_in_its_generation_field(folder):
    args = read(folder, gpu_memory_utilization=0.5, max_model_len=300, block_size=32, max_num_seqs=7,
                max_num_batched_tokens=96, enable_prefix_caching="false", dtype="half", num_gpu_blocks_override=50,
                kv_cache_memory_bytes=3 * 2**20 + 1,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    g = args.generation
    assert args.folder == (folder / "hf").resolve() and args.ignored == ()
    assert (g.max_model_len, g.block_size, g.max_num_seqs, g.max_num_batched_tokens) == (300, 32, 7, 96)
    assert g.gpu_memory_utilization == pytest.approx(0.5)
    assert g.HasField("enable_prefix_caching") and not g.enable_prefix_caching
    assert (g.dtype, g.num_kv_blocks, g.kv_cache_memory_mb) == ("float16", 50, 4)
    assert (g.speculative.method, g.speculative.num_speculative_tokens, g.speculative.prompt_lookup_max) == ("ngram", 3, 5)


def test_unapplied_arguments_are_named_and_ferrys_own_behaviour_passes_silently(folder):
    args = read(folder, enforce_eager=True, tensor_parallel_size=1, trust_remote_code=True, tokenizer="../../hf",
                swap_space=4, tensor_parallel_size_x=1, pipeline_parallel_size=2, enforce_eager_=False,
                speculative_config={"method": "eagle", "model": "x", "num_speculative_tokens": 2})
    assert args.ignored == ("swap_space", "tensor_parallel_size_x", "pipeline_parallel_size=2", "enforce_eager_",
                            "speculative_config")
    assert read(folder, enforce_eager=False, tokenizer="../../other").ignored == ("enforce_eager=false", "tokenizer")


@pytest.mark.parametrize("key, value", [
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", "0.5"), ("max_model_len", 1.5), ("max_num_seqs", True),
    ("block_size", 4096), ("max_model_len", 2**40), ("enable_prefix_caching", "yes"), ("dtype", "fp8"), ("dtype", ["auto"]), ("speculative_config", "ngram"),
    ("speculative_config", {"method": "ngram"}),
])
def test_a_bad_value_fails_naming_the_argument_and_the_value(folder, key, value):
    with pytest.raises(ConfigError) as err:
        read(folder, **{key: value})
    assert f"m/1/model.json: engine argument '{key}'" in err.value.message and repr(value) in err.value.message


@pytest.mark.parametrize("model, why", [
    ("meta-llama/Llama-3.2-1B", "Ferry does not download from the Hugging Face Hub"),
    ("../../missing", "names no folder"), ("../..", "without config.json"), (3, "local Hugging Face model folder"),
])
def test_model_must_be_a_local_hugging_face_folder(folder, model, why):
    path = folder / "m" / "1" / "model.json"
    path.write_text(json.dumps({"model": model}))
    with pytest.raises(ConfigError, match=why):
        vllm_args.read(path, "m/1/model.json")


@pytest.mark.parametrize("text, why", [("{", "not valid JSON"), ("[1]", "expected a JSON object"),
                                       ("{}", "'model' is missing")])
def test_the_file_itself_must_be_a_json_object_naming_model(folder, text, why):
    path = folder / "m" / "1" / "model.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        vllm_args.read(path, "m/1/model.json")
