"""Triton's vLLM sample client (vllm_backend samples/client.py), its requests sent unchanged.

That client sends `sampling_parameters` as JSON whose values are strings (`"temperature": "0.1"`),
and the same dict again as the request's parameters; Triton's vLLM backend reads each value as its
field's type. Ferry must too, while a string that is no number of that type is still refused.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
if importlib.util.find_spec("tritonclient") is None:  # never imported here: its protobufs clash with ours
    pytest.skip(reason="tritonclient[grpc] is not installed (test extra)", allow_module_level=True)

from tests import llm_builders
from tests.conftest import RunningServer

# What samples/client.py's run() sends, value for value.
CLIENT_SAMPLING = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
PROMPTS = ["the ferry leaves when\n", "batching is what\n", "continuous batching joins\n"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / "vllm_model" / "1", "llama")
    (repo / "vllm_model" / "config.yaml").write_text(llm_builders.llm_config())
    server = RunningServer(repo)
    yield server
    server.stop()


def run_client(server, streaming: bool, exclude: bool, sampling=CLIENT_SAMPLING, prompts=PROMPTS):
    script = Path(__file__).with_name("vllm_sample_client_calls.py")
    done = subprocess.run([sys.executable, str(script), server.address, str(int(streaming)), str(int(exclude)),
                           json.dumps(sampling), json.dumps(prompts)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["texts"], out["errors"]


@pytest.mark.parametrize("streaming, exclude", [(False, False), (False, True), (True, True)],
                         ids=["default", "exclude-inputs", "streaming"])
def test_the_sample_client_passes_in_each_mode(server, streaming, exclude):
    texts, errors = run_client(server, streaming, exclude)
    assert errors == []
    for i, prompt in enumerate(PROMPTS):
        assert texts[str(i)], f"prompt {i} got no text"
        assert texts[str(i)].startswith(prompt) != exclude, texts[str(i)]


def test_string_values_mean_what_the_numbers_mean(server):
    as_strings = {"temperature": "0.7", "seed": "11", "max_tokens": "12", "ignore_eos": "true", "top_k": "5"}
    as_values = {"temperature": 0.7, "seed": 11, "max_tokens": 12, "ignore_eos": True, "top_k": 5}
    strings, errors = run_client(server, False, True, as_strings, PROMPTS[:1])
    values, more_errors = run_client(server, False, True, as_values, PROMPTS[:1])
    assert errors == more_errors == [] and strings == values and strings["0"]


@pytest.mark.parametrize("bad", [{"temperature": "NaN"}, {"temperature": "inf"}, {"temperature": "hot"},
                                 {"max_tokens": "1.5"}, {"seed": "x"}, {"ignore_eos": "yes"}])
def test_strings_that_are_no_value_of_the_field_are_still_refused(server, bad):
    texts, errors = run_client(server, False, True, bad, PROMPTS[:1])
    (field,) = bad
    assert len(errors) == 1 and f"'{field}'" in errors[0] and "internal" not in errors[0].lower(), errors
    assert texts["0"] == ""


def test_structured_output_keys_in_sampling_parameters(server):
    """ModelStreamInfer through Triton's sample client: vLLM's guided_* keys in `sampling_parameters` (and the
    request's parameters, as the client sends them) constrain the text; a regex it cannot compile is refused."""
    import re

    regex = r"[a-c]{3}-[0-9]{2}"
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False})
    for streaming in (False, True):
        texts, errors = run_client(server, streaming, True, {"guided_regex": regex, "temperature": "1.0", "seed": "3",
                                                             "max_tokens": "30"}, PROMPTS[:2])
        assert errors == [] and all(re.fullmatch(regex, texts[str(i)]) for i in range(2)), texts
    texts, errors = run_client(server, False, True, {"guided_json": schema, "max_tokens": "30"}, PROMPTS[:1])
    assert errors == [] and json.loads(texts["0"]) in ({"ok": True}, {"ok": False}), texts
    texts, errors = run_client(server, False, True, {"guided_regex": "a(", "max_tokens": "5"}, PROMPTS[:1])
    assert len(errors) == 1 and "regex constraint cannot be compiled" in errors[0] and texts["0"] == "", errors
