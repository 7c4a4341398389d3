"""Throughput with 1, 2 and 3 Ferry replicas on this machine, reached through HAProxy (deploy/haproxy)
and through client-side balancing (clients/balancing.py), in one run; appends a table to RESULTS.md.

`python -m bench.replicas [--seconds 5] [--concurrency 32]`. Every replica shares this machine's cores
with the others, the proxy and the load generator, so the figures show what each path costs and how
calls are spread, not how a cluster of separate machines scales (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
from pathlib import Path

import grpc
import numpy as np

from bench.common import ROOT, append_results, ferry_command, infer_payload, model_counts, start_server, table
from bench.proxy import Proxy
from clients import balancing, loadgen

MODEL = "simple"


def payloads() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [infer_payload(MODEL, {"INPUT0": rng.standard_normal((1, 16)).astype(np.float32),
                                  "INPUT1": rng.standard_normal((1, 16)).astype(np.float32)}) for _ in range(16)]


def served(addresses: list[str]) -> list[int]:
    counts = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            counts.append(model_counts(channel, MODEL)[0])
    return counts


def measure(path: str, target: str, options: list, addresses: list[str], args) -> dict:
    before = served(addresses)
    result = asyncio.run(loadgen.closed_loop(target, payloads(), args.concurrency, duration_s=args.seconds,
                                             warmup=50, channel_options=options))
    shares = [b - a for a, b in zip(before, served(addresses))]
    return {"replicas": len(addresses), "path": path, "concurrency": args.concurrency,
            **{k: v for k, v in result.summary().items() if k in ("throughput_rps", "p50_ms", "p99_ms", "errors")},
            "per_replica_served": "/".join(str(s) for s in shares)}


def run(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        repo.mkdir()
        (repo / MODEL).symlink_to(ROOT / "model_repository" / MODEL)
        for count in (1, 2, 3):
            procs = [start_server(ferry_command(repo)) for _ in range(count)]
            addresses = [address for _, address in procs]
            try:
                proxy = Proxy(addresses, Path(folder))
                retry = [("grpc.service_config", balancing.service_config(balanced=False)), ("grpc.enable_retries", 1)]
                rows.append(measure("haproxy", proxy.target, retry, addresses, args))
                proxy.stop()
                target = balancing.parse(",".join(addresses))
                rows.append(measure("client round_robin", target.target, target.channel_options(), addresses, args))
            finally:
                for proc, _ in procs:
                    proc.terminate()
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    rows = run(args)
    columns = ["replicas", "path", "concurrency", "throughput_rps", "p50_ms", "p99_ms", "errors", "per_replica_served"]
    body = table(rows, columns)
    print(body)
    append_results("Replicas: HAProxy vs client-side balancing (bench/replicas.py)",
                   f"Model `{MODEL}`, closed loop, {args.concurrency} callers, {args.seconds:g} s per point, "
                   f"every replica, the proxy and the load generator on this one machine.\n\n{body}\n")


if __name__ == "__main__":
    main()
