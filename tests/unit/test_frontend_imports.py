"""A front-end process stays light: it starts in a fresh interpreter without runners, backends or torch
(N of them run beside the engine; each would otherwise carry the engine's imports and memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "onnxruntime", "transformers", "server.runners", "server.repository", "server.backends")


def test_front_end_process_imports_nothing_of_the_engine():
    code = ("import sys, server.doors.processes.process; "
            f"print([m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith({HEAVY!r})])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
