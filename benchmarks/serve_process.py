"""``ouro-jax serve`` as a child process on a free loopback port: what the HTTP benchmarks
(``serve_bench``, ``soak``) run against, so that the server holds its own device memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["ServeProcess"]


class ServeProcess:
    """``ouro-jax serve MODEL FLAGS`` on ``127.0.0.1:<free port>`` named ``model_name``; its output
    goes to ``log_path`` (default: this process's)."""

    def __init__(self, model: str, flags: list[str], model_name: str, log_path: Optional[str] = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "ouro_jax.cli", "serve", model, *flags]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", model_name, "--no-access-log"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = None
        if log_path is not None:
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
            self.log = open(log_path, "w")
        out = dict(stdout=self.log, stderr=subprocess.STDOUT) if self.log is not None else {}
        self.proc = subprocess.Popen(cmd, env=env, **out)
        self.url = f"http://127.0.0.1:{port}"

    def _where(self) -> str:
        return f" (log: {self.log.name})" if self.log is not None else ""

    def wait_ready(self, timeout: float) -> None:
        """Until ``/health`` answers 200; ``RuntimeError`` if the server exits or ``timeout`` passes."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}{self._where()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {timeout} s{self._where()}")

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM (the server drains), killed if it has not exited within ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._close_log()

    def _close_log(self) -> None:
        if self.log is not None and not self.log.closed:
            self.log.close()
