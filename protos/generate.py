"""Regenerate Ferry's protobuf/gRPC Python modules from protos/*.proto.

This script is the only way generated code is produced. The output is
committed so that consumers and the Docker image need no grpcio-tools;
tests/unit/test_protos_in_sync.py regenerates into a temp dir and fails on
any drift.

    python protos/generate.py            # write into protos/
    python protos/generate.py --out DIR  # write into DIR/protos/
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos"


def generate(out: Path) -> int:
    """Run protoc on every protos/*.proto, writing modules under out/protos/."""
    out.mkdir(parents=True, exist_ok=True)
    wellknown = resources.files("grpc_tools") / "_proto"
    # Paths relative to the repo root, so generated code imports
    # "from protos import model_config_pb2".
    protos = sorted(p.relative_to(REPO_ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"-I{wellknown}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    return protoc.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="root to write into; files land in OUT/protos/ (default: repo root)",
    )
    args = parser.parse_args(argv)
    rc = generate(args.out.resolve())
    if rc != 0:
        print(f"protoc failed with exit code {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
