"""`ferry tune` against real servers: counts, never timings. Each search is bounded by --max-candidates
and --requests, so what is checked is what was sent, served, skipped, written and reloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format

from clients import InferenceClient
from protos import model_config_pb2 as mc
from tests import builders, llm_builders
from tests.conftest import ROOT, RunningServer, wait_for

BAD = "max_batch_size=2,preferred=8"  # preferred above max_batch_size: the server refuses to load it


def tune(*args: str, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "tune", *args], cwd=cwd or ROOT, check=False,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"})


def successes(address: str, model: str) -> int:
    with InferenceClient(address, timeout_s=30) as client:
        return sum(s.inference_stats.success.count for s in client.model_statistics(model))


@pytest.fixture
def mlp_repo(tmp_path):
    repo = tmp_path / "repo"
    builders.mlp(repo / "mlp" / "1" / "model.onnx")
    return repo


def test_tunes_an_onnx_model_skips_a_candidate_that_fails_to_load_and_writes_a_config_that_serves(mlp_repo, tmp_path):
    out, report = tmp_path / "tuned.pbtxt", tmp_path / "tune.json"
    done = tune("mlp", "--model-repository", str(mlp_repo), "--concurrency", "4", "--requests", "24", "--warmup", "2",
                "--max-candidates", "3", "--candidate", BAD, "--output", str(out), "--json", str(report),
                "--plot", str(tmp_path / "tune.png"))
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    (skipped,) = doc["skipped"]
    assert skipped["knobs"]["preferred"] == [8] and skipped["measurements"] == []
    assert "preferred_batch_size" in skipped["error"] and "did not load, skipped" in done.stderr
    assert "did not load" in done.stdout  # the table lists it too
    measured = [c for c in doc["candidates"] if not c["error"]]
    assert len(doc["candidates"]) == 1 + 3 and len(measured) == 3  # the served config, the bad one, two more
    assert len(doc["current"]["measurements"]) >= 2  # the A/A pair
    for candidate in measured:
        for row in candidate["measurements"]:
            # every request sent was answered, and the server's own statistics counted exactly those
            assert (row["requests"], row["completed"], row["errors"], row["served"]) == (24, 24, 0, 24)
            assert row["rows"] == 24 and row["executions"] >= 24 / candidate["knobs"]["max_batch_size"]
    assert doc["winner"]["config"] in {c["config"] for c in measured}
    assert "current" in done.stdout and "winner" in done.stdout and "verdict:" in done.stdout
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the written config is the winner's, and a server loads and serves it
    written = text_format.Parse(out.read_text(), mc.ModelConfig())
    assert written.max_batch_size == doc["winner"]["knobs"]["max_batch_size"]
    fresh = tmp_path / "fresh"
    builders.mlp(fresh / "mlp" / "1" / "model.onnx")
    shutil.copy(out, fresh / "mlp" / "config.pbtxt")
    server = RunningServer(fresh)
    try:
        x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
        with InferenceClient(server.address, timeout_s=30) as client:
            assert client.model_config("mlp").max_batch_size == written.max_batch_size
            y = client.infer("mlp", {"X": x})["Y"]
        expected = ort.InferenceSession(str(fresh / "mlp" / "1" / "model.onnx")).run(None, {"X": x})[0]
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    finally:
        server.stop()


def test_url_tuning_restores_the_served_config_and_apply_writes_and_reloads_the_winner(mlp_repo, tmp_path):
    (mlp_repo / "mlp" / "config.pbtxt").write_text("max_batch_size: 4\ndynamic_batching { max_queue_delay_microseconds: 50000 }\n")
    server = RunningServer(mlp_repo, "--model-control-mode", "explicit", "--load-model", "mlp")
    try:
        with InferenceClient(server.address, timeout_s=30) as client:
            before = client.model_config("mlp")
        report = tmp_path / "tune.json"
        done = tune("mlp", "--url", server.address, "--concurrency", "2", "--requests", "12", "--warmup", "1",
                    "--max-candidates", "2", "--candidate", BAD, "--json", str(report), "--output", str(tmp_path / "t.pbtxt"))
        assert done.returncode == 0, done.stderr
        doc = json.loads(report.read_text())
        assert len(doc["skipped"]) == 1
        with InferenceClient(server.address, timeout_s=30) as client:
            assert client.model_config("mlp") == before  # the served config is back after the search
            assert client.is_model_ready("mlp")
            client.infer("mlp", {"X": np.ones((1, 16), np.float32)})
        done = tune("mlp", "--url", server.address, "--model-repository", str(mlp_repo), "--concurrency", "2",
                    "--requests", "12", "--warmup", "1", "--max-candidates", "2", "--apply", "--json", str(report),
                    "--output", str(tmp_path / "t.pbtxt"))
        assert done.returncode == 0, done.stderr
        doc = json.loads(report.read_text())
        folder = mlp_repo / "mlp"
        with InferenceClient(server.address, timeout_s=30) as client:
            served = client.model_config("mlp")
            client.infer("mlp", {"X": np.ones((1, 16), np.float32)})
        if doc["tie"]:  # nothing beat the served config beyond the noise: nothing is touched
            assert served == before and not list(folder.glob("*.before-tune-*"))
        else:
            written = text_format.Parse((folder / "config.pbtxt").read_text(), mc.ModelConfig())
            assert served.max_batch_size == written.max_batch_size == doc["winner"]["knobs"]["max_batch_size"]
            assert served.dynamic_batching == written.dynamic_batching
            (kept,) = folder.glob("config.pbtxt.before-tune-*")
            assert "50000" in kept.read_text()
    finally:
        server.stop()


def test_from_trace_replays_the_recorded_count_and_sizes(mlp_repo, tmp_path):
    trace = tmp_path / "traffic.jsonl"
    server = RunningServer(mlp_repo, "--model-control-mode", "explicit", "--load-model", "mlp", "--record-traffic", str(trace))
    try:
        sizes = [1, 3, 2, 1, 4, 2, 1, 1, 3]
        with InferenceClient(server.address, timeout_s=30) as client:
            for n in sizes:
                client.infer("mlp", {"X": np.zeros((n, 16), np.float32)})

        def recorded() -> list[dict]:
            return [json.loads(line) for line in trace.read_text().splitlines() if '"model"' in line]

        wait_for(lambda: len(recorded()) == len(sizes), 30, "the recording to hold every request")
        assert [line["inputs"]["X"] for line in recorded()] == [[n, 16] for n in sizes]
        offsets = [line["t"] for line in recorded()]
        assert offsets == sorted(offsets) and offsets[0] >= 0
        report = tmp_path / "tune.json"
        done = tune("mlp", "--url", server.address, "--from-trace", str(trace), "--warmup", "0", "--max-candidates", "1",
                    "--json", str(report), "--output", str(tmp_path / "t.pbtxt"))
        assert done.returncode == 0, done.stderr
        doc = json.loads(report.read_text())
        rows = [row for c in doc["candidates"] for row in c["measurements"]]
        assert len(rows) >= 3  # the A/A pair and a candidate
        for row in rows:  # each replay: the recorded count of requests, and the server saw the recorded rows
            assert (row["requests"], row["completed"], row["served"], row["rows"]) == (len(sizes), len(sizes), len(sizes), sum(sizes))
        # the replays were recorded too (the recorder writes behind the answers): each one the same sizes in order
        wait_for(lambda: len(recorded()) >= len(sizes) * (1 + len(rows)), 30, "the recording to hold every replay")
        replayed = [line["inputs"]["X"][0] for line in recorded()[len(sizes):]]
        # each replay holds the recorded sizes; requests sent at nearly the same offset may arrive swapped
        chunks = [sorted(replayed[i:i + len(sizes)]) for i in range(0, len(replayed), len(sizes))]
        assert chunks == [sorted(sizes)] * len(rows)
    finally:
        server.stop()


def test_url_against_a_server_without_model_control_is_refused_with_the_flag(mlp_repo):
    server = RunningServer(mlp_repo)
    try:
        done = tune("mlp", "--url", server.address, "--concurrency", "2", "--requests", "5")
        assert done.returncode == 1
        assert "--model-control-mode explicit" in done.stderr and "Traceback" not in done.stderr
        assert successes(server.address, "mlp") == 0  # refused before a single measurement
    finally:
        server.stop()


def test_bad_command_lines_are_refused():
    done = tune("mlp", "--concurrency", "2")
    assert done.returncode == 2 and "--model-repository DIR" in done.stderr
    done = tune("mlp", "--url", "127.0.0.1:1", "--budget", "soon")
    assert done.returncode == 2 and "--budget 'soon'" in done.stderr


def test_tunes_a_generation_model_and_writes_a_config_that_serves(tmp_path):
    repo = tmp_path / "repo"
    llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_seqs=8))
    out, report = tmp_path / "tuned.pbtxt", tmp_path / "tune.json"
    done = tune("llama", "--model-repository", str(repo), "--concurrency", "2", "--requests", "4", "--warmup", "1",
                "--max-tokens", "4", "--prompt-length", "6", "--max-candidates", "2", "--itl-p99-ms", "5000", "--budget", "180s",
                "--output", str(out), "--json", str(report))
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    measured = [c for c in doc["candidates"] if not c["error"]]
    assert len(measured) >= 2 and "tokens/s" in done.stdout
    for candidate in measured:
        for row in candidate["measurements"]:
            assert (row["requests"], row["completed"], row["errors"]) == (4, 4, 0)
            assert row["output_tokens"] == 4 * 4 and row["finish_reasons"] == {"length": 4}
    written = text_format.Parse(out.read_text(), mc.ModelConfig())
    assert written.generation.max_num_seqs == doc["winner"]["knobs"]["max_num_seqs"]
    (repo / "llama" / "config.yaml").unlink()
    shutil.copy(out, repo / "llama" / "config.pbtxt")
    server = RunningServer(repo)
    try:
        with InferenceClient(server.address, timeout_s=60) as client:
            deltas = list(client.generate("llama", [5, 6, 7], max_tokens=3, ignore_eos=True))
        assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 3
    finally:
        server.stop()


def test_generation_traffic_is_recorded_and_replayed_with_its_token_counts(tmp_path):
    repo = tmp_path / "repo"
    llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_seqs=8))
    trace = tmp_path / "traffic.jsonl"
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "llama", "--record-traffic", str(trace))
    try:
        asks = [([5, 6, 7], 3), ([8, 9, 10, 11, 12], 2), ([13], 4)]
        with InferenceClient(server.address, timeout_s=60) as client:
            for prompt, max_tokens in asks:
                list(client.generate("llama", prompt, max_tokens=max_tokens, ignore_eos=True))

        def recorded() -> list[dict]:
            return [json.loads(line) for line in trace.read_text().splitlines() if '"model"' in line]

        wait_for(lambda: len(recorded()) == len(asks), 30, "the recording to hold every request")
        assert [(line["prompt_tokens"], line["max_tokens"]) for line in recorded()] == [(len(p), m) for p, m in asks]
        report = tmp_path / "tune.json"
        done = tune("llama", "--url", server.address, "--from-trace", str(trace), "--warmup", "0", "--max-candidates", "1",
                    "--json", str(report), "--output", str(tmp_path / "t.pbtxt"))
        assert done.returncode == 0, done.stderr
        rows = [row for c in json.loads(report.read_text())["candidates"] for row in c["measurements"]]
        assert len(rows) >= 3
        for row in rows:  # every replay: the recorded requests, each generating the recorded token count
            assert (row["requests"], row["completed"], row["output_tokens"]) == (3, 3, sum(m for _, m in asks))
        wait_for(lambda: len(recorded()) >= len(asks) * (1 + len(rows)), 30, "the recording to hold every replay")
        replayed = [(line["prompt_tokens"], line["max_tokens"]) for line in recorded()[len(asks):]]
        chunks = [sorted(replayed[i:i + len(asks)]) for i in range(0, len(replayed), len(asks))]
        assert chunks == [sorted((len(p), m) for p, m in asks)] * len(rows)
    finally:
        server.stop()
