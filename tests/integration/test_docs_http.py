"""Every curl example on the HTTP docs page (docs/http.md), run against a real server with the shipped models."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, RunningServer, link_shipped_models


def examples() -> list[str]:
    text = (ROOT / "docs" / "http.md").read_text()
    block = re.search(r"<!-- http-examples -->\n```sh\n(.*?)```", text, re.S).group(1)
    return re.split(r"\n(?=curl )", block.strip())  # one command each, continuation lines kept


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("curl") is None:
        pytest.skip(reason="curl is not installed")
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "tiny_llama")
    running = RunningServer(repo)
    yield running
    running.stop()


@pytest.mark.parametrize("index", range(len(examples())))
def test_docs_curl_example_runs(server, index):
    command = examples()[index].replace("localhost:8000", server.http_address)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr  # curl -f: any 4xx/5xx fails here
    out = done.stdout
    if "/infer" in command:
        assert '"OUTPUT0"' in out and "[2.0,3.0,4.0" in out.replace(" ", "")
    elif "generate" in command or "completions" in command:
        assert ("text_output" in out or '"text"' in out) and ("stream" not in command or "data: " in out)
    if '"stream": true' in command:
        assert out.rstrip().endswith("data: [DONE]") and '"usage"' in out
