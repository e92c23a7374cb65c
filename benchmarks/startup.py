"""Engine start-up, phase by phase, cold and from the persistent compilation cache.

Each start runs in a fresh process (``--child``) so that nothing is warm but the cache directory:
the first start uses an empty cache (cold), the later ones reuse it. A child reports import, backend
start, weight build, the warm-up of every executable (each one's seconds, how many came from the
persistent cache by JAX's own ``/jax/compilation_cache/*`` monitoring events, and JAX's trace / lower /
compile spans), then the first request's latency. The
parent keeps every line the child wrote to stderr that looks like an XLA warning, so a warning a user
would take for a fault is recorded, not hidden.

    python -m benchmarks.startup --preset ouro-1.4b --starts 2 --out benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_T0 = time.perf_counter()

# XLA's C++ log lines a user sees at start-up: W/E severities, and the rematerialization notice
_WARN = re.compile(r"^(?:[WE]\d{4} |.*(?:rematerialization|Can't reduce memory|WARNING))")


def _engine_kwargs(a) -> dict:
    kw = dict(
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        prefill_chunk_size=a.prefill_chunk_size,
        max_model_len=a.max_model_len,
        prefill_mode=a.prefill_mode,
        dtype=a.dtype,
        compile_cache_dir=a.cache_dir,
        progress=False,
    )
    if a.kv_cache_bytes:
        kw["kv_cache_bytes"] = a.kv_cache_bytes
    return kw


def child(a) -> dict:
    """One start of the engine in this process; returns its phases."""
    import jax

    t_import = time.perf_counter() - _T0
    from jax import monitoring

    import ouro_jax
    from ouro_jax import LLM, SamplingParams

    t_import_all = time.perf_counter() - _T0
    t = time.perf_counter()
    dev = jax.devices()[0]
    t_backend = time.perf_counter() - t

    events: list[str] = []
    durations: list[tuple[str, float]] = []
    monitoring.register_event_listener(lambda name, **kw: events.append(name))
    monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: durations.append((name, secs)))

    t = time.perf_counter()
    llm = LLM(a.preset, warmup=False, **_engine_kwargs(a))
    jax.block_until_ready(llm.runner.params)
    t_build = time.perf_counter() - t

    keys = llm.executable_keys()
    e0, d0 = len(events), len(durations)
    t_all = time.perf_counter()
    llm.runner.warmup(keys, progress=False)
    t_compile = time.perf_counter() - t_all
    spans: dict[str, float] = {}
    for name, secs in durations[d0:]:
        short = name.rsplit("/", 1)[-1]
        spans[short] = spans.get(short, 0.0) + secs
    exes = [dict(key=str(k), seconds=llm.runner.compile_times.get(k, 0.0)) for k in keys]
    cache_hits = sum(n.endswith("/cache_hits") for n in events[e0:])

    t = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    t_first = time.perf_counter() - t
    return dict(
        device=dev.device_kind,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        ouro_jax=getattr(ouro_jax, "__version__", None),
        import_jax_s=t_import,
        import_s=t_import_all,
        backend_s=t_backend,
        build_s=t_build,
        executables=exes,
        cache_hits=cache_hits,
        jax_spans_s=spans,
        compile_s=t_compile,
        first_request_s=t_first,
        ready_s=time.perf_counter() - _T0,
        compilations=llm.runner.compilations,
    )


def _argv_for_child(a) -> list[str]:
    out = [sys.executable, "-m", "benchmarks.startup", "--child"]
    for k, v in vars(a).items():
        if k in ("child", "starts", "out", "fresh") or v is None:
            continue
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def parent(a) -> dict:
    if a.fresh or not a.cache_dir:
        a.cache_dir = tempfile.mkdtemp(prefix="ouro_startup_cache_")
    starts = []
    for i in range(a.starts):
        t = time.perf_counter()
        p = subprocess.run(_argv_for_child(a), capture_output=True, text=True, env=dict(os.environ))
        wall = time.perf_counter() - t
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            sys.stderr.write(p.stderr[-4000:])
            raise SystemExit(f"start {i} failed (exit {p.returncode})")
        rec = json.loads(lines[-1])
        rec.update(
            start=i,
            kind="cold" if i == 0 else "cached",
            process_wall_s=wall,
            xla_warnings=[ln[:400] for ln in p.stderr.splitlines() if _WARN.match(ln)],
        )
        hits = rec["cache_hits"]
        print(
            f"start {i} ({rec['kind']}): ready {rec['ready_s']:.1f} s (process {wall:.1f} s) = import "
            f"{rec['import_s']:.1f} + backend {rec['backend_s']:.1f} + build {rec['build_s']:.1f} + compile "
            f"{rec['compile_s']:.1f} ({hits}/{len(rec['executables'])} from cache) + first request "
            f"{rec['first_request_s']:.2f}; {len(rec['xla_warnings'])} XLA warning lines",
            flush=True,
        )
        for e in rec["executables"]:
            print(f"    {e['key']}: {e['seconds']:.2f} s")
        print("    jax spans (s, summed over threads):", {k: round(v, 2) for k, v in rec["jax_spans_s"].items()})
        for w in rec["xla_warnings"][:5]:
            print("    XLA:", w)
        starts.append(rec)
    return dict(workload="startup", preset=a.preset, settings=_engine_kwargs(a) | dict(cache_dir=None), starts=starts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--prefill-chunk-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--prefill-mode", default="split")
    ap.add_argument("--kv-cache-bytes", type=int, default=None)
    ap.add_argument("--cache-dir", default=None, help="persistent compilation cache (default: a fresh one)")
    ap.add_argument("--fresh", action="store_true", help="start from an empty cache even with --cache-dir")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return
    res = parent(a)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
