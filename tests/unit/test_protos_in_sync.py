"""The committed generated protobuf/gRPC modules must match protos/*.proto."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools not installed (pip install -e .[dev])")

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTOS = REPO_ROOT / "protos"
GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
FIX = "run `python protos/generate.py` and commit the result"


def _generated(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for pattern in GENERATED for p in directory.glob(pattern)}


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(PROTOS / "generate.py"), "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"protos/generate.py failed:\n{result.stdout}{result.stderr}"

    fresh = _generated(tmp_path / "protos")
    committed = _generated(PROTOS)
    assert fresh, "protos/generate.py produced no files"

    missing = sorted(fresh.keys() - committed.keys())
    extra = sorted(committed.keys() - fresh.keys())
    assert not missing, f"generated files {missing} are not committed; {FIX}"
    assert not extra, f"generated files {extra} come from no .proto; delete them, then {FIX}"

    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"{stale} are out of date with protos/*.proto; {FIX}"
