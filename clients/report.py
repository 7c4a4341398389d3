"""`ferry perf` output: a terminal table, JSON, CSV and the latency-throughput plot."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

LEVEL = {"concurrency": "concurrency", "rate": "request_rate"}
TABLE_COLUMNS = ["requests", "completed", "errors", "throughput_rps", "latency_p50_ms", "latency_p90_ms",
                 "latency_p95_ms", "latency_p99_ms"]
GENERATION_COLUMNS = ["output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms"]


def document(model: str, kind: str, mode: str, url: str, workload: dict, rows: list[dict]) -> dict:
    """Everything a run produced, as written by --json."""
    return {"model": model, "kind": kind, "mode": mode, "url": url, "workload": workload, "points": rows}


def table(doc: dict) -> str:
    columns = [LEVEL[doc["mode"]], *TABLE_COLUMNS, *(GENERATION_COLUMNS if doc["kind"] == "generate" else [])]
    cells = [[_cell(row.get(c)) for c in columns] for row in doc["points"]]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    for row in doc["points"]:
        shares = row.get("replicas") or {}
        lines += [f"{_level_label(doc['mode'], row)} replica {address}: {'-' if n is None else n} requests"
                  for address, n in shares.items()]
    errors = {msg: n for row in doc["points"] for msg, n in row.get("error_messages", {}).items()}
    lines += [f"error x{n}: {msg}" for msg, n in errors.items()]
    return "\n".join(lines)


def to_json(doc: dict) -> str:
    return json.dumps(doc, indent=2)


def to_csv(doc: dict) -> str:
    """One line per load level; nested fields (error messages, finish reasons) stay in the JSON."""
    columns = [k for k, v in doc["points"][0].items() if not isinstance(v, dict)] if doc["points"] else []
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(doc["points"])
    return out.getvalue()


def plot(doc: dict, path: Path) -> None:
    """Latency percentiles against throughput, one point per load level (and, for generation, time to
    first token and per output token against output tokens/s)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'ferry-serve[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    generation = doc["kind"] == "generate"
    fig, axes = plt.subplots(1, 2 if generation else 1, figsize=(11 if generation else 6.5, 4.5), squeeze=False)
    points = [p for p in doc["points"] if p["completed"]]
    labels = [_level_label(doc["mode"], p) for p in points]
    _panel(axes[0][0], points, labels, "throughput_rps", "throughput (requests/s)",
           [("latency_p50_ms", "p50"), ("latency_p90_ms", "p90"), ("latency_p99_ms", "p99")], "request latency (ms)")
    if generation:
        _panel(axes[0][1], points, labels, "output_tokens_per_s", "output tokens/s",
               [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("tpot_p50_ms", "TPOT p50")], "ms")
    fig.suptitle(f"ferry perf: {doc['model']} ({doc['mode']} sweep)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, points: list[dict], labels: list[str], x_key: str, x_label: str, series: list, y_label: str) -> None:
    xs = [p[x_key] for p in points]
    for key, name in series:
        ax.plot(xs, [p[key] for p in points], marker="o", label=name)
    top = [p[series[-1][0]] for p in points]
    for x, y, label in zip(xs, top, labels):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _level_label(mode: str, point: dict) -> str:
    return f"c={point['concurrency']}" if mode == "concurrency" else f"{point['request_rate']:g}/s"


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
