"""`ferry tune MODEL`: find the model's best batching config by measuring it, and write the config.

    ferry tune mlp --model-repository models/ --concurrency 64 --p99-ms 30 --budget 3m --output mlp.pbtxt
    ferry tune mlp --url 127.0.0.1:8001 --from-trace traffic.jsonl --apply --model-repository models/

See docs/tuning.md. Exit status: 0 done, 1 the server could not be tuned, 2 the command line was wrong.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from clients import perf
from clients.errors import FerryClientError
from clients.tune import report, space, workload
from clients.tune.measure import Load
from clients.tune.search import NOISE_FLOOR, Objective, Search
from clients.tune.target import NotTunable, Target, start_local


def add_tune_command(sub) -> None:
    p = sub.add_parser("tune", help="measure batching configs of a model by hot reload and write the best one")
    p.add_argument("model")
    where = p.add_argument_group("server")
    where.add_argument("--model-repository", type=Path, metavar="DIR",
                       help="the model repository: without --url, tune starts its own server on it (free ports, "
                            "explicit model control); with --url, the running server's repository (for --apply)")
    where.add_argument("--url", help="tune a running server (HOST:PORT of gRPC; it needs --model-control-mode explicit)")
    where.add_argument("--token", default=os.environ.get("FERRY_TOKEN"),
                       help="bearer token; model control needs the admin token when tokens are set")
    where.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                       help="an extra `ferry serve` argument for the server tune starts (repeatable)")
    goal = p.add_argument_group("objective")
    goal.add_argument("--objective", choices=("throughput", "latency"), default="throughput",
                      help="maximise requests/s (output tokens/s for generation) or minimise p99 (default throughput; "
                           "with --rate or --from-trace the arrivals fix the requests/s, so latency)")
    goal.add_argument("--p99-ms", type=float, help="bound on the request p99: the best throughput within it wins")
    goal.add_argument("--ttft-p99-ms", type=float, help="generation: bound on the time-to-first-token p99")
    goal.add_argument("--itl-p99-ms", type=float, help="generation: bound on the inter-token latency p99")
    traffic = p.add_argument_group("traffic")
    level = traffic.add_mutually_exclusive_group()
    level.add_argument("--concurrency", type=int, help="closed loop: this many clients (default 16)")
    level.add_argument("--rate", help="open loop: Poisson arrivals, e.g. 500 or 500/s")
    level.add_argument("--from-trace", type=Path, metavar="FILE",
                       help="replay the arrivals and sizes `ferry serve --record-traffic FILE` recorded")
    traffic.add_argument("--input-data", type=Path, metavar="FILE",
                         help="real inputs, as perf_analyzer's: {\"data\": [{INPUT: values}, ...]} (else random)")
    traffic.add_argument("--batch-size", type=int, default=1, help="rows per synthetic request (batching models)")
    traffic.add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2",
                         help="a synthetic input's shape without the batch dimension, for variable dimensions")
    traffic.add_argument("--prompt-length", default="32", metavar="N|LO:HI", help="generation: words per prompt")
    traffic.add_argument("--max-tokens", type=int, default=32, help="generation: tokens per request")
    traffic.add_argument("--requests", type=int, help="requests per measurement (default: --duration)")
    traffic.add_argument("--duration", type=float, default=3.0, help="seconds per measurement (default 3)")
    traffic.add_argument("--warmup", type=int, default=8, help="requests sent after each reload, not measured")
    traffic.add_argument("--seed", type=int, default=0)
    search = p.add_argument_group("search")
    search.add_argument("--budget", default="5m", help="time for the whole search: 90s, 5m, 1h (default 5m)")
    search.add_argument("--max-candidates", type=int, help="stop after this many configs besides the served one")
    search.add_argument("--candidate", action="append", default=[], metavar="KEY=VALUE,...",
                        help="also measure this config (e.g. max_batch_size=16,window=2000,preferred=16,instances=2; "
                             "generation: max_num_seqs=32,max_num_batched_tokens=1024,max_step_ms=25)")
    search.add_argument("--noise-floor", type=float, default=NOISE_FLOOR,
                        help=f"relative differences below this are ties whatever the A/A pair shows (default {NOISE_FLOOR})")
    out = p.add_argument_group("output")
    out.add_argument("--output", type=Path, metavar="FILE", help="write the winning config.pbtxt here "
                                                                  "(default: tuned-MODEL.pbtxt)")
    out.add_argument("--apply", action="store_true",
                     help="write the winner into the model's folder as config.pbtxt (the old config kept beside it as "
                          "*.before-tune-TIMESTAMP) and reload the model from it")
    out.add_argument("--json", type=Path, metavar="FILE", help="every measurement, as JSON")
    out.add_argument("--plot", type=Path, metavar="FILE.png", help="throughput against p99, frontier marked (matplotlib)")
    p.set_defaults(run=run)


def parse_budget(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text)
    if not match:
        raise ValueError(f"--budget {text!r}: expected a time such as 90s, 5m or 1h")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]


def _check(args) -> None:
    if args.url is None and args.model_repository is None:
        raise ValueError("give --model-repository DIR (tune starts its own server) or --url HOST:PORT (a running one)")
    if args.model_repository is not None and not args.model_repository.is_dir():
        raise ValueError(f"--model-repository {args.model_repository} is not a folder")
    if args.apply and args.model_repository is None:
        raise ValueError("--apply writes the model's config.pbtxt: give --model-repository DIR (the server's repository)")
    for flag, value in (("--concurrency", args.concurrency), ("--requests", args.requests),
                        ("--max-candidates", args.max_candidates)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be 1 or more, got {value}")


def run(args) -> int:
    try:
        _check(args)
        budget_s = parse_budget(args.budget)
    except ValueError as exc:
        print(f"ferry tune: error: {exc}", file=sys.stderr)
        return 2
    target = None
    try:
        target = (Target(args.url, {"token": args.token}) if args.url
                  else start_local(args.model_repository, args.model, args.server_arg))
        target.check_control()
        return _tune(args, target, budget_s)
    except NotTunable as exc:
        print(f"ferry tune: {exc}", file=sys.stderr)
        return 1
    except (FerryClientError, RuntimeError) as exc:
        print(f"ferry tune: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"ferry tune: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if target is not None:
            target.close()


def _tune(args, target: Target, budget_s: float) -> int:
    if not target.client.is_model_ready(args.model):
        raise RuntimeError(f"model {args.model!r} is not ready on {target.url}")
    base = target.config(args.model)
    generation = space.is_generation(base)
    load = _load(args, target, generation)
    kind = args.objective
    if load.concurrency is None and kind == "throughput":  # open loop: the arrivals set the requests/s
        kind = "latency"
        print("ferry tune: arrivals at a set rate or from a trace fix the requests/s: the lowest p99 wins "
              "(within the bounds given)", file=sys.stderr)
    objective = Objective(kind, args.p99_ms, args.ttft_p99_ms, args.itl_p99_ms, generation)
    extra = [space.parse(text, generation, space.current(base)) for text in args.candidate]
    print(f"ferry tune: {args.model} at {load.describe()}, budget {budget_s:g}s", file=sys.stderr)
    search = Search(target, args.model, base, load, objective, budget_s, args.max_candidates, extra,
                    latency_target_ms=args.p99_ms or 50.0, noise_floor=args.noise_floor,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    outcome = search.run()
    winner = space.apply(base, outcome.winner.knobs, search.latency_target_ms)
    print(report.table(outcome, objective))
    print()
    print(report.side_by_side(outcome, objective))
    output = args.output or Path(f"tuned-{args.model}.pbtxt")
    output.write_text(report.config_text(winner))
    print(f"wrote {output}", file=sys.stderr)
    if args.json:
        report.write_json(report.document(args.model, outcome, objective, load.describe(), winner), args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        drawn = report.plot(outcome, objective, args.plot)
        print(f"wrote {args.plot}" if drawn else "no plot: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
    if args.apply:
        _apply(args, target, winner, outcome.tie)
    return 0


def _load(args, target: Target, generation: bool) -> Load:
    """The traffic of every measurement, and its pre-serialized requests."""
    client = target.client
    data = workload.read_input_data(client, args.model, args.input_data) if args.input_data else None
    if args.from_trace:
        recorded = workload.trace(client, args.model, args.from_trace, generation, args.seed, data)
        return Load(recorded.workload, trace=recorded, warmup=args.warmup, largest=recorded.largest)
    if generation:
        work = perf.generate_workload(args.model, "", perf.parse_length(args.prompt_length), args.seed,
                                      max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    elif data:
        work = workload.given_inputs(args.model, data)
    else:
        work = perf.infer_workload(client, args.model, "", args.batch_size, perf.parse_shapes(args.shape), args.seed)
    rate = float(args.rate.removesuffix("/s")) if args.rate else None
    if rate is not None and rate <= 0:
        raise ValueError(f"--rate {args.rate!r}: expected a positive number of requests/s")
    largest = max((len(a) for inputs in data for a in inputs.values()), default=1) if data else args.batch_size
    return Load(work, concurrency=None if rate else args.concurrency or 16, rate=rate, requests=args.requests,
                duration_s=args.duration, warmup=args.warmup, largest=1 if generation else largest)


def _apply(args, target: Target, winner, tie: bool) -> None:
    if tie:
        print("--apply: nothing to apply: the served config stays (no candidate beat it beyond the noise)",
              file=sys.stderr)
        return
    folder = args.model_repository / args.model
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in ("config.yaml", "config.yml", "config.pbtxt"):
        if (folder / name).is_file():
            (folder / name).rename(folder / f"{name}.before-tune-{stamp}")
    (folder / "config.pbtxt").write_text(report.config_text(winner))
    target.client.load_model(args.model)  # from the folder: the file just written is what loads
    print(f"applied: wrote {folder / 'config.pbtxt'} and reloaded {args.model}", file=sys.stderr)
