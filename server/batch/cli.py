"""`ferry batch -i INPUT.jsonl -o (OUTPUT.jsonl | DIR/) (--model-repository REPO | --url URL) [--ray [ADDRESS]]`.

URL: http(s)://HOST:PORT (the HTTP door), grpc(s)://HOST:PORT or a bare HOST:PORT (the gRPC door).

Exit status: 0 every request answered (HTTP errors included: each is an answer in OUTPUT), 1 some
got no answer (a 503 that persisted, a remote server unreachable; rerun to retry them), 2 the command
line, INPUT or OUTPUT is wrong (nothing run, OUTPUT untouched), 130 interrupted (rerun to finish).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
from pathlib import Path

from server import event_loop
from server.batch.output import AnswerWriter, OutputFileError, ShardWriter, drop_torn, read_answered_in
from server.batch.progress import Progress, Tally
from server.batch.requests import InvalidInputFile, requests, validate
from server.batch.run import DEFAULT_IN_FLIGHT, run_lines

log = logging.getLogger("ferry.batch")
_GRPC_ADDRESS = re.compile(r"(?:grpcs?://)?(?:\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):[0-9]{1,5}/?")


def add_batch_command(sub) -> None:
    p = sub.add_parser("batch", help="offline batch inference: a file of requests (OpenAI Batch format) in, answers out")
    p.add_argument("-i", "--input", type=Path, required=True, help="JSONL: {custom_id, method, url, body} a line")
    p.add_argument("-o", "--output", required=True,
                   help="JSONL answers, appended as they come; an existing file is resumed (its custom_ids skipped). "
                        "DIR/ (a trailing slash, or an existing folder): shard files in DIR, one per run, or with "
                        "--ray one per batch an actor answers; every *.jsonl in DIR counts for the resume")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model-repository", type=Path, help="run in this process on this repository (no port opened)")
    where.add_argument("--url", help="send to a running server instead: its HTTP door (http://127.0.0.1:8000) or its "
                                     "gRPC door (grpc://127.0.0.1:8001, or a bare HOST:PORT as tritonclient takes it)")
    p.add_argument("--max-in-flight", type=int, default=DEFAULT_IN_FLIGHT,
                   help=f"requests sent and not yet answered, per engine (default {DEFAULT_IN_FLIGHT})")
    p.add_argument("--token", default=os.environ.get("FERRY_TOKEN"),
                   help="--url: bearer token sent with every request (default: env FERRY_TOKEN)")
    p.add_argument("--timeout", type=float, help="--url: seconds one request may take (default: none)")
    ray = p.add_argument_group("Ray Data (pip install ferry-serve[ray])")
    ray.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                     help="run on Ray: `local` (the default) starts Ray on this machine, `auto` or ray://HOST:PORT "
                          "joins a cluster; each actor holds one in-process engine (needs --model-repository)")
    ray.add_argument("--ray-actors", type=int, default=1, help="actors in the pool (default 1)")
    ray.add_argument("--ray-cpus-per-actor", type=float, default=1.0, help="CPUs reserved per actor (default 1)")
    ray.add_argument("--ray-gpus-per-actor", type=float, default=0.0, help="GPUs reserved per actor (default 0)")
    ray.add_argument("--ray-batch-size", type=int, default=DEFAULT_IN_FLIGHT,
                     help=f"lines handed to an actor at a time (default {DEFAULT_IN_FLIGHT})")
    p.add_argument("--event-loop", choices=event_loop.CHOICES, default=event_loop.AUTO)
    p.add_argument("--log-level", default="WARNING", help="server log level on stderr (default WARNING)")
    p.set_defaults(run=main)


def main(args) -> int:
    from server.observability.log_settings import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    args.folder = args.output.endswith(("/", os.sep)) or Path(args.output).is_dir()
    args.output = Path(args.output)
    problem = _flag_problem(args)
    if problem:
        print(f"ferry batch: {problem}", file=sys.stderr)
        return 2
    try:
        done, kept = read_answered_in(args.output, args.folder)
        count, already = validate(args.input, done, _line_check(args))
    except (InvalidInputFile, OutputFileError, OSError) as exc:
        print(f"ferry batch: {exc}", file=sys.stderr)
        return 2
    for path, length in kept.items():
        drop_torn(path, length)
    if args.folder:
        args.output.mkdir(exist_ok=True)
    tally = Tally(total=count - already, skipped=already)
    try:
        if tally.total == 0:
            pass  # everything is answered already: no model to load
        elif args.ray is not None:
            from server.batch.ray_run import run_on_ray

            run_on_ray(args, done, tally)
        else:
            event_loop.run(_run_here(args, done, tally), args.event_loop)
    except KeyboardInterrupt:
        Progress(tally).summary(args.output)
        print(f"ferry batch: interrupted; run the same command again to answer the rest into {args.output}",
              file=sys.stderr)
        return 130
    Progress(tally).summary(args.output)
    return 1 if tally.unanswered else 0


def _flag_problem(args) -> str | None:
    if args.max_in_flight < 1:
        return f"--max-in-flight must be 1 or more, got {args.max_in_flight}"
    if args.url is not None and not args.url.startswith(("http://", "https://")) and not _GRPC_ADDRESS.fullmatch(args.url):
        return ("--url takes the server's HTTP address (http://HOST:PORT, https://HOST:PORT) or its gRPC address "
                f"(grpc://HOST:PORT, grpcs://HOST:PORT, or HOST:PORT); got {args.url!r}")
    if args.model_repository is not None and not args.model_repository.is_dir():
        return f"--model-repository {args.model_repository} is not a folder"
    if args.ray is not None and args.model_repository is None:
        return "--ray runs in-process engines in its actors: it needs --model-repository"
    if args.ray is not None and importlib.util.find_spec("ray") is None:
        return "--ray needs Ray Data: pip install 'ferry-serve[ray]' (or pip install 'ray[data]')"
    if args.ray_actors < 1:
        return f"--ray-actors must be 1 or more, got {args.ray_actors}"
    if args.folder and args.output.exists() and not args.output.is_dir():
        return f"--output {args.output}/ names a folder, but {args.output} is a file"
    if args.folder and args.input.resolve().parent == args.output.resolve():
        return f"--input {args.input} lies in the --output folder, whose files are the answers; move it out"
    if not args.output.absolute().parent.is_dir():
        return f"--output {args.output}: the folder {args.output.absolute().parent} does not exist"
    if args.input.resolve() == args.output.resolve():
        return "--input and --output are the same file"
    return None


def _line_check(args):
    """Lines bound for a gRPC door are checked for what has no gRPC equivalent, with the rest of the file."""
    if args.url is None or args.url.startswith(("http://", "https://")):
        return None
    from server.batch.remote import grpc_problem

    return grpc_problem


async def _run_here(args, done: set[str], tally: Tally) -> None:
    if args.url is not None:
        from server.batch.remote import GrpcServer, RemoteServer, grpc_target

        grpc_door = grpc_target(args.url)
        engine = (RemoteServer(args.url, args.max_in_flight, args.token, args.timeout) if grpc_door is None
                  else GrpcServer(*grpc_door, args.token, args.timeout))
    else:
        from server.batch.local import LocalEngine

        engine = LocalEngine(args.model_repository)
    async with engine:
        tally.started = time.perf_counter()  # loading models is not part of the rate
        with ShardWriter(args.output) if args.folder else AnswerWriter(args.output) as writer:
            await run_lines(engine, requests(args.input, done), writer, tally, args.max_in_flight, Progress(tally))
