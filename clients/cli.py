"""The client side of the `ferry` command: models, health, infer, generate and perf.

`--url http://HOST:8000` (or https://) sends models, health, infer and generate through the HTTP
front door instead of gRPC (clients/rest.py), for where only that port is reachable; perf drives gRPC.

`add_client_commands` registers them beside `ferry serve`; `python -m clients` runs them without the
server installed. Every handler returns the exit status: 0 done, 1 the server said no (or is not
ready), 2 the command line was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from clients import perf, report, tensors
from clients.client import InferenceClient
from clients.errors import FerryClientError
from clients.messages import GenerateDelta
from clients.rest import RestClient, is_http_url
from clients.progress import ProgressBar

DEFAULT_URL = "127.0.0.1:8001"


def add_client_commands(sub) -> None:
    """Add the client subcommands to an argparse subparsers object; each sets `run` to its handler."""
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--url", default=DEFAULT_URL,
                            help=f"server HOST:PORT (default {DEFAULT_URL}); several replicas as H1:P1,H2:P2 or "
                                 "dns:///NAME:PORT are balanced by the client (round_robin, health checks, retries); "
                                 "http://HOST:PORT (or https://) uses the HTTP front door instead (not for perf)")
    connection.add_argument("--timeout", type=float, help="deadline of each call in seconds (default: none)")
    tls = connection.add_argument_group("TLS")
    tls.add_argument("--ssl", action="store_true", help="TLS with the system's trust store")
    tls.add_argument("--root-certs", type=Path, help="PEM roots to verify the server with (implies --ssl)")
    tls.add_argument("--client-cert", type=Path, help="PEM certificate chain for mutual TLS")
    tls.add_argument("--client-key", type=Path, help="PEM private key for mutual TLS")
    tls.add_argument("--tls-server-name", help="name to verify when it differs from the URL's host")
    connection.add_argument("--token", default=os.environ.get("FERRY_TOKEN"),
                            help="bearer token sent as 'authorization: Bearer TOKEN' (default: env FERRY_TOKEN)")
    connection.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                            help="metadata sent with every call (repeatable)")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="machine-readable output")
    common = [connection, as_json]

    p = sub.add_parser("models", parents=common, help="list the repository's models with state and reason")
    p.add_argument("--ready", action="store_true", help="only models that are ready")
    p.set_defaults(run=_guard(_models))

    p = sub.add_parser("health", parents=common, help="is the server (and are some models) live and ready")
    p.add_argument("--model", action="append", default=[], help="also check this model (repeatable)")
    p.set_defaults(run=_guard(_health))

    p = sub.add_parser("infer", parents=common, help="run one inference request")
    p.add_argument("model")
    p.add_argument("--input", action="append", default=[], metavar="NAME=VALUE", required=True,
                   help="a JSON literal such as [[1, 2]] or a .npy file (repeat per input)")
    p.add_argument("--output", action="append", default=[], metavar="NAME", help="only these outputs")
    p.add_argument("--save", type=Path, metavar="DIR", help="write each output to DIR/NAME.npy")
    p.add_argument("--model-version", default="")
    p.set_defaults(run=_guard(_infer))

    p = sub.add_parser("generate", parents=common, help="stream generated text to the terminal")
    p.add_argument("model")
    p.add_argument("prompt")
    _sampling_args(p)
    p.add_argument("--model-version", default="")
    p.set_defaults(run=_guard(_generate))

    p = sub.add_parser("perf", parents=[connection], help="load test: latency and throughput across load levels")
    _perf_args(p)
    p.set_defaults(run=_guard(_perf))

    from clients.tune.cli import add_tune_command  # here: it imports this module's neighbours

    add_tune_command(sub)  # tune: search batching configs by hot reload (its own errors and exit statuses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry client commands")
    add_client_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def _sampling_args(p) -> None:
    p.add_argument("--max-tokens", type=int, help="default: the model's default_max_tokens")
    p.add_argument("--temperature", type=float, help="0 (the default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, help="keep going past end-of-sequence")


def _perf_args(p) -> None:
    p.add_argument("model")
    p.add_argument("--model-version", default="")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--concurrency", help="closed loop: comma-separated caller counts (default 1)")
    level.add_argument("--request-rate", help="open loop: comma-separated Poisson arrival rates, requests/s")
    p.add_argument("--requests", type=int, help="requests per load level")
    p.add_argument("--duration", type=float, help="seconds per load level (default 5 unless --requests)")
    p.add_argument("--warmup", type=int, default=4, help="requests sent before the first level is measured")
    p.add_argument("--mode", choices=["auto", "infer", "generate"], default="auto",
                   help="auto: generate for generation models, infer otherwise")
    p.add_argument("--batch-size", type=int, default=1, help="rows per request for batching models")
    p.add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2",
                   help="an input's shape without the batch dimension, for variable dimensions")
    p.add_argument("--prompt-length", default="32", metavar="N|LO:HI", help="words per prompt (about one token each)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --max-tokens (default) or stop at end-of-sequence")
    p.add_argument("--seed", type=int, default=0, help="for the synthetic data and the arrival times")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write the report as JSON (no FILE: stdout)")
    p.add_argument("--csv", nargs="?", const="-", metavar="FILE", help="write one CSV line per level (no FILE: stdout)")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw latency against throughput (needs matplotlib)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="progress bar on stderr (default: when stderr is a terminal)")


def _guard(handler):
    def run(args) -> int:
        try:
            return handler(args)
        except FerryClientError as exc:
            print(f"ferry {args.command}: {exc}", file=sys.stderr)
            return 1
        except RuntimeError as exc:  # e.g. --plot without matplotlib, a failed warm-up
            print(f"ferry {args.command}: error: {exc}", file=sys.stderr)
            return 1
        except (ValueError, OSError) as exc:
            print(f"ferry {args.command}: error: {exc}", file=sys.stderr)
            return 2

    return run


def _client(args) -> InferenceClient | RestClient:
    """gRPC, or the HTTP front door for an http:// or https:// URL (same results, same errors)."""
    kind = RestClient if is_http_url(args.url) else InferenceClient
    return kind(args.url, timeout_s=args.timeout, **_client_options(args))


def _client_options(args) -> dict:
    return {"ssl": args.ssl, "root_certificates": args.root_certs, "private_key": args.client_key,
            "certificate_chain": args.client_cert, "tls_server_name": args.tls_server_name, "token": args.token,
            "headers": dict(h.split("=", 1) for h in args.header if "=" in h)}


def _models(args) -> int:
    with _client(args) as client:
        models = client.repository_index(ready_only=args.ready)
    rows = [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in models]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    columns = ["name", "version", "state", "reason"]
    widths = [max([len(c), *(len(r[c]) for r in rows)]) for c in columns]
    for line in [dict(zip(columns, map(str.upper, columns))), *rows]:
        print("  ".join(line[c].ljust(w) for c, w in zip(columns, widths)).rstrip())
    return 0


def _health(args) -> int:
    with _client(args) as client:
        live, ready, meta = client.is_live(), client.is_ready(), client.server_metadata()
        models = {name: client.is_model_ready(name) for name in args.model}
    healthy = live and ready and all(models.values())
    if args.json:
        server = {"name": meta.name, "version": meta.version, "extensions": list(meta.extensions)}
        print(json.dumps({"url": args.url, "live": live, "ready": ready, "server": server, "models": models}, indent=2))
    else:
        print(f"server {meta.name} {meta.version} at {args.url}: live {_yes(live)}, ready {_yes(ready)}")
        print(f"extensions: {', '.join(meta.extensions) or '-'}")
        for name, model_ready in models.items():
            print(f"model {name}: ready {_yes(model_ready)}")
    return 0 if healthy else 1


def _infer(args) -> int:
    with _client(args) as client:
        types = {s.name: s.datatype for s in client.model_metadata(args.model, args.model_version).inputs}
        inputs = dict(_parse_input(spec, types) for spec in args.input)
        outputs = client.infer(args.model, inputs, args.output or None, version=args.model_version)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for name, array in outputs.items():
            np.save(args.save / f"{name}.npy", array, allow_pickle=array.dtype == object)
            if not args.json:
                print(f"wrote {args.save / f'{name}.npy'}")
    if args.json:
        print(json.dumps({"model": args.model, "outputs": {name: _tensor_json(a) for name, a in outputs.items()}}))
    elif not args.save:
        for name, array in outputs.items():
            print(f"{name} {tensors.datatype_of(array)} {list(array.shape)}")
            print(np.array2string(array, threshold=1000, max_line_width=120))
    return 0


def _parse_input(spec: str, types: dict[str, str]) -> tuple[str, np.ndarray]:
    name, sep, value = spec.partition("=")
    if not sep:
        raise ValueError(f"--input {spec!r}: expected NAME=VALUE")
    if name not in types:
        raise ValueError(f"the model has no input {name!r}; its inputs are {sorted(types)}")
    datatype = types[name]
    if value.endswith(".npy"):
        array = np.load(value, allow_pickle=False)
        return name, array if datatype == "BYTES" else array.astype(tensors.BY_API[datatype], casting="same_kind")
    try:
        literal = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(f"--input {name}: {value!r} is neither a JSON literal nor a .npy file") from None
    if datatype == "BYTES":
        return name, np.array(literal, dtype=object)
    return name, np.array(literal, dtype=tensors.BY_API[datatype])


def _tensor_json(array: np.ndarray) -> dict:
    data = array.tolist()
    if array.dtype == object:
        data = np.vectorize(lambda b: b.decode("utf-8", "replace") if isinstance(b, bytes) else b,
                            otypes=[object])(array).tolist()
    return {"datatype": tensors.datatype_of(array), "shape": list(array.shape), "data": data}


def _generate(args) -> int:
    names = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos")
    sampling = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    final = None
    with _client(args) as client:
        for delta in client.generate(args.model, args.prompt, version=args.model_version, **sampling):
            if args.json:
                print(json.dumps(_delta_json(delta)), flush=True)
            else:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            final = delta if delta.last else final
    if not args.json:
        print()
        if final is not None:
            print(_generation_summary(final), file=sys.stderr)
    return 0


def _delta_json(delta: GenerateDelta) -> dict:
    out = {"text": delta.text, "token_ids": list(delta.token_ids)}
    if delta.last:
        out["finish_reason"] = delta.finish_reason
        out["usage"] = delta.usage and {"prompt_tokens": delta.usage.prompt_tokens,
                                        "completion_tokens": delta.usage.completion_tokens}
        out["timings"] = delta.timings and {"queue_ms": delta.timings.queue_ms, "total_ms": delta.timings.total_ms,
                                            "time_to_first_token_ms": delta.timings.time_to_first_token_ms}
    return out


def _generation_summary(final: GenerateDelta) -> str:
    parts = [f"finish: {final.finish_reason}"]
    if final.usage:
        parts.append(f"tokens: {final.usage.prompt_tokens} prompt + {final.usage.completion_tokens} completion")
    if final.timings:
        parts.append(f"time to first token {final.timings.time_to_first_token_ms:.1f} ms, "
                     f"total {final.timings.total_ms:.1f} ms")
    return "[" + "; ".join(parts) + "]"


def _perf(args) -> int:
    if args.json == "-" and args.csv == "-":
        raise ValueError("--json and --csv cannot both print to stdout; give one of them a FILE")
    if is_http_url(args.url):
        raise ValueError("perf drives the gRPC port; give --url HOST:PORT of gRPC (8001 by default), not http://")
    mode = "rate" if args.request_rate else "concurrency"
    levels = _levels(args.request_rate, float) if args.request_rate else _levels(args.concurrency or "1", int)
    duration = args.duration if args.duration is not None or args.requests is not None else 5.0
    with _client(args) as client:
        workload = _workload(client, args)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    rows = []
    client_options = _client_options(args)
    for i, level in enumerate(levels):
        label = f"c={level}" if mode == "concurrency" else f"{level:g} req/s"
        bar = ProgressBar(label, args.requests, duration) if show else None
        before = perf.served_by_replica(args.url, args.model, args.model_version, client_options)
        result = perf.run_point(args.url, workload, concurrency=level if mode == "concurrency" else None,
                                rate=level if mode == "rate" else None, requests=args.requests, duration_s=duration,
                                warmup=args.warmup if i == 0 else 0, timeout_s=args.timeout or 60,
                                seed=args.seed + i, tls=client.tls, progress=bar)
        if bar:
            bar.close(result.completed + sum(result.errors.values()))
        rows.append(perf.row(result))
        if before:
            after = perf.served_by_replica(args.url, args.model, args.model_version, client_options)
            rows[-1]["replicas"] = perf.replica_shares(before, after)
    doc = report.document(args.model, workload.kind, mode, args.url, workload.description, rows)
    _write_report(doc, args)
    return 0


def _levels(text: str, kind) -> list:
    values = [kind(v) for v in text.split(",") if v.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"load levels {text!r}: expected positive, comma-separated numbers")
    return values


def _workload(client: InferenceClient, args) -> perf.Workload:
    kind = args.mode
    if kind == "auto":
        kind = "generate" if perf.is_generation_model(client, args.model, args.model_version) else "infer"
    if kind == "generate":
        sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
        return perf.generate_workload(args.model, args.model_version, perf.parse_length(args.prompt_length),
                                      args.seed, **sampling)
    return perf.infer_workload(client, args.model, args.model_version, args.batch_size,
                               perf.parse_shapes(args.shape), args.seed)


def _write_report(doc: dict, args) -> None:
    if args.json == "-":
        print(report.to_json(doc))
    elif args.csv == "-":
        print(report.to_csv(doc), end="")
    else:
        print(report.table(doc))
    for path, render in ((args.json, report.to_json), (args.csv, report.to_csv)):
        if path and path != "-":
            Path(path).write_text(render(doc) + ("\n" if render is report.to_json else ""))
            print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        report.plot(doc, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
