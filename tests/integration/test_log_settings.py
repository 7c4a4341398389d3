"""Triton's logging extension (LogSettings RPC, /v2/logging): read and change what a running server logs.

Whether a line was written is read from the server's output. A line that must be absent is checked
behind a fence: a WARNING the test causes afterwards (loading a model whose config asks for a
response cache the server does not have), which the server writes after it, on the same stream.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, wait_for

FENCE = "enables response_cache, but the server has no cache"
BATCH_LINE = "model 'gated': batch of"
READY_LINE = "model 'warns' version 1 is READY"
DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
            "log_format": "default"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    builders.gated_model(repo, "gated", "dynamic_batching: {}\n")
    builders.gated_model(repo, "warns", "response_cache: {enable: true}\n")  # its every load logs the FENCE warning
    # changes the settings (off by default); the fence reloads a model (explicit model control)
    running = RunningServer(repo, "--allow-log-settings", "--model-control-mode", "explicit", "--load-model", "*")
    yield running
    running.stop()


def settings(server, **changes) -> dict:
    request = pb.LogSettingsRequest()
    for key, value in changes.items():
        field = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
        setattr(request.settings[key], field, value)
    response = kserve.stub(server.channel).LogSettings(request, timeout=30)
    return {key: getattr(v, v.WhichOneof("parameter_choice")) for key, v in response.settings.items()}


def load_warns(server) -> None:
    kserve.stub(server.channel).RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="warns"), timeout=60)


def fence(server) -> str:
    """What the server wrote before a WARNING caused now: everything done before this call, complete
    (the load's own later lines, such as its READY, are cut off)."""
    seen = server.output.count(FENCE)
    load_warns(server)
    wait_for(lambda: server.output.count(FENCE) > seen, what="the fence warning")
    text = server.output
    return text[:text.rindex(FENCE)]


def infer(server) -> None:
    kserve.infer(server.channel, "gated", {"X": np.ones((1, 2), np.float32)})


def test_settings_read_over_grpc_and_http_start_from_the_log_level(server):
    assert settings(server) == DEFAULTS
    with urllib.request.urlopen(f"{server.http_url}/v2/logging", timeout=30) as reply:
        assert json.loads(reply.read()) == DEFAULTS
    metadata = kserve.stub(server.channel).ServerMetadata(pb.ServerMetadataRequest(), timeout=30)
    assert "logging" in metadata.extensions


def test_verbose_level_turns_the_batch_trace_on_and_off(server):
    assert settings(server, log_verbose_level=1)["log_verbose_level"] == 1
    infer(server)
    wait_for(lambda: BATCH_LINE in server.output, what="a DEBUG line for the batch")
    assert settings(server, log_verbose_level=0)["log_verbose_level"] == 0
    before = fence(server).count(BATCH_LINE)
    infer(server)
    assert fence(server).count(BATCH_LINE) == before  # written no more


def test_info_off_keeps_warnings_and_can_be_turned_back_on(server):
    assert settings(server, log_info=False)["log_info"] is False
    ready = fence(server).count(READY_LINE)
    load_warns(server)
    assert fence(server).count(READY_LINE) == ready  # the load's INFO line was dropped (the fences' WARNINGs kept)
    settings(server, log_info=True)
    load_warns(server)
    assert fence(server).count(READY_LINE) == ready + 1


def test_iso8601_timestamps(server):
    settings(server, log_format="ISO8601")
    try:
        fence(server)
        line = next(line for line in reversed(server.output.splitlines()) if FENCE in line)
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ WARNING ", line), line
    finally:
        settings(server, log_format="default")


@pytest.mark.parametrize("changes, words", [
    ({"log_bogus": True}, "unknown log setting 'log_bogus'"),
    ({"log_info": "yes"}, "log setting 'log_info' takes a bool"),
    ({"log_format": "XML"}, "log_format must be one of default, ISO8601"),
    ({"log_file": "/tmp/ferry.log"}, "log_file is set when the server starts"),
])
def test_a_bad_setting_is_refused_and_changes_nothing(server, changes, words):
    with pytest.raises(grpc.RpcError) as info:
        settings(server, log_warning=False, **changes)  # a good change beside it is not applied either
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
    body = json.dumps({"log_warning": False, **changes}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/logging", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    assert http.value.code == 400 and words in json.loads(http.value.read())["error"]
    assert settings(server) == DEFAULTS
