"""What `ferry tune` shows and writes: the candidates table, the winner beside the served config, the
throughput-against-p99 plot with its frontier, the JSON document, and the winning config.pbtxt."""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import text_format

from clients.tune import space
from clients.tune.search import Candidate, Objective, Outcome
from protos import model_config_pb2 as mc


def _columns(objective: Objective) -> list[tuple[str, str]]:
    rate = ("output_tokens_per_s", "tokens/s") if objective.generation else ("throughput_rps", "req/s")
    extra = [("ttft_p99_ms", "ttft p99"), ("itl_p99_ms", "itl p99")] if objective.generation else []
    return [rate, ("latency_p50_ms", "p50 ms"), ("latency_p99_ms", "p99 ms"), *extra, ("mean_batch", "batch"),
            ("server_cpu", "cpu"), ("errors", "errors")]


def table(outcome: Outcome, objective: Objective) -> str:
    columns = _columns(objective)
    header = ["config", "", *(name for _, name in columns), "runs"]
    rows = []
    for c in outcome.candidates:
        mark = ("current, winner" if c is outcome.current else "winner") if c is outcome.winner else c.label
        if c.error:
            rows.append([space.summary(c.knobs), mark, f"did not load: {c.error[:100]}"])
            continue
        s = c.summary
        rows.append([space.summary(c.knobs), mark, *(_cell(s.get(k)) for k, _ in columns), str(len(c.rows))])
    measured = [r for r in rows if len(r) == len(header)]
    widths = [max(len(r[i]) for r in [header, *measured]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    for r in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def side_by_side(outcome: Outcome, objective: Objective) -> str:
    cur, win = outcome.current.summary, outcome.winner.summary
    lines = [f"{'':14}{'current':>24}{'winner':>24}",
             f"{'config':14}{space.summary(outcome.current.knobs):>24}{space.summary(outcome.winner.knobs):>24}"]
    for key, name in _columns(objective):
        lines.append(f"{name:14}{_cell(cur.get(key)):>24}{_cell(win.get(key)):>24}")
    if objective.excess(win) > 0:
        lines.append("no candidate met the latency bounds at this load: the one nearest to them is shown "
                     "(fewer clients, more cores, or --frontend-processes; see docs/tuning.md)")
    if outcome.tie:
        lines.append(f"verdict: the served config stays: no candidate beat it by more than the noise ({outcome.noise:.1%})")
    else:
        a, b = objective.throughput(cur), objective.throughput(win)
        ratio = f" ({b / a:.2f}x throughput)" if a else ""
        lines.append(f"verdict: the winner beats the served config by more than the noise ({outcome.noise:.1%}){ratio}")
    return "\n".join(lines)


def document(model: str, outcome: Outcome, objective: Objective, load: str, winner: mc.ModelConfig) -> dict:
    def entry(c: Candidate) -> dict:
        return {"config": space.summary(c.knobs), "knobs": c.knobs, "label": c.label, "error": c.error,
                "measurements": c.rows, "summary": c.summary}

    return {"model": model, "load": load, "objective": objective.__dict__, "noise": outcome.noise,
            "tie": outcome.tie, "elapsed_s": round(outcome.elapsed_s, 3), "current": entry(outcome.current),
            "winner": entry(outcome.winner), "candidates": [entry(c) for c in outcome.candidates],
            "skipped": [entry(c) for c in outcome.candidates if c.error],
            "winner_config": text_format.MessageToString(winner)}


def write_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def config_text(config: mc.ModelConfig) -> str:
    return "# written by ferry tune\n" + text_format.MessageToString(config)


def plot(outcome: Outcome, objective: Objective, path: Path) -> bool:
    """Throughput against p99, one point per candidate, the Pareto frontier joined; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    points = [(objective.throughput(c.summary), objective.latency(c.summary) if objective.generation
               else c.summary.get("latency_p99_ms"), c) for c in outcome.candidates if c.rows]
    points = [p for p in points if p[1] is not None and p[1] != float("inf")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], color="tab:blue", label="candidates")
    frontier = sorted((p for p in points if not any(q[0] >= p[0] and q[1] <= p[1] and q is not p
                                                    and (q[0] > p[0] or q[1] < p[1]) for q in points)),
                      key=lambda p: p[0])
    ax.plot([p[0] for p in frontier], [p[1] for p in frontier], color="tab:orange", label="frontier")
    for x, y, c in points:
        ax.annotate(space.summary(c.knobs), (x, y), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
        if c is outcome.winner or c is outcome.current:
            ax.scatter([x], [y], marker="*" if c is outcome.winner else "s", s=160, zorder=3,
                       color="tab:green" if c is outcome.winner else "tab:red",
                       label=("winner (the served config)" if c is outcome.current else "winner")
                       if c is outcome.winner else "current")
    if objective.p99_ms is not None and not objective.generation:
        ax.axhline(objective.p99_ms, color="gray", linestyle="--", label=f"p99 target {objective.p99_ms:g} ms")
    ax.set_xlabel("output tokens/s" if objective.generation else "requests/s")
    ax.set_ylabel("inter-token p99 (ms)" if objective.generation else "p99 latency (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)
