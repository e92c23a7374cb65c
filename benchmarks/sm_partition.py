"""Can a GEMM and a bandwidth-bound read share the GPU when each has its own SMs (issue 37)?

A wavefront invocation runs its GEMMs (compute-bound) and its attention (bound by K/V reads) one
after the other, so long4's chunk-64 target needs the two to overlap (docs/roadmap.md, prefill
item 6). Kernels of one CUDA graph launched side by side do not overlap when each fills every SM
(decisions.md, "Command buffers scheduled by data dependencies"): cuBLAS's GEMM CTAs leave no room
on an SM. This measures the other way: the persistent gate/up GEMM (``gate_up_silu_mgpu``, grid
capped at ``G`` CTAs) beside weight_stream's TMA read (``k`` CTAs) on the SMs left over.

``--pairs`` independent GEMMs (``[1024, 2048] @ [2048, 2, 5632]``, 47 GFLOP each) and as many reads
of a ``[2048, --stream-cols]`` bf16 matrix (134 MB at 32768 columns, past the L2; about the K/V of
four 128-row segments at 4K), in one jit, its command buffer scheduled ``CONCURRENT`` (data
dependencies only). For each ``G:k`` split: the GEMMs alone, the reads alone, both together, and
both under XLA's default ``LHS`` order (the control: one after the other). ``serial_us`` is the
engine's way today, the GEMMs on every SM and then the reads on every SM (the ``132:132`` split's
parts run alone); ``vs_serial`` < 1 is time that overlap saves. Wall time, the median of
``--reps`` calls of the compiled program.

    python -m benchmarks.sm_partition --out DIR                  # DIR/sm_partition.json
    python -m benchmarks.sm_partition --splits 108:24 116:16 --pairs 4

Needs a Hopper GPU (TMA, wgmma); elsewhere it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from benchmarks.weight_stream import stream
from pallas_kernels.gate_up_silu_mgpu import Tuning, gate_up_silu

__all__ = ["MODES", "main", "parse_split", "program"]

ROWS, HIDDEN, INTER = 1024, 2048, 5632  # Ouro-1.4B's gate/up at a 1024-row invocation
MODES = ("CONCURRENT", "LHS")
STREAM_STAGES, STREAM_BK = 8, 128  # weight_stream's fastest ring (run 44)


def parse_split(text: str) -> tuple[int, int]:
    """``"G:k"`` -> ``(G, k)``: the GEMM's CTAs and the read's."""
    g, sep, k = text.partition(":")
    if not sep or not g.isdigit() or not k.isdigit() or int(g) < 1 or int(k) < 1:
        raise ValueError(f"a split is 'G:k' with two positive CTA counts, got {text!r}")
    return int(g), int(k)


def program(parts: str, g: int, k: int):
    """The jitted function of ``parts`` ("gemm", "stream" or "both"): ``f(xs, w, mats)`` -> the
    outputs of one GEMM per ``x`` in ``xs`` on ``g`` CTAs and one read per matrix in ``mats`` on
    ``k`` CTAs, none depending on another."""
    if parts not in ("gemm", "stream", "both"):
        raise ValueError(f"parts must be gemm, stream or both, got {parts!r}")
    tuning = Tuning(ctas=g)

    def f(xs, w, mats):
        out = []
        if parts != "stream":
            out += [gate_up_silu(x, w, tuning) for x in xs]
        if parts != "gemm":
            out += [stream(m, ctas=k, stages=STREAM_STAGES, bk=STREAM_BK) for m in mats]
        return out

    return jax.jit(f)


def compiler_options(mode: str) -> dict:
    # min graph size 1: a program of two launches still runs as one CUDA graph
    return {"xla_gpu_command_buffer_scheduling_mode": mode, "xla_gpu_graph_min_graph_size": 1}


def wall_us(compiled, args, reps: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: Optional[Sequence[str]] = None) -> dict | None:
    from pallas_kernels import dispatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", nargs="*", default=["132:132", "108:24", "116:16", "100:32"])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--stream-cols", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    splits = [parse_split(s) for s in a.splits]
    if a.pairs < 1:
        raise ValueError(f"--pairs must be positive, got {a.pairs}")
    if not dispatch.hopper_available():
        print("sm_partition needs a Hopper GPU (TMA, wgmma): nothing measured")
        return None
    sms = jax.devices()[0].core_count
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (ROWS, HIDDEN), jnp.bfloat16) for i in range(a.pairs)]
    w = jax.random.normal(key, (HIDDEN, 2, INTER), jnp.bfloat16) * HIDDEN**-0.5
    mats = [
        jax.random.normal(jax.random.fold_in(key, 1000 + i), (HIDDEN, a.stream_cols), jnp.bfloat16)
        for i in range(a.pairs)
    ]
    args = (xs, w, mats)

    def timed(parts, g, k, mode="CONCURRENT"):
        compiled = program(parts, g, k).lower(*args).compile(compiler_options=compiler_options(mode))
        return wall_us(compiled, args, a.reps)

    serial = timed("gemm", sms, sms) + timed("stream", sms, sms)
    print(json.dumps({"serial_us": serial, "sms": sms}), flush=True)
    records = []
    for g, k in splits:
        rec = dict(G=g, k=k)
        try:
            rec.update(gemm_us=timed("gemm", g, k), stream_us=timed("stream", g, k))
            for mode in MODES:
                rec[f"both_{mode.lower()}_us"] = timed("both", g, k, mode)
            rec["vs_serial"] = rec["both_concurrent_us"] / serial
        except Exception as e:  # noqa: BLE001 - a split the GPU refuses is a record, not the end
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
    out = dict(
        benchmark="sm_partition",
        device=jax.devices()[0].device_kind,
        sms=sms,
        pairs=a.pairs,
        rows=ROWS,
        stream_bytes=HIDDEN * a.stream_cols * 2,
        serial_us=serial,
        records=records,
    )
    from benchmarks.run import save_json

    os.makedirs(a.out, exist_ok=True)
    save_json(out, os.path.join(a.out, "sm_partition.json"))
    return out


if __name__ == "__main__":
    main()
