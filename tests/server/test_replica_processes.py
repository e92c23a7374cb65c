"""Data-parallel replicas as worker processes (ouro_jax/server/replica_process.py).

Two ``tiny`` workers (spawned, CPU) behind a ``ReplicaSet``, driven the way the HTTP handlers drive
it (``try_reserve`` / ``submit`` / events in an asyncio queue / ``abort``): the tokens, exit depths and
finish reasons equal one in-process engine's, the load spreads over both workers, shared prefixes go
to the worker that caches them, aborts reach the worker holding the request. Then the failures: a
worker killed mid-request (an error event, ``/health`` 503), a worker that fails to start, shutdown
leaving no child process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.server.conftest import DP_ENGINE as ENGINE

pytestmark = pytest.mark.slow  # every test here starts worker processes (jax import + compile each)


@pytest.fixture(scope="module")
def worker_env():
    """The workers inherit the environment, not this process's jax.config: exact matmuls for them too."""
    old = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION")
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    yield
    if old is None:
        os.environ.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
    else:
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = old


@pytest.fixture(scope="module")
def replicas(worker_env):
    from ouro_jax.server.replica_process import start_replica_processes
    from ouro_jax.server.replicas import ReplicaSet

    front, reps, timings = start_replica_processes("tiny", ENGINE, 2, max_queue=16, log_level="warning")
    rs = ReplicaSet(reps, prefix_slack=2).start()
    routed: list = []
    rs.on_route = lambda i, reason: routed.append((i, reason))
    rs.routed = routed
    yield rs, front, timings
    rs.shutdown(drain=True, timeout=60)
    assert [r.process.exitcode for r in reps] == [0, 0]  # a clean, drained exit
    assert not any(r.process.is_alive() for r in reps)


def _run(rs, requests, abort_after_submit=()):
    """Submit ``(rid, prompt_ids, SamplingParams)`` at once; ``{rid: (token_ids, exit_depths,
    finish_reason, replica index, error)}`` once every one finished."""

    async def main():
        q: asyncio.Queue = asyncio.Queue()
        assert rs.try_reserve(len(requests))
        held = {}
        for k, (rid, ids, sp) in enumerate(requests):
            held[rid] = rs.submit(rid, ids, sp, q, k)
            if rid in abort_after_submit:
                held[rid].abort(rid)
        got = {rid: ([], [], None, held[rid].index, None) for rid, _, _ in requests}
        done = 0
        while done < len(requests):
            ev = await asyncio.wait_for(q.get(), 60)
            rid = requests[ev.index][0]
            ids, depths, _, rep, _ = got[rid]
            got[rid] = (ids + ev.token_ids, depths + ev.exit_depths, ev.finish_reason, rep, ev.error)
            done += ev.finished
        return got

    return asyncio.run(main())


def _idle(rs, timeout=30.0):
    """Until every worker reported its state after its last request finished."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rs.pending == 0 and all(r.state["running"] == 0 and r.state["waiting"] == 0 for r in rs.replicas):
            return
        time.sleep(0.02)
    raise AssertionError([r.state for r in rs.replicas])


def test_process_replicas_answer_as_one_engine(replicas):
    """Greedy and seeded sampling, early exit and fixed depth, EOS allowed or not: the same tokens,
    depths and finish reasons as one in-process engine, with both workers serving."""
    import numpy as np

    from ouro_jax import LLM, SamplingParams

    rs, front, timings = replicas
    assert len(timings["replicas"]) == 2 and len(set(timings["pids"])) == 2 and os.getpid() not in timings["pids"]
    assert front.scheduler_config.num_blocks == rs.replicas[0].info["scheduler_config"].num_blocks
    rng = np.random.default_rng(5)
    reqs = []
    for k in range(12):
        ids = list(map(int, rng.integers(5, 128, int(rng.integers(2, 14)))))
        sp = SamplingParams(
            max_tokens=int(rng.integers(3, 9)),
            temperature=0.0 if k % 2 == 0 else 0.8,
            top_p=1.0 if k % 3 else 0.9,
            seed=100 + k,
            exit_threshold=float(rng.choice([0.5, 1.0])),
            ignore_eos=k % 4 != 1,
        )
        reqs.append((f"r{k}", ids, sp))
    admitted = [r.stats.get("admissions", 0) for r in rs.replicas]
    got = _run(rs, reqs)
    ref = LLM("tiny", progress=False, **ENGINE)
    want = ref.generate([ids for _, ids, _ in reqs], [sp for _, _, sp in reqs], use_tqdm=False)
    for (rid, _, _), w in zip(reqs, want):
        ids, depths, reason, _, err = got[rid]
        assert err is None
        assert (ids, depths, reason) == (list(w.token_ids), list(w.exit_depths), w.finish_reason), rid
    reps = [got[rid][3] for rid, _, _ in reqs]
    assert sorted(set(reps)) == [0, 1] and abs(reps.count(0) - reps.count(1)) <= 2, reps  # least loaded
    _idle(rs)
    served = [r.stats["admissions"] - a for r, a in zip(rs.replicas, admitted)]
    assert served == [reps.count(0), reps.count(1)]  # each worker ran what the front routed to it
    assert all(r.state["kv_usage"] == 0.0 and r.alive for r in rs.replicas)


def test_prefix_routing_follows_the_worker_cache(replicas):
    """A prompt sharing three blocks with one that ran goes to its worker (the front's mirror of that
    worker's prefix cache says so), four times, and reuses the cached blocks there."""
    from scheduler import SamplingParams

    rs, front, _ = replicas
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    shared = list(range(30, 42))  # 3 blocks of 4
    first = _run(rs, [("p0", shared + [7, 8], sp)])
    holder = first["p0"][3]
    hashes = front.scheduler.prefix_hashes(shared + [7, 8])
    _idle(rs)
    rs.router._routed.clear()  # forget what was routed: only the mirrored cache can say where it is
    assert [r.cached_prefix_blocks(hashes) for r in rs.replicas] == [3 if i == holder else 0 for i in range(2)]
    hits = [r.stats["prefix_cache_hit_tokens"] for r in rs.replicas]
    n = len(rs.routed)
    # one at a time: the holder is never more than prefix_slack busier than the other
    for k in range(4):
        got = _run(rs, [(f"p{k + 1}", shared + [9 + k, 10, 11], sp)])
        assert got[f"p{k + 1}"][3] == holder
    assert rs.routed[n:] == [(holder, "prefix")] * 4
    _idle(rs)
    gained = [r.stats["prefix_cache_hit_tokens"] - h for r, h in zip(rs.replicas, hits)]
    assert gained[holder] == 4 * 12 and gained[1 - holder] == 0


def test_abort_reaches_the_worker_holding_the_request(replicas):
    from scheduler import SamplingParams

    rs, _, _ = replicas
    _idle(rs)
    aborted = [r.stats["aborted"] for r in rs.replicas]
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    got = _run(rs, [("a0", [5, 6], long), ("a1", [7, 8], long)], abort_after_submit={"a1"})
    assert got["a0"][2] == "length" and len(got["a0"][0]) == 60
    assert got["a1"][2] == "abort" and len(got["a1"][0]) < 60
    holder = got["a1"][3]
    assert got["a0"][3] != holder  # least loaded: one each
    _idle(rs)
    gained = [r.stats["aborted"] - a for r, a in zip(rs.replicas, aborted)]
    assert gained == [1 if i == holder else 0 for i in range(2)]
    assert rs.pending == 0 and all(r.pending == 0 for r in rs.replicas)


def test_killed_worker_fails_its_requests_and_health(worker_env):
    """SIGKILL of the worker mid-stream: the stream ends with an error, /health answers 503, new
    requests 503, and the front's shutdown still returns."""
    import httpx

    from ouro_jax.server.replica_process import start_replica_processes
    from ouro_jax.server.run import BackgroundServer, make_state

    front, reps, timings = start_replica_processes("tiny", ENGINE, 1, max_queue=4, log_level="warning")
    state = make_state(front, "m", max_queue=4, startup=timings, replicas=reps)
    srv = BackgroundServer(state).start()
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        body = dict(model="m", prompt=[5, 6], max_tokens=60, temperature=0, stream=True, ignore_eos=True)
        lines = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            for line in it:
                if line.startswith("data: {"):
                    os.kill(reps[0].pid, signal.SIGKILL)
                    break
            lines = [ln for ln in it if ln]
        assert any('"error"' in ln and "replica 0 exited unexpectedly" in ln for ln in lines), lines
        assert lines[-1] == "data: [DONE]"
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json=dict(body, stream=False), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert state.engine.pending == 0
    finally:
        srv.stop(timeout=30)
    assert reps[0].process.exitcode == -signal.SIGKILL


def test_a_worker_that_fails_to_start_stops_the_others(worker_env):
    """A setting only the engine checks (a KV pool too small for one request): the worker's own
    ValueError, with its replica's index, and no worker left running."""
    import multiprocessing

    from ouro_jax.server.replica_process import start_replica_processes

    before = set(multiprocessing.active_children())  # the module's two workers may still run
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"replica \d failed to start: ValueError: the KV pool \(2 blocks"):
        start_replica_processes("tiny", dict(ENGINE, num_blocks=2), 2, log_level="critical")
    assert set(multiprocessing.active_children()) <= before
    assert time.perf_counter() - t < 60
