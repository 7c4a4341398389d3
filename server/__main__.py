"""`ferry` / `python -m server`: flags -> ServerConfig -> app.run."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from clients.cli import add_client_commands
from server.batch.cli import add_batch_command
from server import __version__, event_loop
from server.defaults import DEFAULT_MAX_BATCH_SIZE, DRAIN_GRACE_S, HTTP_MAX_INPUT_SIZE, MAX_QUEUED_REQUESTS
from server.doors.header_forward import header_forward
from server.doors.tokens import Tokens, read_tokens
from server.doors.grpc.server import MAX_MESSAGE_BYTES, RpcOptions
from server.doors.ports import PortUnavailable


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model repository over gRPC and HTTP")
    p.add_argument("--model-repository", type=Path, required=True, help="folder of <model>/<version>/ folders")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--grpc-port", type=int, default=8001, help="0 picks a free port and prints it")
    p.add_argument("--http-port", type=int, default=8000,
                   help="KServe v2 REST, generate and OpenAI-compatible HTTP port; 0 picks a free port and prints it, -1 disables")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port; 0 picks one, -1 disables")
    p.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, help="gRPC send/receive limit, and the HTTP body limit")
    p.add_argument("--grpc-header-forward-pattern", default=None,
                   help="Triton's flag: gRPC metadata whose name matches this regular expression (case-insensitive "
                        "unless it starts with (?-i)) becomes string request parameters")
    p.add_argument("--http-header-forward-pattern", default=None, help="the same for HTTP infer request headers")
    p.add_argument("--http-max-input-size", type=int, default=HTTP_MAX_INPUT_SIZE,
                   help="HTTP request limit in bytes, as Triton's flag: the body, and the tensors JSON data expands to "
                        "(default 64 MiB; never above --max-message-bytes)")
    p.add_argument("--default-max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE, help="max_batch_size for auto-completed configs")
    p.add_argument("--max-queued-requests", type=int, default=MAX_QUEUED_REQUESTS,
                   help="per model version: refuse beyond this many queued requests even if max_queue_size is 0")
    p.add_argument("--max-queued-bytes", type=int, default=None,
                   help="refuse requests beyond this much queued input data in the whole server "
                        "(default: a quarter of the machine's memory; 0: no limit)")
    p.add_argument("--max-model-queued-bytes", type=int, default=None,
                   help="... per model version (default: half of --max-queued-bytes; 0: only the server's limit)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=16_384, help="gRPC refuses more in-flight calls (0: no limit)")
    p.add_argument("--poll-repository-seconds", type=float, default=0.0,
                   help="hot reload: poll the repository this often and (re)load changed models (0: off)")
    p.add_argument("--drain-grace-seconds", type=float, default=DRAIN_GRACE_S,
                   help="how long shutdown, unload and reload wait for admitted work")
    p.add_argument("--frontend-processes", type=int, default=1,
                   help="processes that serve gRPC on the port (SO_REUSEPORT) and decode/encode ModelInfer, handing "
                        "tensors to this process through shared memory; 1: this process serves gRPC itself")
    p.add_argument("--frontend-arena-bytes", type=int, default=None,
                   help="shared memory per front-end process for tensors in flight (default 64 MiB; beyond it "
                        "tensors travel inline; 0: always inline)")
    p.add_argument("--event-loop", choices=event_loop.CHOICES, default=event_loop.AUTO,
                   help="the asyncio loop this process and its front ends run on: uvloop (libuv, less CPU per "
                        "request), asyncio (the standard library's), auto (uvloop where installed)")
    p.add_argument("--cache-config", action="append", default=[], metavar="local,size=BYTES",
                   help="a response cache, as Triton's flag: `local,size=BYTES` holds up to BYTES of answers for "
                        "models whose config sets response_cache: {enable: true}")
    p.add_argument("--trace-config", action="append", default=[], metavar="[triton,|opentelemetry,]SETTING=VALUE",
                   help="as Triton's (repeatable): level=TIMESTAMPS|TENSORS|OFF, rate=N (one request in N), count=N "
                        "(-1: no limit), mode=triton|opentelemetry, triton,file=PATH, triton,log-frequency=N, "
                        "opentelemetry,url=URL, opentelemetry,resource=KEY=VALUE; see docs/observability.md")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain (with --tls-key) to serve TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key")
    p.add_argument("--tls-ca", type=Path,
                   help="PEM CA: require client certificates signed by it (mutual TLS; needs --tls-cert/--tls-key)")
    p.add_argument("--auth-token-file", type=Path,
                   help="file of bearer tokens (one a line) for inference; also env FERRY_AUTH_TOKEN (comma-separated)")
    p.add_argument("--admin-token-file", type=Path,
                   help="file of bearer tokens for model control (load/unload) and inference; also env FERRY_ADMIN_TOKEN")
    p.add_argument("--metrics-host", help="address the metrics endpoint binds (default: --host)")
    p.add_argument("--server-name", default="ferry",
                   help="name ServerMetadata reports (\"triton\" for clients that check it)")
    access = p.add_argument_group(
        "access", "what clients may do beyond inference (model control, uploads, shared memory, log and trace "
                  "settings: all off by default) and Triton's restricted categories; see docs/security.md")
    access.add_argument("--model-control-mode", choices=("none", "poll", "explicit", "on_demand"), default="none",
                        help="as Triton's: none (the default: load all, refuse load/unload), poll (none + reload what "
                             "changes in the repository), explicit (load only --load-model, load/unload RPCs allowed); "
                             "Ferry's on_demand: list every model, load each on its first inference request, evict the "
                             "least recently used idle ones to stay within --model-memory-budget (docs/many-models.md)")
    access.add_argument("--model-memory-budget", action="append", default=[], metavar="SIZE|cuda:N=SIZE",
                        help="on_demand: memory the loaded models may hold, e.g. 2GiB (host memory) or cuda:0=30GiB "
                             "(a device's; repeatable or comma-separated); models over it are evicted, least recently used first")
    access.add_argument("--model-load-patience", type=float, default=1.0, metavar="SECONDS",
                        help="on_demand: how long a load waits for busy models to go idle when a colder model than "
                             "the one it would evict is busy, or busy models hold the room it needs (default 1)")
    access.add_argument("--rate-limit", choices=("off", "execution_count"), default="off",
                        help="as Triton's: execution_count applies each instance_group's rate_limiter (an instance runs "
                             "only while its resources are free, priority orders the waiting); off (the default) ignores it")
    access.add_argument("--rate-limit-resource", action="append", default=[], metavar="NAME:COUNT[:DEVICE]",
                        help="as Triton's: how many of a rate_limiter resource exist, per device (DEVICE: a GPU index, or "
                             "'global'; none: each device); unnamed resources count the largest ask of any instance")
    access.add_argument("--allow-model-upload", action="store_true",
                        help="explicit mode: let a load carry model files (`file:` parameters), which can run code on this "
                             "server; off by default (needs the admin token when tokens are set)")
    access.add_argument("--allow-shared-memory", action="store_true",
                        help="let clients register system shared-memory regions (maps files from /dev/shm into this "
                             "process); off by default")
    access.add_argument("--allow-client-shm", nargs="?", const=True, default=None, type=_on_off, metavar="true|false",
                        help="Triton's spelling of --allow-shared-memory (`--allow-client-shm=true`), so its scripts run as written")
    access.add_argument("--grpc-restricted-protocol", action="append", default=[], metavar="CATEGORIES:KEY=VALUE",
                        help="as Triton's: gRPC calls in these categories (health, metadata, inference, shared-memory, "
                             "model-config, model-repository, statistics, trace, logging) need the metadata "
                             "triton-grpc-protocol-KEY: VALUE (repeatable, one group per category)")
    access.add_argument("--http-restricted-api", action="append", default=[], metavar="CATEGORIES:KEY=VALUE",
                        help="as Triton's: HTTP calls in these categories need the header KEY: VALUE (repeatable)")
    access.add_argument("--allow-log-settings", action="store_true",
                        help="let clients change what the server logs (LogSettings, POST /v2/logging); off by default")
    access.add_argument("--load-model", action="append", default=[], metavar="NAME",
                        help="explicit mode: load this model at start (repeatable; '*' loads all)")
    access.add_argument("--backend-directory", type=Path, default=None, metavar="DIR",
                        help="Triton's Python-based backends: a config's backend 'NAME' that is none of Ferry's runs "
                             "DIR/NAME/model.py as the model's Python model (runs the code there; default: off)")
    access.add_argument("--allow-trace-settings", action="store_true",
                        help="let clients change the trace settings (TraceSetting, POST /v2/trace/setting); off by default")
    p.add_argument("--record-traffic", type=Path, metavar="FILE",
                   help="append one JSON line per request (model, arrival time, input shapes or prompt and output "
                        "token counts; never the data) for `ferry tune --from-trace FILE`")
    p.add_argument("--log-level", default="INFO")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ferry", description="Ferry inference server")
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    add_client_commands(sub)  # models, health, infer, generate, perf
    add_batch_command(sub)  # batch: a file of requests, in-process, remote or on Ray
    args = parser.parse_args(argv)
    if args.command != "serve":
        raise SystemExit(args.run(args))
    from server.app import ServerConfig, run  # here, so client commands never import torch
    from server.observability.log_settings import LOG_FORMAT
    from server.doors.http.server import WebOptions

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    _check_serve_flags(parser, args)
    tokens = _tokens(parser, args)
    poll_s = _poll_seconds(parser, args)
    config = ServerConfig(
        model_repository=args.model_repository,
        rpc=RpcOptions(args.host, args.grpc_port, args.max_message_bytes, args.max_concurrent_rpcs or None,
                       args.tls_cert, args.tls_key, args.tls_ca),
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        default_max_batch_size=args.default_max_batch_size,
        max_queued_requests=args.max_queued_requests,
        max_queued_bytes=args.max_queued_bytes,
        max_model_queued_bytes=args.max_model_queued_bytes,
        drain_grace_s=args.drain_grace_seconds,
        poll_repository_s=poll_s,
        tokens=tokens,
        metrics_host=args.metrics_host,
        web=None if args.http_port < 0 else WebOptions(args.host, args.http_port,
                                                                     min(args.max_message_bytes, args.http_max_input_size),
                                                                     args.http_header_forward_pattern),
        server_name=args.server_name,
        grpc_header_forward=args.grpc_header_forward_pattern,
        model_control_mode=args.model_control_mode,
        model_memory_budget=_memory_budget(parser, args),
        model_load_patience_s=args.model_load_patience,
        rate_limit=args.rate_limit,
        rate_limit_resources=_rate_limit_resources(parser, args),
        allow_model_upload=args.allow_model_upload,
        allow_shared_memory=args.allow_shared_memory or bool(args.allow_client_shm),
        allow_log_settings=args.allow_log_settings,
        grpc_restricted=_restrictions(parser, "--grpc-restricted-protocol", args.grpc_restricted_protocol),
        http_restricted=_restrictions(parser, "--http-restricted-api", args.http_restricted_api),
        load_models=frozenset(args.load_model),
        frontend_processes=args.frontend_processes,
        event_loop=args.event_loop,
        response_cache_bytes=_cache_bytes(parser, args.cache_config),
        trace=_trace_settings(parser, args.trace_config),
        allow_trace_settings=args.allow_trace_settings,
        backend_directory=args.backend_directory.resolve() if args.backend_directory else None,
        record_traffic=args.record_traffic,
        **({} if args.frontend_arena_bytes is None else {"frontend_arena_bytes": args.frontend_arena_bytes}),
    )
    try:
        status = event_loop.run(run(config), args.event_loop)
    except PortUnavailable as exc:  # one line, as Triton's; nothing is wrong with Ferry (server/doors/ports.py)
        print(exc, file=sys.stderr, flush=True)
        status = 1
    raise SystemExit(status)


def _on_off(value: str) -> bool:
    """A Triton boolean flag's value."""
    if value.lower() in ("true", "1", "on", "yes"):
        return True
    if value.lower() in ("false", "0", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _check_request_flags(parser: argparse.ArgumentParser, args) -> None:
    """Triton's request flags: the HTTP input limit and the header forward patterns."""
    if args.http_max_input_size < 1:
        parser.error(f"--http-max-input-size must be a positive number of bytes, got {args.http_max_input_size}")
    for flag, pattern in (("--grpc-header-forward-pattern", args.grpc_header_forward_pattern),
                          ("--http-header-forward-pattern", args.http_header_forward_pattern)):
        try:
            header_forward(pattern)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    if args.grpc_header_forward_pattern and args.frontend_processes > 1:  # refused, never silently ignored
        parser.error("--grpc-header-forward-pattern is served by the one-process gRPC door only; "
                     "drop it or --frontend-processes")


def _check_serve_flags(parser: argparse.ArgumentParser, args) -> None:
    """Refuse flag combinations that cannot work, before anything starts."""
    if not args.model_repository.is_dir():
        parser.error(f"--model-repository {args.model_repository} is not a folder")
    if args.backend_directory is not None and not args.backend_directory.is_dir():
        parser.error(f"--backend-directory {args.backend_directory} is not a folder")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        parser.error("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
    for flag, value in (("--max-queued-bytes", args.max_queued_bytes), ("--max-model-queued-bytes", args.max_model_queued_bytes)):
        if value is not None and value < 0:
            parser.error(f"{flag} must be 0 (no limit) or a number of bytes, got {value}")
    if args.frontend_processes < 1:
        parser.error(f"--frontend-processes must be 1 or more, got {args.frontend_processes}")
    _check_request_flags(parser, args)
    if args.frontend_arena_bytes is not None and args.frontend_arena_bytes < 0:
        parser.error(f"--frontend-arena-bytes must be 0 (always inline) or a number of bytes, got {args.frontend_arena_bytes}")
    try:
        event_loop.loop_factory(args.event_loop)
    except event_loop.EventLoopUnavailable as exc:
        parser.error(str(exc))
    if args.allow_model_upload and args.model_control_mode != "explicit":
        parser.error("--allow-model-upload lets loads carry model files: it needs --model-control-mode explicit")
    if args.load_model and args.model_control_mode != "explicit":
        parser.error("--load-model needs --model-control-mode explicit (the other modes load every model)")


def _memory_budget(parser: argparse.ArgumentParser, args) -> tuple[tuple[str, int], ...]:
    from server.repository.residency import parse_budget

    if args.model_memory_budget and args.model_control_mode != "on_demand":
        parser.error("--model-memory-budget needs --model-control-mode on_demand (the other modes load what they are told)")
    if args.model_control_mode == "on_demand" and args.frontend_processes > 1:
        parser.error("--model-control-mode on_demand serves from one process: it does not work with --frontend-processes yet")
    if args.model_load_patience < 0:
        parser.error("--model-load-patience: seconds, 0 or more")
    try:
        return tuple(sorted(parse_budget(args.model_memory_budget).items()))
    except ValueError as exc:
        parser.error(f"--model-memory-budget: {exc}")


def _rate_limit_resources(parser: argparse.ArgumentParser, args) -> tuple:
    from server.scheduling.rate_limiter import parse_resource

    if args.rate_limit_resource and args.rate_limit != "execution_count":
        parser.error("--rate-limit-resource needs --rate-limit execution_count")
    try:
        return tuple(parse_resource(text) for text in args.rate_limit_resource)
    except ValueError as exc:
        parser.error(f"--rate-limit-resource: {exc}")


def _cache_bytes(parser: argparse.ArgumentParser, values: list[str]) -> int:
    """The size `--cache-config local,size=BYTES` asks for (0: no cache). Triton's syntax; `local` (in
    this process's memory) is the one implementation Ferry has."""
    size = 0
    for value in values:
        implementation, _, settings = value.partition(",")
        if implementation != "local":
            parser.error(f"--cache-config {value}: the cache implementation must be 'local' (the one Ferry has), "
                         f"got '{implementation}'")
        for setting in filter(None, settings.split(",")):
            key, _, number = setting.partition("=")
            if key != "size" or not number.isdigit() or int(number) <= 0:
                parser.error(f"--cache-config {value}: expected size=BYTES (a whole number above 0), got '{setting}'")
            size = int(number)
    if values and not size:
        parser.error("--cache-config local needs a size: --cache-config local,size=BYTES")
    return size


def _trace_settings(parser: argparse.ArgumentParser, values: list[str]):
    from server.observability.tracing.settings import from_flags

    try:
        settings = from_flags(values)
    except ValueError as exc:
        parser.error(str(exc))
    if settings.mode == "opentelemetry":
        try:
            import server.observability.tracing.otel  # noqa: F401 - the SDK and the OTLP exporter, checked before anything starts
        except ImportError as exc:
            parser.error(f"--trace-config mode=opentelemetry needs the OpenTelemetry SDK and OTLP/HTTP exporter "
                         f"(pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http): {exc}")
    return settings


def _restrictions(parser: argparse.ArgumentParser, flag: str, values: list[str]) -> tuple:
    from server.doors.access import parse_restriction, restriction_table

    try:
        groups = tuple(parse_restriction(value) for value in values)
        restriction_table(list(groups))  # refuses a category named in two groups
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")
    return groups


def _tokens(parser: argparse.ArgumentParser, args) -> Tokens:
    try:
        tokens = Tokens(read_tokens(args.auth_token_file, os.environ.get("FERRY_AUTH_TOKEN")),
                        read_tokens(args.admin_token_file, os.environ.get("FERRY_ADMIN_TOKEN")))
    except OSError as exc:
        parser.error(f"cannot read a token file: {exc}")
    for flag, path in (("--auth-token-file", args.auth_token_file), ("--admin-token-file", args.admin_token_file)):
        if path is not None and not read_tokens(path, None):
            parser.error(f"{flag} {path} holds no token")
    return tokens


def _poll_seconds(parser: argparse.ArgumentParser, args) -> float:
    poll_s = args.poll_repository_seconds
    if args.model_control_mode == "poll":
        return poll_s or 15.0  # Triton's --repository-poll-secs default
    if poll_s:
        parser.error("--poll-repository-seconds reloads what changes in the repository: it needs "
                     "--model-control-mode poll")
    return poll_s

if __name__ == "__main__":
    main()
