"""What tracing costs: the light model at concurrency 64 with tracing off, rate=100 and rate=1, in one run.

    python -m bench.tracing [--concurrency 64] [--duration 5] [--rounds 3] [--mode triton|opentelemetry]
                            [--baseline COMMIT]

Three `ferry serve` processes on one repository (bench/models.py's light MLP, x [1, 256] -> y [1, 16],
dynamic batching), started one after another and each driven by clients/loadgen.py's closed loop over
gRPC ModelInfer:
  * off:      no --trace-config (the hot path pays one `tracing.active` check per request);
  * rate=100: `level=TIMESTAMPS rate=100` into a trace file (Triton's mode) or OTLP spans;
  * rate=1:   every request traced;
  * before:   with --baseline COMMIT, Ferry as it was at that commit (git archive), no tracing code at all.
Rounds are interleaved (off, 100, 1, then again) so a shared machine's drift hits each alike; medians
over rounds are reported with every run listed. In OpenTelemetry mode the spans go to a local port
where nothing listens (export failures are counted, never waited on), which is the export's worst case.
Appended to bench/RESULTS.md unless --no-record.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench import common, models
from clients import loadgen

MODEL = "mlp"
SETTINGS = {"off": [], "rate=100": ["level=TIMESTAMPS", "rate=100"], "rate=1": ["level=TIMESTAMPS", "rate=1"]}


def build(root: Path) -> Path:
    models.light_mlp(root / MODEL / "1" / "model.onnx")
    (root / MODEL / "config.yaml").write_text(
        "max_batch_size: 128\ndynamic_batching: {}\ninstance_group: [{count: 1, kind: KIND_CPU}]\n")
    return root


def flags(name: str, mode: str, trace_file: Path) -> list[str]:
    chosen = SETTINGS[name]
    if not chosen:
        return []
    extra = ["triton,file=" + str(trace_file)] if mode == "triton" else \
        ["mode=opentelemetry", "opentelemetry,url=http://127.0.0.1:9/v1/traces"]
    return [arg for value in (*chosen, *extra) for arg in ("--trace-config", value)]


def run_point(repo: Path, name: str, args: argparse.Namespace, tmp: Path, round_: int) -> dict:
    trace_file = tmp / f"trace-{name.replace('=', '')}-{round_}.json"
    if name == "before":
        from bench.hotpath import start_baseline

        (tmp / f"before-{round_}").mkdir()
        proc, address = start_baseline(args.baseline, repo, tmp / f"before-{round_}")
    else:
        proc, address = common.start_server(common.ferry_command(repo, *flags(name, args.mode, trace_file)))
    try:
        payloads = [common.infer_payload(MODEL, {"x": np.random.default_rng(i).standard_normal((1, 256), np.float32)})
                    for i in range(16)]
        result = asyncio.run(loadgen.closed_loop(address, payloads, args.concurrency, duration_s=args.duration,
                                                 warmup=args.concurrency * 4))
    finally:
        proc.terminate()
        proc.wait(60)
    row = result.summary()
    traced = _traces(trace_file) if args.mode == "triton" and SETTINGS.get(name) else 0
    return {"setting": name, "round": round_, "req_per_s": row["throughput_rps"], "p50_ms": row["p50_ms"],
            "p99_ms": row["p99_ms"], "errors": row["errors"], "traces_written": traced}


def settings(args: argparse.Namespace) -> list[str]:
    return [*(["before"] if args.baseline else []), *SETTINGS]


def _traces(path: Path) -> int:
    import json

    if not path.exists():
        return 0
    return sum(1 for entry in json.loads(path.read_text()) if "model_name" in entry)


def render(rows: list[dict], args: argparse.Namespace) -> str:
    summary = []
    for name in settings(args):
        mine = [r for r in rows if r["setting"] == name]
        summary.append({"setting": name, "req_per_s (median)": round(statistics.median(r["req_per_s"] for r in mine), 1),
                        "p99_ms (median)": round(statistics.median(r["p99_ms"] for r in mine), 2),
                        "errors": sum(r["errors"] for r in mine)})
    off = next(r["req_per_s (median)"] for r in summary if r["setting"] == "off")
    for row in summary:
        row["vs off"] = f"{row['req_per_s (median)'] / off:.2f}x" if off else "n/a"
    head = (f"Light MLP, gRPC closed loop at concurrency {args.concurrency}, {args.duration:g} s per point, "
            f"{args.rounds} interleaved rounds, mode {args.mode}.\n\n")
    return head + common.table(summary, list(summary[0])) + "\n\nEvery run:\n\n" + common.table(rows, list(rows[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("triton", "opentelemetry"), default="triton")
    parser.add_argument("--baseline", help="also run Ferry at this commit (e.g. the one before tracing landed)")
    parser.add_argument("--note", default="", help="a line written above the table (e.g. the machine was busy)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to bench/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = build(tmp / "repo")
        rows = []
        for round_ in range(args.rounds):
            order = settings(args) if round_ % 2 == 0 else list(reversed(settings(args)))
            for name in order:
                rows.append(run_point(repo, name, args, tmp, round_))
                print(rows[-1], flush=True)
    body = (args.note + "\n\n" if args.note else "") + render(rows, args)
    print(body)
    if not args.no_record:
        common.append_results("Tracing cost (bench/tracing.py)", body)


if __name__ == "__main__":
    main()
