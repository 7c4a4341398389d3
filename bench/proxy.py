"""HAProxy in front of Ferry replicas, run from deploy/haproxy/haproxy.cfg unchanged (the addresses
come in through its environment variables), listening on a unix socket so no port is guessed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "haproxy" / "haproxy.cfg"
REPLICAS = 3  # the servers the config names


class Proxy:
    """`target` is the gRPC target clients dial (unix:PATH)."""

    def __init__(self, replicas: list[str], folder: Path, timeout_s: float = 30):
        if len(replicas) > REPLICAS:
            raise ValueError(f"{CONFIG} names {REPLICAS} servers; got {len(replicas)} replicas")
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        self.socket = Path(folder) / "proxy.sock"
        # Fewer replicas than servers: the spare entries repeat the last address (same backend, same share).
        padded = replicas + [replicas[-1]] * (REPLICAS - len(replicas))
        env = {**os.environ, "FERRY_PROXY_BIND": f"unix@{self.socket}",
               **{f"FERRY_REPLICA_{i + 1}": a for i, a in enumerate(padded)}}
        check = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected {CONFIG}:\n{check.stdout}{check.stderr}")
        self.proc = subprocess.Popen([haproxy, "-db", "-f", str(CONFIG)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self._wait_listening(timeout_s)
        self.target = f"unix:{self.socket}"

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.proc.stderr.read()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.socket))
                return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("haproxy never listened")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
