"""Ferry and Triton side by side: the same ONNX files, the same load generator, interleaved rounds.

    python -m bench.peers [--concurrency 1,8,64,128] [--duration 2] [--rounds 3] [--models light,heavy,varlen]
                          [--windows 1,8] [--control]

Triton runs through PyTriton (`nvidia-pytriton` from PyPI) in a virtual environment this script makes
once under ~/.cache/ferry-bench (or $FERRY_BENCH_CACHE), outside the repository; bench/peers_triton.py
is its side: each model an ONNX Runtime session inside a `@batch` callable, 1 ms queue delay, max
batch 128. Ferry serves the same files (hard links) with the same 1 ms window and max batch, and, as
a second variant, its adaptive window. Both servers listen on 127.0.0.1 and stay up for the whole run.
`--windows 1,8`: more fixed windows for Ferry (ms), each its own variant, so the adaptive window is also
measured against Ferry's best fixed window, round by round. `--control`: the adaptive variant runs twice
in every round; the ratio of its two runs is what a ratio of identical configurations looks like on this
machine, so a round-by-round ratio is read against it.

Load: clients/loadgen.py closed loop (grpc.aio, requests serialized once, raw bytes), for both servers:
it speaks KServe v2 gRPC, which Triton and Ferry share byte for byte, so the same request bytes go to
both. Models (bench/models.py): the light MLP (per-request overhead dominates), the heavy encoder
(compute dominates) and the variable-length attention encoder (ids of 16..128 tokens; Ferry pads
rows of a batch to one length, Triton's dynamic batcher only batches requests of equal shape).

Each (model, concurrency) point is run once per system per round; the order of systems rotates from
round to round so a shared machine's drift hits them alike. Reported: medians over rounds with the
spread (min-max), and Ferry/Triton ratios taken round by round (a round's systems ran back to back),
median [min-max]. Every load run is bounded (--duration, 30 s per call); the whole run stops taking
new points after --budget seconds. Appended to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from bench import common, models
from clients import loadgen
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc

CACHE = Path(os.environ.get("FERRY_BENCH_CACHE", Path.home() / ".cache" / "ferry-bench"))
PYTRITON = "nvidia-pytriton==0.7.0"
QUEUE_DELAY_US, MAX_BATCH = 1000, 128
# name: (builder, input name, adaptive latency target ms)
MODELS = {
    "light": (models.light_mlp, "x", 50),
    "heavy": (models.heavy_encoder, "x", 500),
    "varlen": (models.token_encoder, "ids", 100),
}
VARLEN_TOKENS = (16, 128)
FERRY_INPUTS = {
    "varlen": "input:\n  - {name: ids, data_type: TYPE_INT64, dims: [-1], variable_length: true, lengths_input: lengths}\n"
              "  - {name: lengths, data_type: TYPE_INT64, dims: [1]}\noutput: [{name: y, data_type: TYPE_FP32, dims: [16]}]\n",
}
TRITON, FERRY, ADAPTIVE = "Triton", "Ferry", "Ferry adaptive"
CONTROL = "Ferry adaptive, again"  # --control: the same model as ADAPTIVE, run a second time in each round


# ---------------------------------------------------------------- pure parts (tested in tests/unit/test_bench_peers.py)
def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of one point's rounds."""
    return float(np.median(values)), float(min(values)), float(max(values))


def round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Ratios taken round by round: two systems measured back to back share that moment's machine."""
    return [a / b for a, b in zip(numerator, denominator) if b > 0]


def describe(values: list[float], digits: int = 2) -> str:
    """`median [min-max]`, the form every figure of this benchmark is reported in."""
    if not values:
        return "n/a"
    mid, low, high = spread(values)
    return f"{mid:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def ferry_systems(windows_ms: list[float], control: bool) -> dict[str, str]:
    """Ferry's variants, system -> the suffix of the model serving it: the fixed windows (the first one
    under the plain name FERRY), the adaptive window and, with `control`, the adaptive window again."""
    systems = {FERRY if i == 0 else f"Ferry {ms:g} ms": "" if i == 0 else _window_suffix(ms) for i, ms in enumerate(windows_ms)}
    systems[ADAPTIVE] = "_adaptive"
    if control:
        systems[CONTROL] = "_adaptive"
    return systems


def _window_suffix(ms: float) -> str:
    return f"_w{ms:g}".replace(".", "p")


def best_fixed(by_system: dict[str, list[dict]], systems: dict[str, str]) -> str:
    """Ferry's fixed-window variant with the highest median throughput at a point."""
    fixed = [s for s in systems if s not in (ADAPTIVE, CONTROL)]
    return max(fixed, key=lambda s: spread([x["rps"] for x in by_system[s]])[0])


def rotation(systems: list[str], round_index: int) -> list[str]:
    """The order systems run in a round: rotated each round so none always runs first."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


# ---------------------------------------------------------------- the Triton environment and server
def pytriton_python() -> Path:
    """The PyTriton venv's interpreter, made on first use (pip needs the network once; ~60 MB)."""
    venv = CACHE / "pytriton-venv"
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import pytriton, onnxruntime, numpy"]
    if python.exists() and subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
        return python
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"peers: making {venv} with {PYTRITON} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(python), "-m", "pip", "install", "-q", PYTRITON, "onnxruntime", "numpy"], check=True, timeout=1200)
    subprocess.run(probe, check=True, timeout=120)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_lines(proc: subprocess.Popen, patterns: list[str], timeout_s: float) -> list[re.Match]:
    """Read the child's output until each of `patterns` has appeared in turn, bounded in time; keeps
    draining it afterwards so a chatty server never blocks on a full pipe."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline, seen, matches = time.monotonic() + timeout_s, [], []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        found = re.search(patterns[len(matches)], line)
        if found:
            matches.append(found)
            if len(matches) == len(patterns):
                return matches
    proc.kill()
    raise RuntimeError(f"no {patterns[len(matches)]!r} within {timeout_s:.0f} s; last output:\n{''.join(seen[-30:])}")


def triton_environment(python: Path) -> dict[str, str]:
    """Triton's Python backend stub loads libpython by name; put the venv interpreter's own first, or a
    machine with two builds of one Python version (here pyenv 3.11.7 and Debian's 3.11.2) pairs one's
    C library with the other's standard library and the stub fails in multiprocessing."""
    libdir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
                            capture_output=True, text=True, timeout=60).stdout.strip()
    paths = [libdir, os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "PYTHONUNBUFFERED": "1", "LD_LIBRARY_PATH": ":".join(p for p in paths if p)}


def start_triton(onnx_dir: Path, names: list[str], timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    grpc_port = free_port()
    cmd = [str(pytriton_python()), str(Path(__file__).with_name("peers_triton.py")), "--models", str(onnx_dir),
           "--names", ",".join(names),           "--grpc-port", str(grpc_port), "--http-port", str(free_port()), "--metrics-port", str(free_port()),
           "--queue-delay-us", str(QUEUE_DELAY_US), "--max-batch", str(MAX_BATCH)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=triton_environment(Path(cmd[0])), start_new_session=True)
    wait_for_lines(proc, [r"peers-triton: ready"], timeout_s)
    return proc, f"127.0.0.1:{grpc_port}"


def start_ferry(repo: Path, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(common.ferry_command(repo), cwd=common.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found = wait_for_lines(proc, [r"ferry: serving gRPC on (\S+)", r"ferry: ready"], timeout_s)
    return proc, found[0].group(1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# ---------------------------------------------------------------- models, requests, answers
def build(root: Path, names: list[str], windows_ms: list[float]) -> tuple[Path, Path]:
    """<root>/onnx/<name>.onnx for Triton; Ferry's repository holds hard links to the same files, one model per
    Ferry variant (ferry_systems)."""
    onnx_dir, repo = root / "onnx", root / "repo"
    for name in names:
        builder, _, target = MODELS[name]
        path = builder(onnx_dir / f"{name}.onnx")
        head = f"max_batch_size: {MAX_BATCH}\ninstance_group: [{{count: 1, kind: KIND_CPU}}]\n" + FERRY_INPUTS.get(name, "")
        fixed = [(name if i == 0 else name + _window_suffix(ms), f"max_queue_delay_microseconds: {round(ms * 1000)}")
                 for i, ms in enumerate(windows_ms)]
        for model, window in (*fixed, (f"{name}_adaptive", f"latency_target_ms: {target}")):
            (repo / model / "1").mkdir(parents=True, exist_ok=True)
            os.link(path, repo / model / "1" / "model.onnx")
            (repo / model / "config.yaml").write_text(head + f"dynamic_batching: {{{window}}}\n")
    return onnx_dir, repo


def inputs(name: str, count: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Batch-1 requests; the variable-length model's come in `count` seeded lengths."""
    rng = np.random.default_rng(seed)
    if name == "varlen":
        return [{"ids": rng.integers(0, 1000, (1, int(rng.integers(VARLEN_TOKENS[0], VARLEN_TOKENS[1] + 1))))}
                for _ in range(count)]
    shape = (1, 256) if name == "light" else (1, 32, 512)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]


def answer(address: str, model: str, feed: dict[str, np.ndarray]) -> np.ndarray:
    with grpc.insecure_channel(address) as channel:
        request = pb.ModelInferRequest.FromString(common.infer_payload(model, feed))
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    return np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(tuple(reply.outputs[0].shape))


def check_same_answers(addresses: dict[str, str], names: list[str], systems: dict[str, str]) -> None:
    """Speeds are compared only between servers that compute the same thing."""
    for name in names:
        feed = inputs(name, count=1, seed=7)[0]
        reference = answer(addresses[TRITON], name, feed)
        for system, suffix in systems.items():
            if not np.allclose(answer(addresses[system], name + suffix, feed), reference, rtol=1e-4, atol=1e-5):
                raise RuntimeError(f"{system} and Triton answered {name} differently")


# ---------------------------------------------------------------- measuring
def point(address: str, model: str, feeds: list[dict[str, np.ndarray]], concurrency: int, duration_s: float) -> dict:
    payloads = [common.infer_payload(model, feed) for feed in feeds]
    result = asyncio.run(loadgen.closed_loop(address, payloads, concurrency, duration_s=duration_s,
                                             warmup=min(2 * concurrency, 64), timeout_s=30))
    s = result.summary()
    return {"rps": s["throughput_rps"], "p50": s["p50_ms"], "p99": s["p99_ms"], "errors": s["errors"]}


def measure(addresses: dict[str, str], names: list[str], concurrencies: list[int], duration_s: float,
            rounds: int, deadline: float, suffixes: dict[str, str]) -> dict:
    """{(model, concurrency): {system: [run, ...]}}, rounds interleaved within each point (`suffixes`: system ->
    its model's suffix; none for Triton)."""
    runs: dict = {}
    systems = list(addresses)
    for name in names:
        feeds = inputs(name)
        for c in concurrencies:
            if time.monotonic() > deadline:
                print(f"peers: budget spent, skipping {name} at {c}", flush=True)
                continue
            found = runs.setdefault((name, c), {system: [] for system in systems})
            for r in range(rounds):
                for system in rotation(systems, r):
                    found[system].append(point(addresses[system], name + suffixes.get(system, ""), feeds, c, duration_s))
            print(f"peers: {name} c={c} " + "  ".join(
                f"{s}: {describe([x['rps'] for x in v], 0)} req/s" for s, v in found.items()), flush=True)
    return runs


# ---------------------------------------------------------------- reporting
def render(runs: dict, args: argparse.Namespace, wall_s: float, systems: dict[str, str]) -> str:
    rows, ratio_rows, window_rows = [], [], []
    for (name, c), by_system in runs.items():
        for system, found in by_system.items():
            rps, p99 = [x["rps"] for x in found], [x["p99"] for x in found]
            rows.append({"model": name, "concurrency": c, "system": system, "req/s": describe(rps, 0),
                         "p99 ms": describe(p99, 1), "errors": sum(x["errors"] for x in found)})
        triton = by_system[TRITON]
        for system in systems:
            mine = by_system[system]
            ratio_rows.append({"model": name, "concurrency": c, "Ferry variant": _variant(system, args),
                               "req/s Ferry/Triton": describe(round_ratios([x["rps"] for x in mine], [x["rps"] for x in triton])),
                               "p99 Ferry/Triton": describe(round_ratios([x["p99"] for x in mine], [x["p99"] for x in triton]))})
        best = best_fixed(by_system, systems)
        window_rows.append({"model": name, "concurrency": c, "best fixed window": _variant(best, args),
                            "req/s adaptive/best fixed": describe(_rps_ratios(by_system, ADAPTIVE, best)),
                            "control (adaptive/adaptive)": describe(_rps_ratios(by_system, CONTROL, ADAPTIVE)) if CONTROL in systems else "n/a"})
    parts = [f"Both servers on 127.0.0.1 for the whole run; Triton via PyTriton {PYTRITON.split('==')[1]} (ONNX Runtime "
             f"in a `@batch` callable), Ferry `ferry serve`, the same ONNX files; both: 1 instance, max batch {MAX_BATCH}, "
             f"{QUEUE_DELAY_US / 1000:g} ms queue delay (Ferry's fixed windows: {', '.join(f'{ms:g}' for ms in args.windows_ms)} ms; "
             "Ferry adaptive: latency target light 50, heavy 500, varlen 100 ms). "
             f"Load: clients/loadgen.py closed loop, batch-1 requests, the same bytes to both; {args.rounds} interleaved rounds "
             f"of {args.duration:g} s per point; figures are median [min-max] over rounds; whole run {wall_s:.0f} s.", "",
             common.table(rows, ["model", "concurrency", "system", "req/s", "p99 ms", "errors"]), "",
             "Ferry/Triton, ratios taken round by round (throughput: > 1 is Ferry ahead; p99: < 1 is Ferry ahead):", "",
             common.table(ratio_rows, ["model", "concurrency", "Ferry variant", "req/s Ferry/Triton", "p99 Ferry/Triton"]), "",
             "Ferry's adaptive window against its best fixed window (of " + ", ".join(f"{ms:g} ms" for ms in args.windows_ms)
             + "), round by round; the control is the adaptive variant against its own second run in the same round "
             "(--control): the spread a ratio of identical configurations has here:", "",
             common.table(window_rows, ["model", "concurrency", "best fixed window", "req/s adaptive/best fixed",
                                        "control (adaptive/adaptive)"])]
    return "\n".join(parts) + "\n" + targets(runs, systems)


def _variant(system: str, args: argparse.Namespace) -> str:
    return f"{args.windows_ms[0]:g} ms window" if system == FERRY else system.replace("Ferry", "").strip()


def _rps_ratios(by_system: dict, numerator: str, denominator: str) -> list[float]:
    return round_ratios([x["rps"] for x in by_system[numerator]], [x["rps"] for x in by_system[denominator]])


def targets(runs: dict, systems: dict[str, str]) -> str:
    """The issues' bars: Ferry/Triton >= 1.2 on the light model at 64 (adaptive: >= 1.5), >= 1.0 on the heavy
    one; on the light model at 64, the adaptive window >= 0.97x Ferry's best fixed window in every round."""
    lines = []
    for name, c, bar in (("light", 64, 1.2), ("heavy", 64, 1.0)):
        if (name, c) not in runs:
            continue
        by_system = runs[(name, c)]
        triton = spread([x["rps"] for x in by_system[TRITON]])[0]
        for system, label in ((FERRY, "first fixed window"), (ADAPTIVE, "adaptive window")):
            ratio = spread([x["rps"] for x in by_system[system]])[0] / triton
            wanted = 1.5 if system == ADAPTIVE and name == "light" else bar
            lines.append(f"- {name}, concurrency {c}: Ferry ({label}) / Triton throughput, ratio of medians {ratio:.2f} "
                         f"(target >= {wanted}: {'met' if ratio >= wanted else 'NOT met'})")
        if name == "light":
            ratios = _rps_ratios(by_system, ADAPTIVE, best_fixed(by_system, systems))
            lines.append(f"- light, concurrency {c}: adaptive / best fixed window, lowest round {min(ratios):.2f}, median "
                         f"{spread(ratios)[0]:.2f} (target >= 0.97 in every round: {'met' if min(ratios) >= 0.97 else 'NOT met'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,64,128")
    parser.add_argument("--models", default="light,heavy,varlen")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measured run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=1800, help="no new points after this many seconds")
    parser.add_argument("--windows", default=f"{QUEUE_DELAY_US / 1000:g}",
                        help="Ferry's fixed windows in ms, each a variant (the first is Triton's delay too)")
    parser.add_argument("--control", action="store_true", help="run the adaptive variant twice per round (an A/A ratio)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    args = parser.parse_args()
    names, concurrencies = args.models.split(","), [int(c) for c in args.concurrency.split(",")]
    args.windows_ms = [float(ms) for ms in args.windows.split(",")]
    systems = ferry_systems(args.windows_ms, args.control)
    t0 = time.monotonic()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        onnx_dir, repo = build(Path(tmp), names, args.windows_ms)
        try:
            triton, triton_address = start_triton(onnx_dir, names)
            procs.append(triton)
            ferry, ferry_address = start_ferry(repo)
            procs.append(ferry)
            addresses = {TRITON: triton_address, **{system: ferry_address for system in systems}}
            check_same_answers(addresses, names, systems)
            runs = measure(addresses, names, concurrencies, args.duration, args.rounds, t0 + args.budget, systems)
        finally:
            for proc in procs:
                stop(proc)
    report = render(runs, args, time.monotonic() - t0, systems)
    print(report)
    if not args.no_record:
        common.append_results("Ferry and Triton side by side (bench/peers.py)", report)


if __name__ == "__main__":
    main()
