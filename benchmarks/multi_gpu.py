"""Two devices (issue #17): tensor parallel against one device, data-parallel replicas against one
engine, and the all-reduce against the bus bandwidth measured on the same machine.

    python -m benchmarks.multi_gpu --out benchmarks/results                       # Ouro-1.4B shapes
    python -m benchmarks.multi_gpu --preset ouro-2.6b --out benchmarks/results
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m benchmarks.multi_gpu --preset tiny --cpu-smoke --out /tmp/mgpu            # CPU smoke run

Every phase runs in its own interpreter (a fresh device each; jax takes most of a GPU's memory in
whichever process starts first), this process only orchestrates and, for the serving phase, is the
HTTP client:

1. ``allreduce``: a jitted ``psum`` of a ``[rows, hidden]`` array over the 2-device mesh, chained
   ``--ar-iters`` times in one executable (each layer's all-reduce sits on the critical path), per
   row count of the engine's buckets; and the bus bandwidth from a large ``psum``
   (``busbw = 2 (n-1)/n * bytes / time``, NCCL's definition).
2. ``tp1`` / ``tp2``: one engine at ``tensor_parallel_size`` 1 and 2: c=1 TPOT (sequential requests)
   and c=``--batch`` output throughput (one ``generate`` of ``--batch`` requests), fixed depth.
3. ``dp``: ``ouro-jax serve`` with one engine, then with ``--data-parallel-size 2`` (replicas as
   ``--dp-replica-mode``: worker processes by default), Poisson
   arrivals at ``--dp-load`` times one engine's capacity (the tp1 phase's c=batch throughput), as
   streaming ``/v1/completions`` requests; output throughput of each.

Goals (issue #17): TP=2 c=1 TPOT <= 0.6x TP=1; DP=2 serve throughput >= 1.9x one engine. Writes
``<out>/multi_gpu_<preset>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_TP_TPOT = 0.6  # TP=2 c=1 TPOT at most this share of TP=1's
GOAL_DP = 1.9  # DP=2 serve throughput at least this multiple of one engine's


# ----------------------------------------------------------------------------- settings
def engine_kwargs(a) -> dict:
    """One engine's settings, the same in every phase (few executables: start-up is in the budget)."""
    from weights.config import get_preset

    cfg = get_preset(a.preset)
    max_len = max(a.prompt_len + a.output_len, a.c1_prompt_len + a.c1_output_len)
    planes = cfg.num_loops
    # enough KV for every request at full length, at every depth plane (LAST_EXITED), plus 10%
    per_seq = cfg.kv_bytes_per_token_plane(2 if a.dtype == "bfloat16" else 4) * max_len * planes
    return dict(
        dtype=a.dtype,
        max_num_seqs=a.batch,
        max_num_batched_tokens=a.max_num_batched_tokens,
        prefill_chunk_size=a.prefill_chunk_size,
        block_size=a.block_size,
        max_model_len=max_len,
        buckets=a.buckets,
        kv_cache_bytes=int(1.1 * per_seq * a.batch),
        progress=False,
    )


def _sp(output_len: int):
    from scheduler import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, exit_mode="fixed")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(1, vocab, length))) for _ in range(n)]


# -------------------------------------------------------------------------------- phases
def phase_allreduce(a) -> dict:
    """psum latency per row count (chained in one executable) and the bus bandwidth of a large psum."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from weights.config import get_preset

    n = 2
    devs = jax.devices()[:n]
    mesh = Mesh(np.array(devs), ("x",))
    hidden = get_preset(a.preset).hidden_size
    dt = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    itemsize = jnp.dtype(dt).itemsize

    def chained(iters):
        def body(v):
            return jax.lax.fori_loop(0, iters, lambda i, x: jax.lax.psum(x, "x") * 0.5, v)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))

    def timed(fn, x, reps):
        fn(x).block_until_ready()  # compile + warm
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    sharding = NamedSharding(mesh, P("x"))
    rows_out = []
    for rows in a.ar_rows:
        x = jax.device_put(jnp.ones((n * rows, hidden), dt), sharding)  # [rows, hidden] per device
        t_many = timed(chained(a.ar_iters), x, 5)
        t_one = timed(chained(1), x, 5)
        per = max(0.0, (t_many - t_one) / (a.ar_iters - 1))  # launch and sync cost cancel
        nbytes = rows * hidden * itemsize
        # timing noise can leave no difference to divide by (CPU devices under load): no bandwidth then
        busbw = 2 * (n - 1) / n * nbytes / per / 1e9 if per > 0 else None
        rows_out.append(dict(rows=rows, bytes=nbytes, seconds=per, busbw_GBps=busbw))
    big = a.busbw_mib << 20
    elems = big // itemsize
    x = jax.device_put(jnp.ones((n * (elems // hidden), hidden), dt), sharding)
    single = jax.jit(
        jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    )
    t_big = timed(single, x, 10)
    nbytes = (elems // hidden) * hidden * itemsize
    busbw = 2 * (n - 1) / n * nbytes / t_big
    for r in rows_out:
        r["floor_s"] = 2 * (n - 1) / n * r["bytes"] / busbw  # what the bytes cost at the measured bus bandwidth
    return dict(
        device=devs[0].device_kind,
        backend=jax.default_backend(),
        hidden=hidden,
        dtype=a.dtype,
        iters=a.ar_iters,
        rows=rows_out,
        busbw=dict(bytes=nbytes, seconds=t_big, GBps=busbw / 1e9),
    )


def phase_tp(a, tp: int) -> dict:
    """c=1 TPOT and c=batch throughput of one engine at ``tensor_parallel_size=tp``."""
    import jax

    from ouro_jax import LLM
    from weights.config import get_preset

    vocab = get_preset(a.preset).vocab_size
    t = time.perf_counter()
    # fused decode steps off at both sizes: XLA (jax 0.11.2) segfaults compiling the fused step's
    # while_loop under shard_map on the GPU (session 6), so TP=2 runs loop by loop and TP=1 does too
    llm = LLM(a.preset, tensor_parallel_size=tp, fused_decode_max_rows=0, **engine_kwargs(a))
    startup = time.perf_counter() - t
    # c=1: one request at a time, the first one a warm-up
    c1 = _prompts(a.c1_requests + 1, a.c1_prompt_len, vocab, 1)
    tpots, ttfts = [], []
    for k, p in enumerate(c1):
        o = llm.generate([p], _sp(a.c1_output_len), use_tqdm=False)[0]
        if k:
            tpots.append(o.metrics.tpot)
            ttfts.append(o.metrics.ttft)
    # c=batch: every request at once
    batch = _prompts(a.batch, a.prompt_len, vocab, 2)
    llm.generate(batch[: min(8, a.batch)], _sp(4), use_tqdm=False)  # warm the larger buckets' paths
    t = time.perf_counter()
    outs = llm.generate(batch, _sp(a.output_len), use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    st = llm.stats()
    return dict(
        tp=tp,
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        startup_s=startup,
        compilations=st["compilations"],
        compile_time_s=st["compile_time_s"],
        kv_blocks=st["kv_blocks"],
        c1=dict(requests=len(tpots), tpot_s=float(np.median(tpots)), ttft_s=float(np.median(ttfts))),
        batch=dict(
            requests=a.batch,
            wall_s=wall,
            output_tokens=tokens,
            output_tok_per_s=tokens / wall,
            tpot_p50_s=float(np.median([o.metrics.tpot for o in outs if o.metrics.tpot is not None])),
        ),
    )


def _serve_cmd(a, dp: int, port: int) -> list[str]:
    kw = engine_kwargs(a)
    cmd = [sys.executable, "-m", "ouro_jax.cli", "serve", a.preset, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--no-access-log", "--log-level", "warning"]
    cmd += ["--max-queue", str(a.dp_requests), "--data-parallel-size", str(dp)]
    if dp > 1:  # one engine is the in-process server either way
        cmd += ["--replica-mode", a.dp_replica_mode]
    for k in ("dtype", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size", "block_size", "max_model_len"):
        cmd += ["--" + k.replace("_", "-"), str(kw[k])]
    cmd += ["--kv-cache-bytes", str(kw["kv_cache_bytes"])]
    if kw["buckets"]:
        cmd += ["--buckets", ",".join(map(str, kw["buckets"]))]
    return cmd


def phase_dp(a, capacity_req_s: float) -> dict:
    """One engine, then two replicas, each as ``ouro-jax serve`` at the same Poisson load."""
    import socket

    from benchmarks.serve_bench import arrival_times, run_http, summarize
    from weights.config import get_preset

    vocab = get_preset(a.preset).vocab_size
    rate = a.dp_load * capacity_req_s
    prompts = _prompts(a.dp_requests, a.prompt_len, vocab, 3)
    arrivals = arrival_times(a.dp_requests, rate, 3)
    fields = dict(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, exit_mode="fixed")
    out = dict(
        rate_req_s=rate,
        capacity_req_s=capacity_req_s,
        load=a.dp_load,
        requests=a.dp_requests,
        stream=a.dp_stream,
        replica_mode=a.dp_replica_mode,
        runs={},
    )
    for dp in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        proc = subprocess.Popen(_serve_cmd(a, dp, port), env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(proc, url, a.ready_timeout)
            ready = time.perf_counter() - t0
            send = run_http if a.dp_stream else run_plain
            send(url, "bench", prompts[:2], [0.0, 0.0], dict(fields, max_tokens=2))  # first-request paths
            rows, dur = send(url, "bench", prompts, arrivals, fields)
        finally:
            _stop(proc)
        s = summarize(rows, dur, slo_ttft=1e9, slo_tpot=1e9)
        s.pop("goodput_share", None), s.pop("goodput_req_per_s", None)
        s["ready_s"] = ready
        out["runs"][str(dp)] = s
        print(
            f"  serve DP={dp}: {s['output_tok_per_s']:.0f} tok/s over {dur:.1f} s (ready in {ready:.0f} s)", flush=True
        )
    return out


async def _run_plain(url: str, model: str, prompts, arrivals, fields) -> tuple[list[dict], float]:
    """Non-streaming requests at their arrival times: one response per request, so that neither the
    server nor this client spends its time on per-token events (throughput is all that is read)."""
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0 = time.monotonic()

        async def one(p, delay):
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            arrival = time.monotonic() - t0
            r = await client.post(url + "/v1/completions", json=dict(fields, model=model, prompt=p))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            n = r.json()["usage"]["completion_tokens"]
            return dict(ttft=None, tpot=None, e2e=time.monotonic() - t0 - arrival, tokens=n)

        rows = await asyncio.gather(*[one(p, d) for p, d in zip(prompts, arrivals)])
        return list(rows), time.monotonic() - t0


def run_plain(url, model, prompts, arrivals, fields):
    import asyncio

    return asyncio.run(_run_plain(url, model, prompts, arrivals, fields))


def _wait_ready(proc, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout} s")


def _stop(proc) -> None:
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------------------- driver
def _run_phase(argv: list[str], phase: str, timeout: float) -> dict:
    """``phase`` in a fresh interpreter; its JSON comes back on the last line of stdout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.multi_gpu", *argv, "--phase", phase]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"phase {phase} failed with status {p.returncode}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["phase_wall_s"] = time.perf_counter() - t
    return res


def summary(r: dict) -> dict:
    """The figures next to their goals."""
    tp1, tp2, ar, dp = r["tp1"], r["tp2"], r["allreduce"], r["dp"]
    cfg = r["config"]
    smallest = min(r["settings"]["buckets"] or [8])  # the bucket a c=1 decode step runs in
    c1_rows = min((x for x in ar["rows"] if x["rows"] >= smallest), key=lambda x: x["rows"], default=ar["rows"][-1])
    per_layer = 2 * c1_rows["seconds"]  # one all-reduce after attention, one after the MLP
    per_token = per_layer * cfg["num_hidden_layers"] * cfg["num_loops"]
    tpot_ratio = tp2["c1"]["tpot_s"] / tp1["c1"]["tpot_s"]
    dp_ratio = dp["runs"]["2"]["output_tok_per_s"] / dp["runs"]["1"]["output_tok_per_s"]
    return dict(
        tp_c1_tpot_ratio=tpot_ratio,
        tp_c1_tpot_goal=GOAL_TP_TPOT,
        tp_c1_tpot_met=tpot_ratio <= GOAL_TP_TPOT,
        tp_batch_throughput_ratio=tp2["batch"]["output_tok_per_s"] / tp1["batch"]["output_tok_per_s"],
        dp_throughput_ratio=dp_ratio,
        dp_goal=GOAL_DP,
        dp_met=dp_ratio >= GOAL_DP,
        allreduce_rows_c1=c1_rows["rows"],
        allreduce_per_layer_c1_s=per_layer,
        allreduce_per_token_c1_s=per_token,
        allreduce_share_of_tp2_tpot=per_token / tp2["c1"]["tpot_s"],
        busbw_GBps=ar["busbw"]["GBps"],
    )


def print_summary(r: dict) -> None:
    s, tp1, tp2, ar, dp = r["summary"], r["tp1"], r["tp2"], r["allreduce"], r["dp"]
    ok = lambda b: "MET" if b else "NOT MET"  # noqa: E731
    print(f"\n== {r['preset']} on {r['device']} x2 ({r['backend']}) ==")
    print(
        f"TP c=1 TPOT: TP=1 {1e3 * tp1['c1']['tpot_s']:.2f} ms, TP=2 {1e3 * tp2['c1']['tpot_s']:.2f} ms -> "
        f"{s['tp_c1_tpot_ratio']:.2f}x (goal <= {GOAL_TP_TPOT}x: {ok(s['tp_c1_tpot_met'])})"
    )
    print(
        f"TP c={tp1['batch']['requests']} throughput: TP=1 {tp1['batch']['output_tok_per_s']:.0f} tok/s, "
        f"TP=2 {tp2['batch']['output_tok_per_s']:.0f} tok/s -> {s['tp_batch_throughput_ratio']:.2f}x"
    )
    d1, d2 = dp["runs"]["1"], dp["runs"]["2"]
    print(
        f"serve at {dp['rate_req_s']:.1f} req/s ({dp['load']:g}x one engine's capacity), {dp['requests']} requests: "
        f"one engine {d1['output_tok_per_s']:.0f} tok/s, DP=2 {d2['output_tok_per_s']:.0f} tok/s -> "
        f"{s['dp_throughput_ratio']:.2f}x (goal >= {GOAL_DP}x: {ok(s['dp_met'])})"
    )
    print(f"bus bandwidth (psum of {ar['busbw']['bytes'] >> 20} MiB): {ar['busbw']['GBps']:.1f} GB/s")
    for x in ar["rows"]:
        print(
            f"  all-reduce [{x['rows']}, {ar['hidden']}] {ar['dtype']}: {1e6 * x['seconds']:.1f} us "
            f"(bandwidth floor {1e6 * x['floor_s']:.2f} us, "
            + ("-" if x["busbw_GBps"] is None else f"{x['busbw_GBps']:.2f}")
            + " GB/s)"
        )
    print(
        f"per layer at c=1 (2 all-reduces of {s['allreduce_rows_c1']} rows): "
        f"{1e6 * s['allreduce_per_layer_c1_s']:.1f} us;"
        f" per token ({r['config']['num_hidden_layers']} layers x {r['config']['num_loops']} loops): "
        f"{1e3 * s['allreduce_per_token_c1_s']:.2f} ms = {100 * s['allreduce_share_of_tp2_tpot']:.0f}% of TP=2 TPOT"
    )


def plot(r: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    s, tp1, tp2, ar, dp = r["summary"], r["tp1"], r["tp2"], r["allreduce"], r["dp"]
    fig, ax = plt.subplots(1, 4, figsize=(18, 4.2))
    ax[0].bar(["TP=1", "TP=2"], [1e3 * tp1["c1"]["tpot_s"], 1e3 * tp2["c1"]["tpot_s"]], color=["tab:gray", "tab:blue"])
    ax[0].axhline(
        1e3 * GOAL_TP_TPOT * tp1["c1"]["tpot_s"], color="tab:red", ls="--", label=f"goal {GOAL_TP_TPOT}x TP=1"
    )
    ax[0].set_ylabel("c=1 TPOT (ms)")
    ax[0].legend(fontsize=8)
    b = tp1["batch"]["requests"]
    thr = [tp1["batch"]["output_tok_per_s"], tp2["batch"]["output_tok_per_s"]]
    ax[1].bar(["TP=1", "TP=2"], thr, color=["tab:gray", "tab:blue"])
    ax[1].set_ylabel(f"c={b} output tok/s")
    d1, d2 = dp["runs"]["1"]["output_tok_per_s"], dp["runs"]["2"]["output_tok_per_s"]
    ax[2].bar(["one engine", "DP=2"], [d1, d2], color=["tab:gray", "tab:green"])
    ax[2].axhline(GOAL_DP * d1, color="tab:red", ls="--", label=f"goal {GOAL_DP}x")
    ax[2].set_ylabel(f"serve output tok/s at {dp['rate_req_s']:.1f} req/s")
    ax[2].legend(fontsize=8)
    rows = [x["rows"] for x in ar["rows"]]
    ax[3].plot(rows, [1e6 * x["seconds"] for x in ar["rows"]], "o-", label="psum (measured)")
    floor = [1e6 * x["floor_s"] for x in ar["rows"]]
    ax[3].plot(rows, floor, "s--", label=f"bytes / busbw ({ar['busbw']['GBps']:.0f} GB/s)")
    ax[3].set_xscale("log")
    ax[3].set_yscale("log")
    ax[3].set_xlabel(f"rows of [rows, {ar['hidden']}] {ar['dtype']}")
    ax[3].set_ylabel("all-reduce time (us)")
    ax[3].legend(fontsize=8)
    for x in ax:
        x.grid(alpha=0.3)
    fig.suptitle(
        f"{r['preset']} on 2x {r['device']}: TPOT ratio {s['tp_c1_tpot_ratio']:.2f}x (goal <= {GOAL_TP_TPOT}), "
        f"DP=2 {s['dp_throughput_ratio']:.2f}x (goal >= {GOAL_DP})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="ouro-1.4b", help="model shapes (random weights): ouro-1.4b, ouro-2.6b, tiny")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="output folder")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch", type=int, default=128, help="the throughput concurrency (and max_num_seqs)")
    p.add_argument("--prompt-len", type=int, default=128, help="throughput and serving prompts")
    p.add_argument("--output-len", type=int, default=128, help="throughput and serving outputs")
    p.add_argument("--c1-prompt-len", type=int, default=128)
    p.add_argument("--c1-output-len", type=int, default=128)
    p.add_argument("--c1-requests", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--prefill-chunk-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--buckets", default="8,128,256", help="row buckets (few: every executable compiles per engine)")
    p.add_argument("--dp-requests", type=int, default=384)
    p.add_argument("--dp-load", type=float, default=3.0, help="arrival rate as a multiple of one engine's capacity")
    p.add_argument("--dp-stream", action="store_true", help="streaming requests (per-token events) for the serve runs")
    p.add_argument(
        "--dp-replica-mode",
        default="process",
        choices=("process", "thread"),
        help="DP=2 replicas as worker processes (serve's default) or threads of one process",
    )
    p.add_argument("--ar-rows", default="8,128,256,1024", help="all-reduce row counts")
    p.add_argument("--ar-iters", type=int, default=200, help="all-reduces chained per timed executable")
    p.add_argument("--busbw-mib", type=int, default=256, help="bytes per device of the bandwidth psum")
    p.add_argument("--ready-timeout", type=float, default=400.0)
    p.add_argument("--phase", default=None, choices=("allreduce", "tp1", "tp2"), help=argparse.SUPPRESS)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes for a CPU run with 2 host devices")
    return p


def _args(argv):
    a = parser().parse_args(argv)
    if a.cpu_smoke:
        a.batch, a.prompt_len, a.output_len, a.c1_prompt_len, a.c1_output_len = 4, 12, 6, 8, 6
        a.c1_requests, a.max_num_batched_tokens, a.prefill_chunk_size, a.block_size = 1, 16, 8, 4
        a.buckets, a.dp_requests, a.ar_rows, a.ar_iters, a.busbw_mib = "16", 8, "8", 4, 1
    a.buckets = [int(x) for x in a.buckets.split(",") if x.strip()] if a.buckets else None
    a.ar_rows = [int(x) for x in a.ar_rows.split(",") if x.strip()]
    from weights.config import get_preset

    get_preset(a.preset)  # an unknown preset fails here
    for name in ("batch", "prompt_len", "output_len", "c1_prompt_len", "c1_output_len", "c1_requests", "dp_requests"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if a.ar_iters < 2 or a.dp_load <= 0 or a.busbw_mib < 1 or not a.ar_rows:
        raise ValueError("--ar-iters must be >= 2, --dp-load > 0, --busbw-mib >= 1, --ar-rows not empty")
    return a


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    if a.phase is not None:  # a child: one phase, its JSON on the last line
        res = phase_allreduce(a) if a.phase == "allreduce" else phase_tp(a, int(a.phase[2:]))
        print(json.dumps(res))
        return res
    from weights.config import get_preset

    t0 = time.perf_counter()
    cfg = get_preset(a.preset)
    r: dict = dict(
        preset=a.preset,
        settings=engine_kwargs(a),
        config=dict(num_hidden_layers=cfg.num_hidden_layers, num_loops=cfg.num_loops, hidden_size=cfg.hidden_size),
        workload=dict(
            batch=a.batch, prompt_len=a.prompt_len, output_len=a.output_len, c1_prompt_len=a.c1_prompt_len,
            c1_output_len=a.c1_output_len, c1_requests=a.c1_requests, dp_requests=a.dp_requests, dp_load=a.dp_load,
        ),
    )  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"multi_gpu_{a.preset}")
    from benchmarks.run import save_json

    r["complete"] = False  # saved after every phase: a run cut short keeps what it measured
    for phase in ("allreduce", "tp1", "tp2"):
        print(f"[{time.perf_counter() - t0:.0f} s] phase {phase}", flush=True)
        r[phase] = _run_phase(argv, phase, timeout=600)
        save_json(r, base + ".json")
    r["device"], r["backend"] = r["tp1"]["device"], r["tp1"]["backend"]
    capacity = r["tp1"]["batch"]["output_tok_per_s"] / a.output_len  # requests per second one engine finishes
    print(f"[{time.perf_counter() - t0:.0f} s] phase dp", flush=True)
    r["dp"] = phase_dp(a, capacity)
    r["summary"] = summary(r)
    r["wall_s"] = time.perf_counter() - t0
    r["complete"] = True
    save_json(r, base + ".json")
    print_summary(r)
    png = plot(r, base + ".png")
    print(f"wrote {base}.json" + (f" and {png}" if png else "") + f" in {r['wall_s']:.0f} s")
    return r


if __name__ == "__main__":
    main()
