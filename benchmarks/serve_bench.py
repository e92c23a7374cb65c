"""Serving benchmark through HTTP: Poisson arrivals at several rates, against the offline engine.

For each rate, the same requests (random prompts of ``--prompt-len`` tokens, ``--output-len`` out,
EOS ignored) arrive at the same Poisson times twice: once driven into the engine directly (the
``add_request`` / ``step`` loop, no HTTP), once as streaming ``/v1/completions`` requests to the
server. TTFT / TPOT / E2E percentiles and goodput (requests meeting both SLOs) are reported for both,
so the difference is what the HTTP layer costs under load. ``--overhead``: one request at a time
(c=1), TPOT through HTTP streaming against the engine driven directly, and the overhead share.

    python -m benchmarks.serve_bench --model ouro-1.4b --rates 1,2,4,8 --num-requests 64
    python -m benchmarks.serve_bench --model tiny --prompt-len 16 --output-len 8 --rates 4 \\
        --num-requests 4 --server inproc --out /tmp/serve.json       # CPU smoke run

The server listens on 127.0.0.1 only: in this process (``--server inproc``: client and server share
the interpreter and one engine) or as an ``ouro-jax serve`` subprocess (``--server subprocess``, the
default); then the HTTP runs come first and the offline engine is built here only after the server
has exited, since jax takes most of the device's memory in whichever process starts it first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Optional

import numpy as np

from benchmarks.metrics import percentiles
from benchmarks.serve_process import ServeProcess
from ouro_jax.engine_config import add_arguments, from_arguments, to_argv
from ouro_jax.server.cli_commands import ENGINE_SECTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


# ------------------------------------------------------------------------------ workload
def make_requests(n: int, prompt_len: int, output_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # token 0 is EOS in the presets: prompts stay clear of it
    return [list(map(int, rng.integers(1, vocab_size, prompt_len))) for _ in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start of a run; exponential gaps (a Poisson process) of mean ``1 / rate``."""
    rng = np.random.default_rng(seed + 1)
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, n))]


def sampling_fields(args) -> dict:
    """The request fields both paths send (OpenAI names, engine and Ouro extras)."""
    d = dict(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if args.exit == "fixed":
        d.update(exit_mode="fixed")
    else:
        d.update(exit_mode="synthetic", synthetic_mean_loops=args.mean_loops)
    return d


def summarize(rows: list[dict], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    """``rows``: one ``{"ttft", "tpot", "e2e", "tokens"}`` per request (seconds, from its arrival)."""
    good = [r for r in rows if r["ttft"] is not None and r["ttft"] <= slo_ttft and (r["tpot"] or 0.0) <= slo_tpot]
    tokens = sum(r["tokens"] for r in rows)
    return dict(
        requests=len(rows),
        duration_s=duration,
        output_tok_per_s=tokens / duration if duration > 0 else None,
        request_per_s=len(rows) / duration if duration > 0 else None,
        ttft=percentiles([r["ttft"] for r in rows]),
        tpot=percentiles([r["tpot"] for r in rows]),
        e2e=percentiles([r["e2e"] for r in rows]),
        goodput_share=len(good) / max(1, len(rows)),
        goodput_req_per_s=len(good) / duration if duration > 0 else None,
    )


def _row(arrival: float, token_times: list[float], end: float) -> dict:
    n = len(token_times)
    return dict(
        ttft=token_times[0] - arrival if n else None,
        tpot=(token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None,
        e2e=end - arrival,
        tokens=n,
    )


# ------------------------------------------------------------------------------- offline
def run_offline(llm, prompts, arrivals, fields) -> tuple[list[dict], float]:
    """The engine driven directly; a request joins at the first step boundary after its arrival time,
    and its latencies count from that arrival time (not from when the loop got to it)."""
    from scheduler import SamplingParams

    sp = SamplingParams(**fields)
    t0 = time.monotonic()
    rows: dict[int, dict] = {}
    times: dict[object, list[float]] = {}
    rid_of: dict[object, int] = {}
    nxt = 0
    while nxt < len(prompts) or llm.has_unfinished():
        now = time.monotonic() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            rid = llm.add_request(prompts[nxt], sp, request_id=("bench", nxt, t0))
            rid_of[rid], times[rid] = nxt, []
            nxt += 1
        if not llm.has_unfinished():
            time.sleep(max(0.0, min(arrivals[nxt] - now, 0.01)))
            continue
        outs = llm.step()
        t = time.monotonic() - t0
        for o in outs:
            ts = times.get(o.request_id)
            if ts is None:
                continue
            ts.extend([t] * (len(o.token_ids) - len(ts)))
            if o.finished:
                i = rid_of[o.request_id]
                rows[i] = _row(arrivals[i], ts, t)
    return [rows[i] for i in range(len(prompts))], time.monotonic() - t0


# ---------------------------------------------------------------------------------- HTTP
async def _one_http(client, url: str, body: dict, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
    arrival = time.monotonic() - t0
    token_times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch:
                    t = time.monotonic() - t0
                    token_times.extend([t] * len(ch[0]["token_ids"]))
    row = _row(arrival, token_times, time.monotonic() - t0)
    row["arrival_lag"] = arrival - delay
    return row


async def _run_http(url: str, model: str, prompts, arrivals, fields) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        t0 = time.monotonic()
        coros = [
            _one_http(client, url, dict(fields, model=model, prompt=p, stream=True), a, t0)
            for p, a in zip(prompts, arrivals)
        ]
        rows = await asyncio.gather(*coros)
        return list(rows), time.monotonic() - t0


def run_http(url, model, prompts, arrivals, fields):
    return asyncio.run(_run_http(url, model, prompts, arrivals, fields))


# ---------------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-1.4b", help="preset or checkpoint folder")
    p.add_argument("--rates", default="1,2,4,8", help="request rates (req/s), comma separated")
    p.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--exit", choices=("fixed", "early"), default="fixed", help="fixed depth or synthetic early exit")
    p.add_argument("--mean-loops", type=float, default=2.5, help="mean loops per token for --exit early")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput: TTFT at most this (s)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="goodput: TPOT at most this (s)")
    p.add_argument("--server", choices=("subprocess", "inproc"), default="subprocess")
    p.add_argument("--overhead", action="store_true", help="c=1 TPOT through HTTP vs the engine directly, only")
    p.add_argument("--overhead-requests", type=int, default=8)
    p.add_argument("--skip-offline", action="store_true", help="HTTP runs only")
    p.add_argument("--request-seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--out", default=None, help="JSON path (default: results/serve_http.json, --overhead: serve_http_overhead.json)"
    )
    p.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    add_arguments(p, ENGINE_SECTIONS)
    return p


def _print(label: str, s: dict) -> None:
    f = lambda d, k: "-" if not d else f"{1e3 * d[k]:.1f}"  # noqa: E731
    print(
        f"  {label:<14} TTFT p50 {f(s['ttft'], 'p50')} p99 {f(s['ttft'], 'p99')} ms | TPOT p50 {f(s['tpot'], 'p50')} "
        f"p99 {f(s['tpot'], 'p99')} ms | E2E p50 {f(s['e2e'], 'p50')} ms | {s['output_tok_per_s']:.1f} tok/s | "
        f"goodput {100 * s['goodput_share']:.0f}%",
        flush=True,
    )


def _config(model):
    """The model's config without touching the device (the subprocess server may need all of it)."""
    from weights.config import PRESETS, OuroConfig

    return PRESETS[model] if model in PRESETS else OuroConfig.from_json(model)


def _http_part(args, url, model_name, rates, fields, vocab, result) -> dict:
    """HTTP runs: per rate, or the c=1 overhead requests; returns the rows of the latter."""
    over = None
    if args.overhead:
        over = [run_http(url, model_name, [p], [0.0], fields)[0][0] for p in _overhead_prompts(args, vocab)]
    else:
        for rate in rates:
            prompts = make_requests(args.num_requests, args.prompt_len, args.output_len, vocab, args.request_seed)
            arrivals = arrival_times(args.num_requests, rate, args.request_seed)
            rows, dur = run_http(url, model_name, prompts, arrivals, fields)
            s = summarize(rows, dur, args.slo_ttft, args.slo_tpot)
            s["max_arrival_lag_s"] = max(r["arrival_lag"] for r in rows)
            _record(result, rate)["http"] = s
            _print(f"{rate:g}/s http", s)
    return over


def _offline_part(args, llm, rates, fields, vocab, result) -> Optional[list]:
    over = None
    if args.overhead:
        over = [run_offline(llm, [p], [0.0], fields)[0][0] for p in _overhead_prompts(args, vocab)]
    elif not args.skip_offline:
        for rate in rates:
            prompts = make_requests(args.num_requests, args.prompt_len, args.output_len, vocab, args.request_seed)
            arrivals = arrival_times(args.num_requests, rate, args.request_seed)
            rows, dur = run_offline(llm, prompts, arrivals, fields)
            s = summarize(rows, dur, args.slo_ttft, args.slo_tpot)
            _record(result, rate)["offline"] = s
            _print(f"{rate:g}/s offline", s)
    return over


def _record(result: dict, rate: float) -> dict:
    rec = next((r for r in result["runs"] if r["rate"] == rate), None)
    if rec is None:
        rec = dict(rate=rate)
        result["runs"].append(rec)
    return rec


def _overhead_prompts(args, vocab):
    return make_requests(args.overhead_requests, args.prompt_len, args.output_len, vocab, args.request_seed + 7)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parser().parse_args(argv)
    if args.out is None:
        args.out = os.path.join(RESULTS, "serve_http_overhead.json" if args.overhead else "serve_http.json")
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if any(r <= 0 for r in rates) or not rates:
        raise ValueError(f"--rates must be positive numbers, got {args.rates!r}")
    if min(args.num_requests, args.prompt_len, args.output_len, args.overhead_requests) < 1:
        raise ValueError("--num-requests, --prompt-len, --output-len and --overhead-requests must be >= 1")
    # the subprocess server gets the same engine
    ekw = args.engine = from_arguments(args, max_model_len=args.prompt_len + args.output_len)
    vocab = _config(args.model).vocab_size
    fields = sampling_fields(args)
    model_name = "bench"
    result = dict(
        model=args.model,
        engine=dict(ekw),
        workload=dict(
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            num_requests=args.num_requests,
            exit=args.exit,
            mean_loops=args.mean_loops if args.exit == "early" else None,
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot,
            server=args.server,
        ),
        runs=[],
    )
    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine

    if args.server == "subprocess":
        # the server first, while this process holds no device memory; then the engine here
        flags = ["--max-queue", str(max(256, args.num_requests)), *to_argv(args.engine)]
        srv = ServeProcess(args.model, flags, model_name)
        try:
            srv.wait_ready(args.ready_timeout)
            over_http = _http_part(args, srv.url, model_name, rates, fields, vocab, result)
        finally:
            srv.stop()
        llm, timings = build_engine(args.model, ekw)
        over_direct = _offline_part(args, llm, rates, fields, vocab, result)
    else:
        llm, timings = build_engine(args.model, ekw)
        over_direct = _offline_part(args, llm, rates, fields, vocab, result)
        srv = BackgroundServer(make_state(llm, model_name, args.model, max_queue=max(256, args.num_requests)))
        srv.start()
        try:
            over_http = _http_part(args, srv.url, model_name, rates, fields, vocab, result)
        finally:
            srv.stop()
    import jax

    result.update(
        device=jax.devices()[0].device_kind,
        backend=jax.default_backend(),
        num_blocks=llm.scheduler_config.num_blocks,
        startup=timings,
    )
    result["runs"].sort(key=lambda r: r["rate"])
    if args.overhead:
        d = float(np.mean([r["tpot"] for r in over_direct if r["tpot"] is not None]))
        h = float(np.mean([r["tpot"] for r in over_http if r["tpot"] is not None]))
        result["overhead"] = o = dict(
            requests=args.overhead_requests,
            engine_tpot_s=d,
            http_tpot_s=h,
            overhead_share=(h - d) / d,
            engine_ttft_s=float(np.mean([r["ttft"] for r in over_direct])),
            http_ttft_s=float(np.mean([r["ttft"] for r in over_http])),
        )
        print(
            f"c=1 TPOT: engine {1e3 * d:.2f} ms, HTTP streaming {1e3 * h:.2f} ms "
            f"-> overhead {100 * o['overhead_share']:.1f}% of TPOT",
            flush=True,
        )

    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    from benchmarks.run import save_json

    save_json(result, args.out)
    print(f"wrote {args.out}")
    if result["runs"]:
        plot(result, args.plot or os.path.splitext(args.out)[0] + ".png")
    return result


def plot(result: dict, path: str) -> Optional[str]:
    """TTFT, TPOT (p50 solid, p99 dashed) and goodput against the rate, HTTP next to offline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'ouro-jax[plots]')")
        return None
    runs = result["runs"]
    rates = [r["rate"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, color in (("offline", "tab:blue"), ("http", "tab:orange")):
        if not all(mode in r for r in runs):
            continue
        for ax, metric in zip(axes[:2], ("ttft", "tpot")):
            for pct, style in (("p50", "-"), ("p99", "--")):
                ys = [1e3 * r[mode][metric][pct] if r[mode][metric] else np.nan for r in runs]
                ax.plot(rates, ys, style, color=color, marker="o", label=f"{mode} {pct}")
        axes[2].plot(rates, [100 * r[mode]["goodput_share"] for r in runs], color=color, marker="o", label=mode)
    wl = result["workload"]
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("TPOT (ms)")
    axes[2].set_ylabel("goodput (% of requests)")
    axes[2].set_title(f"SLOs: TTFT <= {wl['slo_ttft_s']} s, TPOT <= {1e3 * wl['slo_tpot_s']:g} ms", fontsize=10)
    axes[2].set_ylim(0, 105)
    for ax in axes:
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"{result['model']} on {result['device']}: {wl['prompt_len']} in / {wl['output_len']} out, "
        f"{wl['num_requests']} requests per rate, HTTP streaming vs the engine driven directly"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
