"""Engine start-up, phase by phase, cold and from the persistent compilation cache.

Each start runs in a fresh process (``--child``) so that nothing is warm but the cache directory:
the first start uses an empty cache (cold), the later ones reuse it. A child reports import, backend
start, weight build, the warm-up of every executable (each one's seconds, how many came from the
persistent cache by JAX's own ``/jax/compilation_cache/*`` monitoring events, and JAX's trace / lower /
compile spans), then the first request's latency. The
parent keeps every line the child wrote to stderr that looks like an XLA warning, so a warning a user
would take for a fault is recorded, not hidden.

    python -m benchmarks.startup --preset ouro-1.4b --starts 2 --out benchmarks/results/startup.json

Executables come from the engine's executable store (``ouro_jax/executable_store.py``) on a start
after the first; ``--no-store`` measures JAX's persistent cache alone. ``--compare-parallel`` runs
two cold starts, each in a fresh process with its own fresh cache, one compiling serially and one in
``--threads`` threads, and times every executable afterwards (``--reps`` invocations of a full
synthetic decode descriptor at ``--context`` tokens), so that one GPU call says whether threaded
cold compiles cost run time. ``--check-reserialize`` says whether an executable deserialized once
can be serialized again on this backend (``executable_store.RESERIALIZABLE_PLATFORMS``).

    python -m benchmarks.startup --preset ouro-1.4b --compare-parallel --out /tmp/startup_parallel.json
    python -m benchmarks.startup --check-reserialize
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
        executable_store=not a.no_store,
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
    llm.runner.warmup(keys, progress=False, threads=a.compile_threads)
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
    store = llm.executable_store
    return dict(
        device=dev.device_kind,
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        ouro_jax=getattr(ouro_jax, "__version__", None),
        import_jax_s=t_import,
        import_s=t_import_all,
        backend_s=t_backend,
        build_s=t_build,
        build_phases_s=dict(llm.startup_times),
        store=None
        if store is None
        else dict(
            hits=store.hits, misses=store.misses, saved=store.saved, not_saved=store.not_saved, failures=store.failures
        ),
        store_loads=llm.runner.store_loads,
        store_save_s=llm.runner.store_save_time,
        compile_threads=a.compile_threads,
        invocation_s=time_executables(llm, keys, a.reps, a.context) if a.time_executables else None,
        executables=exes,
        cache_hits=cache_hits,
        jax_spans_s=spans,
        compile_s=t_compile,
        first_request_s=t_first,
        ready_s=time.perf_counter() - _T0,
        compilations=llm.runner.compilations,
    )


def time_executables(llm, keys, reps: int, context: int) -> dict:
    """Seconds per invocation of every executable (best of 3 rounds of ``reps``), on a full synthetic
    decode descriptor (every row one segment of ``context`` tokens, every row sampled; a fused step
    runs it ``n`` times)."""
    import numpy as np

    from benchmarks.sweep_buckets import synthetic_descriptor
    from ouro_jax.runner import SamplerKey, packed_shape
    from scheduler.descriptor import StackedDescriptor

    r, spec = llm.runner, llm.scheduler.bucket_spec
    out = {}
    for key in keys:
        if isinstance(key, SamplerKey):  # the separate sampler, on zero hidden states and words
            h = r.put(np.zeros((key.C, llm.model_config.hidden_size), r.dtype))
            words = r.put(np.zeros(packed_shape(key), np.int32))
            out[str(key)] = _best_of_3(lambda: r.launch_sampler(key, h, words)[0], reps)
            continue
        bucket, n = (key, None) if not isinstance(key, tuple) or hasattr(key, "R") else key
        desc = synthetic_descriptor(spec, bucket.R, "decode", context, 128, r.num_blocks)
        if n is not None:  # a fused step: n sub-steps of whole tokens, every row at fixed full depth
            T = llm.model_config.num_loops
            full = np.zeros((n // T, bucket.R), np.int64)
            exits = (full + T, full + 1, full, np.ones((n // T, bucket.R), np.float32))  # EXIT_FIELDS
            desc = StackedDescriptor([desc] * n, T, exits)
        packed = r.upload(desc)
        out[str(key)] = _best_of_3(lambda: r.launch(key, packed)[0], reps)
    return out


def _best_of_3(call, reps: int) -> float:
    """Seconds per ``call()`` (which returns a device array), the best of 3 rounds of ``reps`` after
    3 warm-up calls: another process's run is compared with it."""
    for _ in range(3):
        last = call()
    last.block_until_ready()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            last = call()
        last.block_until_ready()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


_PARENT_ONLY = ("child", "starts", "out", "fresh", "compare_parallel", "threads", "check_reserialize")


def _argv_for_child(a) -> list[str]:
    out = [sys.executable, "-m", "benchmarks.startup", "--child"]
    for k, v in vars(a).items():
        if k in _PARENT_ONLY or v is None or v is False:
            continue
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return out


def _start(a, i: int, kind: str) -> dict:
    """One start in a fresh process: its record, printed."""
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
        kind=kind,
        process_wall_s=wall,
        xla_warnings=[ln[:400] for ln in p.stderr.splitlines() if _WARN.match(ln)],
    )
    hits = rec["cache_hits"]
    ph = rec["build_phases_s"]
    print(
        f"start {i} ({rec['kind']}): ready {rec['ready_s']:.1f} s (process {wall:.1f} s) = import "
        f"{rec['import_s']:.1f} + backend {rec['backend_s']:.1f} + build {rec['build_s']:.1f} (weights "
        f"{ph.get('weights', 0):.1f}, runner {ph.get('runner', 0):.1f}) + compile {rec['compile_s']:.1f} "
        f"({rec['store_loads']}/{len(rec['executables'])} from the store, {hits} from XLA's cache, store writes "
        f"{rec['store_save_s']:.1f} s) + first request {rec['first_request_s']:.2f}; "
        f"{len(rec['xla_warnings'])} XLA warning lines",
        flush=True,
    )
    print("    store:", rec["store"])
    for e in rec["executables"]:
        inv = (rec["invocation_s"] or {}).get(e["key"])
        print(f"    {e['key']}: {e['seconds']:.2f} s" + (f", {inv * 1e3:.3f} ms an invocation" if inv else ""))
    print("    jax spans (s, summed over threads):", {k: round(v, 2) for k, v in rec["jax_spans_s"].items()})
    for w in rec["xla_warnings"][:5]:
        print("    XLA:", w)
    return rec


def compare_parallel(a) -> dict:
    """Cold compile serial vs in ``a.threads`` threads, each in a fresh process with a fresh cache,
    then the run time of every executable each produced."""
    runs = {}
    for threads in (1, a.threads):
        a.cache_dir, a.compile_threads, a.time_executables = (
            tempfile.mkdtemp(prefix="ouro_startup_cache_"),
            threads,
            True,
        )
        runs[threads] = _start(a, len(runs), f"cold, {threads} compile thread(s)")
    serial, par = runs[1], runs[a.threads]
    print(f"cold compile: serial {serial['compile_s']:.1f} s, {a.threads} threads {par['compile_s']:.1f} s")
    ratios = {}
    for k, t1 in serial["invocation_s"].items():
        tn = par["invocation_s"][k]
        ratios[k] = tn / t1
        print(f"    {k}: serial {t1 * 1e3:.3f} ms, threaded {tn * 1e3:.3f} ms ({100 * (tn / t1 - 1):+.1f}%)")
    worst = max(ratios.values())
    print(f"worst threaded/serial invocation time: {worst:.3f}")
    return dict(
        workload="startup_compare_parallel",
        preset=a.preset,
        threads=a.threads,
        starts=list(runs.values()),
        invocation_ratio=ratios,
        worst_ratio=worst,
    )


_RESERIALIZE_CHILD = """
import pickle, sys
import jax, jax.numpy as jnp
from jax.experimental import serialize_executable as se
def f(seed, x):
    return jnp.exp(-jax.random.normal(jax.random.key(seed), x.shape)) ** 2 @ x
args = (jax.ShapeDtypeStruct((), jnp.uint32), jax.ShapeDtypeStruct((64, 64), jnp.float32))
load = lambda b: se.deserialize_and_load(*b, execution_devices=jax.devices()[:1])
x = jnp.ones((64, 64))
if sys.argv[1] == "write":
    once = load(se.serialize(jax.jit(f).lower(*args).compile()))
    pickle.dump((se.serialize(once), float(once(jnp.uint32(1), x).sum())), open(sys.argv[2], "wb"))
else:
    blob, want = pickle.load(open(sys.argv[2], "rb"))
    got = float(load(blob)(jnp.uint32(1), x).sum())
    print("OK" if got == want else f"WRONG {got} != {want}")
"""


def check_reserialize() -> bool:
    """Does an executable deserialized once, serialized again, load and run in a fresh process?"""
    path = os.path.join(tempfile.mkdtemp(prefix="ouro_reserialize_"), "exe.pkl")
    for step in ("write", "read"):
        p = subprocess.run([sys.executable, "-c", _RESERIALIZE_CHILD, step, path], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"re-serialization: FAILS at {step}: {p.stderr.strip().splitlines()[-1:]}")
            return False
    ok = p.stdout.strip().endswith("OK")
    print("re-serialization:", "works" if ok else p.stdout.strip())
    return ok


def parent(a) -> dict:
    if a.fresh or not a.cache_dir:
        a.cache_dir = tempfile.mkdtemp(prefix="ouro_startup_cache_")
    starts = [_start(a, i, "cold" if i == 0 else "cached") for i in range(a.starts)]
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
    ap.add_argument("--no-store", action="store_true", help="no executable store (JAX's persistent cache only)")
    ap.add_argument("--compile-threads", type=int, default=None, help="warmup threads (default: the engine's rule)")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--compare-parallel", action="store_true", help="cold serial vs threaded compile, then run times")
    ap.add_argument("--threads", type=int, default=8, help="threads of the threaded start of --compare-parallel")
    ap.add_argument("--time-executables", action="store_true", help="time every executable after start-up")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--check-reserialize", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return
    if a.check_reserialize:
        raise SystemExit(0 if check_reserialize() else 1)
    res = compare_parallel(a) if a.compare_parallel else parent(a)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
