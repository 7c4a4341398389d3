"""The layering the architecture promises, checked: pure policies, and model kinds chosen only by the factory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scheduling_imports_neither_torch_grpc_protobuf_nor_asyncio():
    modules = sorted(f"server.scheduling.{p.stem}" for p in (ROOT / "server" / "scheduling").glob("*.py") if p.stem != "__init__")
    assert "server.scheduling.continuous" in modules and "server.scheduling.dynamic" in modules
    probe = "import sys\n" + "".join(f"import {m}\n" for m in modules) + (
        "print(' '.join(sorted(m for m in ('torch', 'grpc', 'google.protobuf', 'asyncio') if m in sys.modules)))")
    found = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == ""


def _sources(*folders: str) -> dict[Path, str]:
    return {p: p.read_text() for folder in folders for p in (ROOT / "server" / folder).rglob("*.py")}


def test_front_doors_and_registry_never_branch_on_backend_names_or_runner_classes():
    sources = _sources("doors/grpc", "repository")
    assert len(sources) > 8
    runner_classes = "|".join(("ModelRunner", "GenerationRunner", "RunnerBase", "LLMBackend"))
    for path, text in sources.items():
        assert not re.search(r"""["']llm["']""", text), f"{path.name} names the llm backend"
        assert not re.search(rf"isinstance\([^)]*({runner_classes})", text), f"{path.name} checks a runner's class"
        assert not re.search(rf"\b({runner_classes})\b", text), f"{path.name} knows a concrete runner or backend"
        assert ".backend." not in text and "runner.backend" not in text, f"{path.name} reaches into a runner's backend"


def test_the_registry_imports_no_runner_worker_scheduler_or_metrics_class():
    text = (ROOT / "server" / "repository" / "registry.py").read_text()
    runtime = text.split("if TYPE_CHECKING:")[0]  # type-only imports name the protocol, nothing else
    for module in ("server.runners", "server.worker", "server.scheduling", "server.observability.metrics", "server.observability.generation_metrics"):
        assert f"from {module}" not in runtime and f"import {module}" not in runtime, module


def test_batch_reaches_the_http_door_only_through_its_app():
    """`ferry batch` must answer with the HTTP API's own translation: it may build the door's app, or use the
    door's gRPC upstream (the door's readers and encoders around a gRPC call), never encode answers itself or
    call runners or handlers around it."""
    sources = _sources("batch")
    assert len(sources) >= 8
    for path, text in sources.items():
        imports = re.findall(r"^\s*(?:from|import) (server\.[\w.]+)", text, re.M)
        for module in imports:
            assert not module.startswith(("server.runners", "server.doors.shared", "server.doors.grpc")), f"{path.name}: {module}"
            assert not module.startswith("server.doors.http") or module in (
                "server.doors.http.server", "server.doors.http.grpc_upstream"), f"{path.name}: {module}"
    assert "build_app" in (ROOT / "server" / "batch" / "local.py").read_text()


def test_only_the_wiring_and_offline_batch_know_the_doors():
    """The ways in live in server/doors/: nothing below them imports a door (wire formats, access,
    model control stay there); only the process wiring and `ferry batch` (which drives the HTTP door's
    app) reach in."""
    allowed = {ROOT / "server" / name for name in ("app.py", "__main__.py", "engine.py")}
    for path in (ROOT / "server").rglob("*.py"):
        if path in allowed or (ROOT / "server" / "doors") in path.parents or (ROOT / "server" / "batch") in path.parents:
            continue
        imports = re.findall(r"^\s*(?:from|import) (server\.doors[\w.]*)", path.read_text(), re.M)
        assert not imports, f"{path.relative_to(ROOT)} imports {imports}"


def test_the_top_floor_holds_wiring_records_and_the_request_path_only():
    """Every other module lives in a room named for what it owns (docs/architecture.md)."""
    top = {p.name for p in (ROOT / "server").glob("*.py")}
    assert top == {"__init__.py", "__main__.py", "app.py", "engine.py", "event_loop.py", "defaults.py", "heap.py",
                   "errors.py", "names.py", "request.py", "worker.py", "response_cache.py", "config_json.py"}, top
