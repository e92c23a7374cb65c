"""Where the host time of one step's call goes: the call timed on an idle device, beside no-op
executables that take the same arguments, and the call's spans in a host trace.

    python -m benchmarks.step_call --buckets decode:64 --decode-context 1024 --reps 40 \\
        --out benchmarks/results/step_call_h100.json

Loop by loop, a gated stream's next invocation is scheduled only after the host has read the
gates of the one before (docs/roadmap.md, "Gated streams loop by loop wait for the host"), so
the call's host time sits between two invocations' device work. Per bucket (``KIND:R[:CONTEXT]``
as in ``benchmarks.profile_step``; the same synthetic descriptor and engine), each figure is the
host seconds of the call alone (p10 / p50 / p90 of ``--reps``), the device idle before each call:

* ``launch``: ``ModelRunner.launch`` on a descriptor uploaded once;
* ``upload_launch``: a fresh upload and the launch, as the engine's ``step`` does (a descriptor
  at a new address makes XLA update the step's CUDA graph before launching it);
* ``upload``: the upload alone;
* ``noop_weights``: an executable that does nothing with the step's arguments (every weight
  leaf, the pools and the ring donated, the descriptor): JAX's and PJRT's cost of the arguments;
* ``noop_stacked``: the same with the weights stacked by shape and dtype into a few arrays;
* ``noop_no_weights``: the same without the weights.

Then ``--steps`` launches as ``upload_launch`` under ``jax.profiler.trace``: every host span
(``line | name``) with its milliseconds and count per launch, the largest ``--top`` first.

``--graph-nodes N [N ...]``: before the buckets (none unless ``--buckets`` names some), the call of
a synthetic executable of ``N`` elementwise kernels (each behind an optimization barrier, so XLA
fuses none together) on a ``[R, 2048]`` bf16 array for each ``R`` of ``--graph-rows`` (default 64),
as one CUDA graph (XLA's default) and with command buffers off (each kernel launched by the host):
how a graph's launch grows with its nodes, and (more rows: longer kernels, same nodes) whether that
is the host's time or a wait for the device. Run 61 (one H100): 0.07 / 0.37 / 0.53 / 1.01 / 1.91 ms
a call at 8 / 128 / 256 / 512 / 1024 nodes as a graph, ~1.9 us a node (`step_call_h100.json`).
"""

from __future__ import annotations

import collections
import os
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

import numpy as np

from benchmarks.profile_step import bucket_shape, parse_bucket, spans_per_launch, trace_kernels
from benchmarks.profile_step import parser as profile_parser
from benchmarks.sweep_buckets import synthetic_descriptor

__all__ = ["time_calls", "probe_bucket", "graph_launch", "main"]


def time_calls(call: Callable, sync: Callable, reps: int, warmup: int = 3) -> dict:
    """Host milliseconds of ``call()`` (p10 / p50 / p90 over ``reps``), waiting for the device
    (``sync(result)`` blocked on) after each so that every call finds it idle."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(sync(call()))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = call()
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(sync(out))
    ms = np.asarray(ts) * 1e3
    return dict(p10=float(np.percentile(ms, 10)), p50=float(np.median(ms)), p90=float(np.percentile(ms, 90)))


def _noop(leaves, k_pool, v_pool, ring, packed):
    return k_pool, v_pool, ring, packed[:1]


def probe_bucket(
    llm,
    b: dict,
    reps: int,
    steps: int,
    prefill_segment: int,
    warmup: int = 3,
    top: int = 40,
    trace_dir: Optional[str] = None,
) -> dict:
    """The module doc's figures for one bucket (``parse_bucket``'s dict) on ``llm.runner``; the
    trace is kept in ``trace_dir`` when given, else written to a temporary folder and removed
    (``profile_step.trace_kernels``)."""
    import jax
    import jax.numpy as jnp

    r = llm.runner
    spec = llm.scheduler.bucket_spec
    desc = synthetic_descriptor(spec, b["R"], b["kind"], b["context"], prefill_segment, r.num_blocks)
    key = r.executable_key(desc)
    r.executable(key)  # compiled (or loaded) before the clock
    leaves = tuple(jax.tree.leaves(r.params))  # the flat tuple every step executable takes
    rec = dict(b, key=repr(key), weight_leaves=len(leaves), reps=reps)
    packed = r.upload(desc)
    on_runner = lambda out: (r.ring, out[0], out[1])  # noqa: E731 - the ring it wrote, its gates and tokens
    rec["launch"] = time_calls(lambda: r.launch(key, packed), on_runner, reps, warmup)
    rec["upload_launch"] = time_calls(lambda: r.launch(key, r.upload(desc)), on_runner, reps, warmup)
    rec["upload"] = time_calls(lambda: r.upload(desc), lambda out: out, reps, warmup)

    groups = collections.defaultdict(list)
    for x in leaves:
        groups[(x.shape, str(x.dtype))].append(x)
    stacked = tuple(jnp.stack(v) for v in groups.values())
    rec["stacked_arrays"] = len(stacked)
    sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731

    def noop_call(weights):
        exe = (
            jax.jit(_noop, keep_unused=True, donate_argnums=(1, 2, 3))
            .lower(tuple(map(sds, weights)), sds(r.k_pool), sds(r.v_pool), sds(r.ring), sds(packed))
            .compile()
        )

        def call():  # the pools and the ring come back aliased: the runner keeps them
            out = exe(weights, r.k_pool, r.v_pool, r.ring, packed)
            r.k_pool, r.v_pool, r.ring = out[:3]
            return out

        return call

    for name, weights in (("noop_weights", leaves), ("noop_stacked", stacked), ("noop_no_weights", ())):
        rec[name] = time_calls(noop_call(weights), lambda out: out, reps, warmup)
    del stacked

    def traced():
        for _ in range(steps):
            jax.block_until_ready(on_runner(r.launch(key, r.upload(desc))))

    try:
        _, _, _, info, _ = trace_kernels(traced, trace_dir, host_top=top)
        rec["host_spans_ms_per_launch"] = spans_per_launch(info["host_spans"], steps)
        rec["traced_launches"] = steps
    except Exception as e:  # noqa: BLE001 - keep the timings, record why the trace is missing
        rec["trace_error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc(limit=6)
    return rec


def graph_launch(nodes: Sequence[int], reps: int, warmup: int = 3, rows: Sequence[int] = (64,)) -> list:
    """The call of ``n`` chained elementwise kernels for each ``n`` in ``nodes``, with XLA's
    command buffers (one CUDA graph) and without: ``[{nodes, rows, graph, call}]`` (``time_calls``),
    on a ``[rows, 2048]`` bf16 array for each of ``rows``. The kernels' device time grows with the
    rows; a launch whose host time does not is not waiting for the device."""
    import jax
    import jax.numpy as jnp

    out = []
    for r, n in ((r, n) for r in rows for n in nodes):
        x = jnp.ones((r, 2048), jnp.bfloat16)

        def chain(x, n=n):
            for _ in range(n):
                x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)
            return x

        lowered = jax.jit(chain).lower(x)
        for graph in (True, False):
            exe = lowered.compile({} if graph else {"xla_gpu_enable_command_buffer": ""})
            out.append(dict(nodes=n, rows=r, graph=graph, call=time_calls(lambda: exe(x), lambda o: o, reps, warmup)))
    return out


def print_bucket(rec: dict, top: int = 25) -> None:
    print(f"{rec['bucket']} ({rec['key']}, {rec['weight_leaves']} weight leaves):")
    for name in ("launch", "upload_launch", "upload", "noop_weights", "noop_stacked", "noop_no_weights"):
        t = rec[name]
        print(f"  {name:16s} p10 {t['p10']:.3f}  p50 {t['p50']:.3f}  p90 {t['p90']:.3f} ms")
    for k, (ms, n) in list(rec.get("host_spans_ms_per_launch", {}).items())[:top]:
        print(f"  {ms:8.3f} ms x{n:5.1f}  {k}")
    if "trace_error" in rec:
        print("  trace:", rec["trace_error"])


def main(argv: Optional[Sequence[str]] = None, harness=None) -> dict:
    ap = profile_parser()
    ap.description = __doc__
    ap.set_defaults(buckets=None, out="benchmarks/results/step_call.json", reps=40, top=40)
    ap.add_argument("--graph-nodes", type=int, nargs="+", default=None, help="kernels of the synthetic graphs")
    ap.add_argument("--graph-rows", type=int, nargs="+", default=[64], help="rows of the synthetic graphs' array")
    a = ap.parse_args(argv)
    if a.graph_nodes is not None and min(a.graph_nodes) < 1:
        raise SystemExit(f"--graph-nodes takes positive counts, got {a.graph_nodes}")
    if min(a.graph_rows) < 1:
        raise SystemExit(f"--graph-rows takes positive counts, got {a.graph_rows}")
    if a.buckets is None:
        a.buckets = [] if a.graph_nodes else ["decode:64"]
    buckets = [parse_bucket(x, a.decode_context, a.prefill_context) for x in a.buckets]
    import jax

    from benchmarks.run import harness_from_args, save_json

    result = dict(
        benchmark="step_call",
        device=str(jax.devices()[0].device_kind),
        jax_version=jax.__version__,
        backend=jax.default_backend(),
        argv=sys.argv[1:] if argv is None else list(argv),
        buckets=[],
    )
    if a.graph_nodes:
        result["graph_launch"] = graph_launch(a.graph_nodes, a.reps, a.warmup, a.graph_rows)
        for g in result["graph_launch"]:
            t = g["call"]
            print(
                f"graph of {g['nodes']:4d} kernels on {g['rows']:5d} rows, command buffer {g['graph']!s:5}: "
                f"call p50 {t['p50']:.3f} ms"
            )
        save_json(result, a.out)
    if not buckets:
        print(f"step_call: wrote {a.out}", flush=True)
        return result
    h = harness or harness_from_args(a, bucket_shape(a, buckets))
    result.update(device=h.device, preset=h.preset, dtype=h.dtype, engine_shape=h.shape.to_dict())
    llm, _ = h.engine("split", h.shape.ring_chunk)
    try:
        for b in buckets:
            tdir = os.path.join(a.trace_dir, b["bucket"].replace(":", "_")) if a.trace_dir else None
            rec = probe_bucket(llm, b, a.reps, a.steps, a.prefill_segment, a.warmup, a.top, tdir)
            result["buckets"].append(rec)
            print_bucket(rec)
            save_json(result, a.out)
    finally:
        del llm
    print(f"step_call: wrote {a.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
