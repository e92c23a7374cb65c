"""A ``ouro-jax serve`` subprocess for the CLI tests: a free port, the process with its output collected
in a thread, and a wait for ``/health`` that fails with the server's log if it dies or never answers."""

from __future__ import annotations

import socket
import subprocess
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, cmd: list[str], env: dict, port: int, timeout: float):
        import httpx

        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.reader = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.text
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start:\n" + self.text
            time.sleep(0.2)

    @property
    def text(self) -> str:
        return "".join(self.log)

    def close(self) -> None:
        """Kill the process if it still runs, and wait for its output."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.reader.join(10)
