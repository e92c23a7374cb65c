"""Data-parallel replicas behind one HTTP front (ouro_jax/server/replicas.py).

Fast: the router's decisions on made-up loads, validation, ``LLM(devices=...)`` errors, the prefix
hashes the router compares. Slow: this file run as a script in a fresh interpreter with two host
devices (``--xla_force_host_platform_device_count`` must be set before JAX starts): a DP=2 server
(thread mode) over real HTTP with the openai client, and ``ouro-jax serve --data-parallel-size 2``
(worker processes, the default) drained by SIGTERM. tests/server/test_replica_processes.py tests the
worker processes in depth.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.server.conftest import DP_ENGINE, ServeProcess, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = [
    "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--prefill-chunk-size", "8", "--block-size", "4",
    "--max-model-len", "64", "--buckets", "16", "--fused-decode-max-rows", "0",
]  # fmt: skip


def _env(devices: int = 2) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_cpu_multi_thread_eigen=false"
    return env


# ------------------------------------------------------------------------------ router
def test_router_least_loaded_round_robin():
    from ouro_jax.server.replicas import Router

    r = Router(3, prefix_slack=2)
    none = [0, 0, 0]
    # equal loads: round robin
    assert [r.choose([0, 0, 0], none, [True] * 3)[0] for _ in range(4)] == [0, 1, 2, 0]
    assert r.choose([5, 1, 3], none, [True] * 3) == (1, "least_loaded")
    assert r.choose([5, 1, 3], none, [True, False, True]) == (2, "least_loaded")  # full replicas are skipped
    assert r.choose([5, 1, 3], none, [False] * 3) == (None, None)


def test_router_prefix_holder_unless_overloaded():
    from ouro_jax.server.replicas import Router

    r = Router(3, prefix_slack=2)
    room = [True] * 3
    assert r.choose([3, 1, 1], [2, 0, 5], room) == (2, "prefix")  # the longest match wins
    assert r.choose([3, 1, 1], [4, 0, 0], room) == (0, "prefix")  # 3 <= 1 + 2
    assert r.choose([4, 1, 2], [4, 0, 0], room) == (1, "least_loaded")  # 4 > 1 + 2: overloaded
    assert r.choose([0, 2, 1], [3, 3, 0], room) == (0, "prefix")  # two holders: the less loaded
    assert r.choose([3, 0, 0], [5, 0, 0], [False, True, True])[1] == "least_loaded"  # a full holder
    # the memory of routed prompts: the longest chain each replica got last
    r.remember([b"a", b"b", b"c"], 1)
    r.remember([b"a", b"x"], 2)
    assert r.remembered([b"a", b"b", b"c", b"d"]) == [0, 3, 1]
    assert r.remembered([b"z", b"a"]) == [0, 0, 0]  # a chain: nothing after a miss counts
    small = Router(2, 0, memory=2)
    small.remember([b"a", b"b", b"c"], 0)
    assert small.remembered([b"a"]) == [0, 0] and small.remembered([b"b"]) == [1, 0]  # oldest dropped
    with pytest.raises(ValueError):
        Router(0, 1)


def test_replica_set_reserves_routes_and_releases():
    """Places are reserved over all replicas, each request then takes one on the replica it is routed
    to; a failed submit leaves its place reserved for the caller to release (no double count)."""
    from types import SimpleNamespace

    from ouro_jax.server.engine_loop import EngineDead, EngineLoop
    from ouro_jax.server.replicas import ReplicaSet

    llm = SimpleNamespace(scheduler_config=SimpleNamespace(enable_prefix_caching=False, max_num_seqs=2))
    loops = [EngineLoop(llm, 2) for _ in range(2)]  # never started: submit raises EngineDead
    rs = ReplicaSet(loops)
    routed = []
    rs.on_route = lambda i, reason: routed.append((i, reason))
    assert rs.max_pending == 4 and not rs.alive
    assert rs.try_reserve(3) and not rs.try_reserve(2) and rs.pending == 3
    with pytest.raises(EngineDead):
        rs.submit("a", [1], None, None, 0)
    assert rs.pending == 3 and [x.pending for x in loops] == [0, 0] and routed == []
    rs.release(3)
    assert rs.pending == 0
    for x in loops:  # an engine that accepts everything
        x.submit = lambda *a, x=x: x
    assert rs.try_reserve(4) and not rs.try_reserve(1)  # 429: no replica has room
    took = [rs.submit(f"r{k}", [1], None, None, 0) for k in range(4)]
    order = [loops.index(t) for t in took]
    assert order in ([0, 1, 0, 1], [1, 0, 1, 0]) and [x.pending for x in loops] == [2, 2]  # least loaded
    assert routed == [(i, "least_loaded") for i in order] and rs.pending == 4


def test_a_later_choice_goes_to_its_siblings_replica():
    """``n`` choices of one prompt share its blocks only on one replica: a later choice is routed
    where the first went while that replica has room, else as any request."""
    from types import SimpleNamespace

    from ouro_jax.server.engine_loop import EngineLoop
    from ouro_jax.server.replicas import ReplicaSet

    llm = SimpleNamespace(scheduler_config=SimpleNamespace(enable_prefix_caching=False, max_num_seqs=2))
    loops = [EngineLoop(llm, 2) for _ in range(2)]
    rs = ReplicaSet(loops)
    routed = []
    rs.on_route = lambda i, reason: routed.append((i, reason))
    for x in loops:  # an engine that accepts everything
        x.submit = lambda *a, x=x: x
    assert rs.try_reserve(4)
    first = rs.submit("c0", [1], None, None, 0)
    j = loops.index(first)
    assert rs.submit("c1", [1], None, None, 1, "c0", first) is first  # not the least loaded: its sibling's
    assert loops[j].pending == 2 and routed[1] == (j, "sibling")
    assert rs.submit("c2", [1], None, None, 2, "c0", first) is loops[1 - j]  # full: routed as any
    assert routed[2] == (1 - j, "least_loaded")


def test_data_parallel_size_is_validated():
    from ouro_jax.server.replicas import check_data_parallel, replica_devices

    assert check_data_parallel(2, 2, num_devices=4) == 2
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
            check_data_parallel(bad, 1, num_devices=4)
    with pytest.raises(
        ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 devices, but jax sees 3"
    ):
        check_data_parallel(2, 2, num_devices=3)
    with pytest.raises(ValueError, match="needs 2 devices"):
        replica_devices(2, 1)  # this process has one device
    devs = list("abcdef")  # any sequence: replica i takes the i-th slice
    assert replica_devices(3, 2, devices=devs) == [["a", "b"], ["c", "d"], ["e", "f"]]


def test_llm_devices_are_validated_before_loading(monkeypatch):
    import jax

    from ouro_jax import LLM

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the check")

    monkeypatch.setattr(LLM, "_load", staticmethod(boom))
    d = jax.devices()[0]
    for bad, msg in (("cpu", "sequence of jax devices"), ([0], "jax devices"), ([d, d], "devices must be distinct")):
        with pytest.raises(ValueError, match=msg):
            LLM("tiny", devices=bad, progress=False)


def test_cli_rejects_too_many_replicas_before_building(capsys):
    from ouro_jax.cli import main

    t = time.perf_counter()
    assert main(["serve", "tiny", "--data-parallel-size", "2", "--replica-mode", "thread"]) == 1
    assert "needs 2 devices, but jax sees 1" in capsys.readouterr().err
    assert main(["serve", "tiny", "--data-parallel-size", "0"]) == 1
    assert "data_parallel_size must be a positive integer" in capsys.readouterr().err
    assert time.perf_counter() - t < 5  # no engine was built
    # worker processes (the default): on the CPU each has its own host devices, so only a replica
    # larger than them fails, after a device probe process and before any worker starts
    t = time.perf_counter()
    assert main(["serve", "tiny", "--data-parallel-size", "2", "--tensor-parallel-size", "2"]) == 1
    assert "tensor_parallel_size=2 needs 2 devices in each replica's process, but jax sees 1" in capsys.readouterr().err
    assert time.perf_counter() - t < 15


def test_process_replica_sizes_and_device_slices():
    """What each worker process is given: on the GPU its own slice of the visible devices (from the
    front's CUDA_VISIBLE_DEVICES when set), on the CPU nothing (its own host devices)."""
    from ouro_jax.server.replica_process import check_process_replicas, replica_env

    assert check_process_replicas(2, 1, "gpu", 2) == 2 and check_process_replicas(4, 1, "cpu", 1) == 4
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 devices"):
        check_process_replicas(2, 2, "gpu", 3)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        check_process_replicas(0, 1, "cpu", 8)
    assert [replica_env(i, 1, "gpu", 2, environ={})["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0", "1"]
    env = {"CUDA_VISIBLE_DEVICES": "4, 5,6,7"}
    assert [replica_env(i, 2, "gpu", 4, environ=env)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["4,5", "6,7"]
    assert replica_env(1, 1, "cpu", 2, environ=env) == {}


def test_prefix_hashes_name_what_the_cache_holds():
    """The hashes the router compares are the block manager's keys: after a prompt ran, the engine's
    cache holds exactly its full blocks before the last position, and a different prefix holds none."""
    from ouro_jax import LLM, SamplingParams

    llm = LLM("tiny", progress=False, **DP_ENGINE)
    prompt = list(range(5, 19))  # 14 tokens: 3 full blocks of 4 before the last position
    sched = llm.scheduler
    hashes = sched.prefix_hashes(prompt)
    assert len(hashes) == 3 and sched.cached_prefix_blocks(hashes) == 0
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert sched.cached_prefix_blocks(hashes) == 3
    assert sched.cached_prefix_blocks(sched.prefix_hashes(prompt[:9] + [99, 98, 97])) == 2  # shares 2 blocks
    assert sched.cached_prefix_blocks(sched.prefix_hashes([7] + prompt[1:])) == 0
    assert sched.prefix_hashes(prompt[:4]) == [] and sched.prefix_hashes(prompt[:5]) == hashes[:1]
    off = LLM("tiny", progress=False, **dict(DP_ENGINE, enable_prefix_caching=False))
    assert off.scheduler.prefix_hashes(prompt) == []


# ------------------------------------------------------------ the DP=2 server (subprocess)
def _script_server_check() -> dict:
    """Run in a fresh interpreter with two host devices (see ``test_dp2_server_over_http``)."""
    import httpx
    import jax
    import numpy as np
    import openai

    from ouro_jax.server.replicas import build_replicas
    from ouro_jax.server.run import BackgroundServer, make_state
    from scheduler import SamplingParams

    assert len(jax.devices()) == 2
    llms, timings = build_replicas("tiny", DP_ENGINE, 2)
    res: dict = dict(
        devices=[sorted(d.id for d in x.runner.k_pool.devices()) for x in llms],
        param_devices=[sorted(d.id for d in jax.tree.leaves(x.runner.params)[0].devices()) for x in llms],
        num_blocks=[x.scheduler_config.num_blocks for x in llms],
        executables=len(timings["executables"]),
    )
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(5, 128, int(rng.integers(2, 14))))) for _ in range(16)]
    sps = [dict(max_tokens=int(rng.integers(3, 8)), exit_threshold=float(rng.choice([0.5, 1.0]))) for _ in prompts]
    want = []
    for p, sp in zip(prompts, sps):  # what LLM.generate answers, on each replica: the same
        outs = [
            x.generate([p], SamplingParams(temperature=0.0, ignore_eos=True, **sp), use_tqdm=False)[0] for x in llms
        ]
        assert outs[0].token_ids == outs[1].token_ids and outs[0].exit_depths == outs[1].exit_depths
        want.append((outs[0].token_ids, outs[0].exit_depths))
    ref = llms[0].generate(prompts[:3], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    used = lambda: [x.scheduler.block_manager.num_used_blocks for x in llms]  # noqa: E731
    admissions = lambda: [x.stats()["admissions"] for x in llms]  # noqa: E731
    hits = lambda: [x.stats()["prefix_cache_hit_tokens"] for x in llms]  # noqa: E731

    state = make_state(llms, "m", max_queue=64, startup=timings, prefix_slack=2)
    srv = BackgroundServer(state).start()
    url = srv.url

    def idle(timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if state.engine.pending == 0 and not any(x.has_unfinished() for x in llms):
                break
            time.sleep(0.02)
        assert state.engine.pending == 0 and used() == [0, 0], (state.engine.pending, used())

    def metric(name, **labels):
        text = httpx.get(url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total

    try:
        # 1. sixteen concurrent streams: each as LLM.generate answers alone, spread over both replicas
        a0 = admissions()

        async def one(client, p, sp):
            s = await client.completions.create(
                model="m", prompt=p, max_tokens=sp["max_tokens"], temperature=0, stream=True,
                extra_body={"ignore_eos": True, "exit_threshold": sp["exit_threshold"]},
            )  # fmt: skip
            ids, depths = [], []
            async for chunk in s:
                for ch in chunk.choices:
                    ids += ch.model_extra["token_ids"]
                    depths += ch.model_extra["exit_depths"]
            return ids, depths

        async def many():
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=120, max_retries=0)
            try:
                return await asyncio.gather(*[one(client, p, sp) for p, sp in zip(prompts, sps)])
            finally:
                await client.close()

        got = asyncio.run(many())
        assert [tuple(g) for g in got] == [tuple(w) for w in want]
        idle()
        res["spread"] = [b - a for a, b in zip(a0, admissions())]
        res["routed"] = [metric("ouro_routed_requests_total", replica=i) for i in range(2)]
        # non-streaming completions with a list of prompts: choices in order, each as generate answers
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
        r = client.completions.create(
            model="m", prompt=prompts[:3], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert [c.model_extra["token_ids"] for c in r.choices] == [o.token_ids for o in ref]
        idle()

        # 2. prefix-aware routing: a prompt sharing 3 blocks with an earlier one goes to its holder,
        # four times in a row (round robin alone would alternate)
        shared = list(map(int, rng.integers(5, 128, 12)))
        before = [metric("ouro_routed_requests_total", replica=i) for i in range(2)]
        client.completions.create(model="m", prompt=shared + [7, 8], max_tokens=2, extra_body={"ignore_eos": True})
        after = [metric("ouro_routed_requests_total", replica=i) for i in range(2)]
        holder = [i for i in range(2) if after[i] > before[i]]
        assert len(holder) == 1, (before, after)
        holder = holder[0]
        res["holder_caches"] = [
            x.scheduler.cached_prefix_blocks(x.scheduler.prefix_hashes(shared + [7, 8])) for x in llms
        ]
        h0, p0 = hits(), metric("ouro_routed_requests_total", replica=holder, reason="prefix")
        for k in range(4):
            client.completions.create(
                model="m", prompt=shared + [9 + k, 10, 11], max_tokens=2, extra_body={"ignore_eos": True}
            )
        res["prefix_routed_to_holder"] = metric("ouro_routed_requests_total", replica=holder, reason="prefix") - p0
        res["hit_tokens"] = [b - a for a, b in zip(h0, hits())]
        res["holder"] = holder
        idle()

        # 3. slow steps: dropped clients abort on whichever replica holds them; a full server answers 429;
        # draining answers 503 while the open streams finish
        for x in llms:
            step = x.step

            def slow(step=step):  # 40 tokens take >= 2 s: the open streams below still run when the
                time.sleep(0.05)  # metrics are read (at 10 ms a loaded CI machine once saw one finish first)
                return step()

            x.step = slow
        aborted = [x.stats()["aborted"] for x in llms]
        body = dict(model="m", prompt=[5, 6], max_tokens=40, temperature=0, stream=True, ignore_eos=True)
        streams = [httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) for _ in range(4)]
        for s in streams:
            r = s.__enter__()
            next(ln for ln in r.iter_lines() if ln.startswith("data: {"))  # one token, then hang up
            s.__exit__(None, None, None)
        idle()
        res["aborted"] = [x.stats()["aborted"] - a for a, x in zip(aborted, llms)]
        for loop in state.engine.replicas:
            loop.max_pending = 1
        open_streams = [httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
        its = []
        for s in open_streams:
            it = s.__enter__().iter_lines()
            next(ln for ln in it if ln.startswith("data: {"))
            its.append(it)
        full = httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=10)
        res["full"] = [full.status_code, full.headers.get("retry-after")]
        res["running_while_full"] = [metric("ouro_num_requests_running", replica=i) for i in range(2)]
        state.draining = True
        res["draining"] = httpx.post(url + "/v1/completions", json=dict(body, stream=False), timeout=10).status_code
        res["drained"] = [[ln for ln in it if ln][-1] for it in its]
        for s in open_streams:
            s.__exit__(None, None, None)
        idle()
        text = httpx.get(url + "/metrics").text
        res["metrics"] = sorted({m for m in re.findall(r'(ouro_\w+)\{[^}]*replica="(\d)"', text) for m in [m]})
        res["kv_usage"] = [metric("ouro_kv_cache_usage_ratio", replica=i) for i in range(2)]
        res["used_blocks"] = used()
    finally:
        srv.stop(timeout=30)
    res["threads_alive"] = [loop._thread.is_alive() for loop in state.engine.replicas]
    return res


@pytest.mark.slow  # ~40 s on 2 CPU cores: a fresh interpreter with 2 devices, 2 engines, ~40 requests
def test_dp2_server_over_http():
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "server"], capture_output=True, text=True, timeout=600, env=_env()
    )
    assert p.returncode == 0, p.stderr[-6000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["devices"] == [[0], [1]] and r["param_devices"] == [[0], [1]]  # disjoint, params too
    assert r["num_blocks"][0] == r["num_blocks"][1] and r["executables"] == 4  # a bucket + its sampler each
    assert all(n > 0 for n in r["spread"]) and sum(r["spread"]) == 16, r["spread"]  # both replicas served
    assert all(n > 0 for n in r["routed"])
    h = r["holder"]
    assert r["holder_caches"][h] == 3 and r["holder_caches"][1 - h] == 0  # only the holder cached it
    assert r["prefix_routed_to_holder"] == 4
    assert r["hit_tokens"][h] == 4 * 12 and r["hit_tokens"][1 - h] == 0  # every follower reused the prefix
    assert sum(r["aborted"]) == 4 and all(a > 0 for a in r["aborted"]), r["aborted"]  # aborts on both replicas
    assert r["full"] == [429, "1"] and r["running_while_full"] == [1.0, 1.0]
    assert r["draining"] == 503 and r["drained"] == ["data: [DONE]", "data: [DONE]"]
    names = {m for m, _ in r["metrics"]}
    assert {"ouro_num_requests_running", "ouro_kv_cache_usage_ratio", "ouro_routed_requests_total"} <= names
    assert {rep for _, rep in r["metrics"]} == {"0", "1"}
    assert r["kv_usage"] == [0.0, 0.0] and r["used_blocks"] == [0, 0]  # no block leaked
    assert r["threads_alive"] == [False, False]


@pytest.mark.slow  # ~30 s: `ouro-jax serve --data-parallel-size 2` in a subprocess with 2 host devices
def test_serve_cli_dp2_sigterm_drains_both_replicas():
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "ouro_jax.cli", "serve", "tiny", "--port", str(port), "--served-model-name", "m"]
    cmd += ["--data-parallel-size", "2", "--enable-prefix-caching"]
    server = ServeProcess(cmd + FLAGS, _env(), port, timeout=300)
    proc, url = server.proc, server.url
    try:
        body = dict(model="m", prompt=[5, 6], max_tokens=48, temperature=0, stream=True, ignore_eos=True)
        results: list = [None, None]

        def stream(i):
            ids, last = [], None
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    if line:
                        last = line
            results[i] = (len(ids), last)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        text = httpx.get(url + "/metrics").text
        routed = re.findall(r'ouro_routed_requests_total\{[^}]*replica="(\d)"[^}]*\} (\S+)', text)
        proc.send_signal(signal.SIGTERM)  # both streams are open: each must still finish
        for t in threads:
            t.join(60)
        assert results == [(48, "data: [DONE]")] * 2, (results, server.text)
        assert proc.wait(timeout=60) == 0
    finally:
        server.close()
    assert sorted(rep for rep, v in routed if float(v) > 0) == ["0", "1"], routed  # one stream per replica
    # worker processes (the default): both reported ready, and both are gone with the server
    assert "start-up: 2 replica processes ready" in server.text
    pids = [int(p) for p in re.findall(r"replica \d started \(pid (\d+)", server.text)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


if __name__ == "__main__" and sys.argv[1:] == ["server"]:
    print(json.dumps(_script_server_check()))
