"""The drain of ``ouro-jax serve`` (a subprocess): on SIGTERM the socket stays open, new requests and
``/health`` are answered 503 with ``Retry-After``, the stream in flight finishes, and the process
exits 0; past ``--drain-timeout-s`` the stream ends with finish_reason ``abort`` (still exit 0); a
second signal aborts at once (exit 128 + signal)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from tests.server.conftest import ServeProcess, free_port, write_checkpoint  # noqa: E402
from tests.server.test_server_cli import FLAGS, ROOT  # noqa: E402

# a longer context than the other HTTP tests: a stream of a few hundred tokens takes seconds on a CPU
LONG = ["--max-model-len", "256"]
STREAM = dict(model="m", prompt=[5, 6], temperature=0, stream=True, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt_drain"))


def _serve(folder, *flags) -> ServeProcess:
    # the session's compile cache (tests/conftest.py) reaches the child through the environment
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    port = free_port()
    cmd = [sys.executable, "-m", "ouro_jax.cli", "serve", folder, "--port", str(port), "--served-model-name", "m"]
    return ServeProcess(cmd + FLAGS + LONG + list(flags), env, port, timeout=180)


class _Stream(threading.Thread):
    """One streaming completion read in a thread; ``first`` is set at its first token."""

    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.body = url, dict(STREAM, max_tokens=max_tokens)
        self.first = threading.Event()
        self.ids: list[int] = []
        self.lines: list[str] = []
        self.finish_reason = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line:
                        continue
                    self.lines.append(line)
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        self.ids += choice["token_ids"]
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
                        if self.ids:
                            self.first.set()
        finally:
            self.first.set()


@pytest.mark.slow
def test_sigterm_keeps_answering_503_while_the_stream_in_flight_finishes(folder):
    server = _serve(folder)
    try:
        stream = _Stream(server.url, max_tokens=240)
        assert stream.first.wait(60) and stream.ids
        server.proc.send_signal(signal.SIGTERM)
        # the socket stays open: a new request and /health are answered 503 (not refused)
        r = httpx.post(server.url + "/v1/completions", json=dict(STREAM, max_tokens=4, stream=False), timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        assert stream.is_alive(), "the stream ended before the 503s were checked: make it longer"
        stream.join(60)
        assert stream.lines[-1] == "data: [DONE]" and len(stream.ids) == 240 and stream.finish_reason == "length"
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.close()
    assert "drain: started" in server.text and "drain: ended (done)" in server.text, server.text
    assert "1 requests finished, 0 aborted" in server.text, server.text


def test_drain_timeout_aborts_the_stream_and_exits_0(folder):
    server = _serve(folder, "--drain-timeout-s", "0.5")
    try:
        stream = _Stream(server.url, max_tokens=250)
        assert stream.first.wait(60) and stream.ids
        server.proc.send_signal(signal.SIGTERM)
        stream.join(60)
        assert stream.finish_reason == "abort" and stream.lines[-1] == "data: [DONE]"
        assert 0 < len(stream.ids) < 250
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.close()
    assert "drain: ended (timeout of 0.5 s)" in server.text and "0 requests finished, 1 aborted" in server.text


@pytest.mark.slow
def test_second_signal_aborts_at_once(folder):
    server = _serve(folder)
    try:
        stream = _Stream(server.url, max_tokens=250)
        assert stream.first.wait(60) and stream.ids
        server.proc.send_signal(signal.SIGTERM)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503  # the drain has begun
        server.proc.send_signal(signal.SIGINT)
        stream.join(60)
        assert stream.finish_reason == "abort" and len(stream.ids) < 250
        assert server.proc.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        server.close()
    assert "drain: ended (second signal (SIGINT))" in server.text, server.text


class _Engine:
    """What the drain reads of an engine: ``pending``, ``stop``."""

    def __init__(self, pending: int):
        self.pending, self.stopped = pending, None

    def stop(self, drain: bool = True) -> None:
        self.stopped = drain


class _Task:
    def __init__(self, done: bool):
        self._done = done

    def done(self) -> bool:
        return self._done


def _drain_server(pending: int, tasks, timeout: float = 30.0):
    import uvicorn

    from ouro_jax.server.app import ServerState
    from ouro_jax.server.run import _Server

    state = ServerState(llm=None, engine=_Engine(pending), model_name="m")
    server = _Server(uvicorn.Config(lambda scope, receive, send: None), state, drain_timeout_s=timeout)
    server.server_state.tasks.update(tasks)
    return server, state


def test_drain_waits_for_the_requests_in_flight_then_for_the_engine():
    slow = _Task(False)
    server, state = _drain_server(1, [slow, _Task(True)])
    server.handle_exit(signal.SIGTERM, None)
    assert state.draining and not server._drain_ended()
    server.server_state.tasks.add(_Task(False))  # a request after the start (answered 503): not waited for
    slow._done = True
    assert not server._drain_ended()  # the engine still holds one (e.g. an abort not yet applied)
    state.engine.pending = 0
    assert server._drain_ended() and state.engine.stopped is None
    assert server.drain_result["reason"] == "done" and server.drain_result["finished"] == 2
    assert server.forced_by is None


def test_drain_timeout_and_second_signal_abort_what_is_left():
    server, state = _drain_server(2, [_Task(False), _Task(True)], timeout=0.5)
    server.request_drain()
    assert not server._drain_ended()
    server.drain_asked -= 1.0  # the drain began a second ago
    assert server._drain_ended() and state.engine.stopped is False
    assert server.drain_result == dict(finished=1, aborted=1, seconds=server.drain_result["seconds"],
                                       reason="timeout of 0.5 s")  # fmt: skip
    server, state = _drain_server(1, [_Task(False)])
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGINT, None)
    assert server._drain_ended() and state.engine.stopped is False and server.forced_by == signal.SIGINT
    assert server.drain_result["reason"] == "second signal (SIGINT)"
