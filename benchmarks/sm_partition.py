"""Can a GEMM and a bandwidth-bound read share the GPU when each has its own SMs (issue 37)?

A wavefront invocation runs its GEMMs (compute-bound) and its attention (bound by K/V reads) one
after the other, so long4's chunk-64 target needs the two to overlap (docs/roadmap.md, prefill
item 6). Kernels of one CUDA graph launched side by side do not overlap when each fills every SM
(decisions.md, "Command buffers scheduled by data dependencies"; presumably cuBLAS's GEMM CTAs
leave no room on an SM). This measures the other way: the persistent gate/up GEMM (``gate_up_silu_mgpu``, grid
capped at ``G`` CTAs) beside weight_stream's TMA read (``k`` CTAs) on the SMs left over.

One GEMM launch (``[1024 * scale, 2048] @ [2048, 2, 5632]``, 47 GFLOP per 1024 rows) and one read of
a ``[2048, 32768 * scale]`` bf16 matrix (134 MB a unit of ``--scale``: about the K/V of four 128-row
segments at 4K, past the L2), independent, in one jit whose command buffer is scheduled
``CONCURRENT`` (data dependencies only): each launch keeps its grid, and a GEMM CTA (~224 KB of
shared memory) and a read CTA (~152 KB) cannot share an SM's 228 KB, so the two hold disjoint SMs.
For each ``G:k`` split: the GEMM alone, the read alone, both together, and both under XLA's default
``LHS`` order (the control: one after the other). ``serial_us`` is the engine's way today: one
program, the GEMM on every SM and then the read on every SM (``every_sm_alone``: each in a program
of its own); ``vs_serial`` < 1 is time that overlap saves. Wall time, the median of ``--reps`` calls
of the compiled program, then the median of ``--rounds`` passes over every program, interleaved
(in one call of run 49 the same attention program took 1,709 to 2,058 us from one split to the
next; ``vs_serial`` is the median of each round's ratio to the serial program timed in that round).

``--read attention`` puts the engine's own Mosaic attention in the read's place: ``1024 * scale /
seg_rows`` segments of ``--seg-rows`` rows at 4K context (at 128 rows, the K/V of a
``prefill:1024`` step's layer a unit of ``--scale``, 268 MB; at 64, wavefront chunk 64's 536 MB).
Its grid is the kernel's own (tiles x heads, not capped; ``k`` is ignored), so whether its CTAs
find the SMs the GEMM leaves is up to the hardware's CTA scheduler.

    python -m benchmarks.sm_partition --out DIR                  # DIR/sm_partition.json
    python -m benchmarks.sm_partition --splits 108:24 116:16 --scale 4
    python -m benchmarks.sm_partition --read attention --splits 132:1 108:1 100:1 --seg-rows 64

Needs a Hopper GPU (TMA, wgmma); elsewhere it says so and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from benchmarks.timing import median_s
from benchmarks.weight_stream import stream
from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.gate_up_silu_mgpu import Tuning, gate_up_silu

__all__ = ["MODES", "main", "parse_split", "program"]

ROWS, HIDDEN, INTER = 1024, 2048, 5632  # Ouro-1.4B's gate/up at a 1024-row invocation
STREAM_COLS = 32768  # a [2048, 32768] bf16 matrix: 134 MB
MODES = ("CONCURRENT", "LHS")
READS = ("stream", "attention")
SEG_CTX = 4096  # --read attention: segments at 4K context, as profile_step's prefill:1024
STREAM_STAGES, STREAM_BK = 8, 128  # 8 slots of [128, 64] tiles: run 44's fastest weight_stream ring


def parse_split(text: str) -> tuple[int, int]:
    """``"G:k"`` -> ``(G, k)``: the GEMM's CTAs and the read's."""
    g, sep, k = text.partition(":")
    if not sep or not g.isdigit() or not k.isdigit() or int(g) < 1 or int(k) < 1:
        raise ValueError(f"a split is 'G:k' with two positive CTA counts, got {text!r}")
    return int(g), int(k)


def program(parts: str, g: int, k: int, read: str = "stream"):
    """The jitted function of ``parts`` ("gemm", "stream" or "both"): ``f(x, w, *read_args)`` ->
    the outputs of the GEMM ``x @ w`` on ``g`` CTAs and of the read, neither depending on the
    other. ``read`` "stream": ``read_args = (mat,)``, read on ``k`` CTAs; "attention":
    ``read_args`` = the Mosaic attention's ``(q, k_pages, v_pages, q_start, q_len, ctx_len,
    block_table)`` (layer 0), on its own grid."""
    if parts not in ("gemm", "stream", "both"):
        raise ValueError(f"parts must be gemm, stream or both, got {parts!r}")
    if read not in READS:
        raise ValueError(f"read must be one of {READS}, got {read!r}")
    tuning = Tuning(ctas=g)

    def read_fn(*read_args):
        if read == "stream":
            return stream(read_args[0], ctas=k, stages=STREAM_STAGES, bk=STREAM_BK)
        q = read_args[0]
        return mgpu.ragged_paged_attention_mgpu(*read_args, layer=jnp.int32(0), sm_scale=q.shape[-1] ** -0.5)

    def f(x, w, *read_args):
        out = []
        if parts != "stream":
            out.append(gate_up_silu(x, w, tuning))
        if parts != "gemm":
            out.append(read_fn(*read_args))
        return out

    return jax.jit(f)


def read_inputs(read: str, scale: int, key, seg_rows: int = 128) -> tuple:
    """The read's arguments at ``--scale``: a ``[2048, 32768 * scale]`` matrix, or ``1024 * scale /
    seg_rows`` attention segments of ``seg_rows`` rows at 4K (attention_sweep's case: pages in a
    shuffled order)."""
    if read == "stream":
        return (jax.random.normal(key, (HIDDEN, STREAM_COLS * scale), jnp.bfloat16),)
    from benchmarks.attention_sweep import build_case  # here: that script sets XLA's env on import

    c = build_case(key, ROWS * scale // seg_rows, seg_rows, SEG_CTX)
    s = c["seg"]
    return c["q"], c["k"][:1], c["v"][:1], s["q_start"], s["q_len"], s["ctx_len"], s["tables"]


def read_bytes(read_args) -> int:
    """Bytes the read must move: the matrix, or the K/V pages the segments' tables name."""
    if len(read_args) == 1:
        return read_args[0].size * read_args[0].dtype.itemsize
    kp, tables = read_args[1], read_args[6]
    page = kp.shape[1] * kp.shape[3] * kp.shape[4] * kp.dtype.itemsize  # one page of K, all heads
    return 2 * tables.size * page


def interleaved_us(programs: dict, args, reps: int, rounds: int) -> dict:
    """``{name: [us a round]}``: each round times every program once (median of ``reps`` calls), in
    the same order, so a GPU whose speed drifts during the run moves every program alike."""
    out = {name: [] for name in programs}
    for _ in range(rounds):
        for name, fn in programs.items():
            out[name].append(median_s(fn, args, reps) * 1e6)
    return out


def fill_record(rec: dict, rounds: dict) -> None:
    """A split's figures from ``interleaved_us``'s rounds: each program's median, and ``vs_serial``,
    the median of each round's together / serial (a drift in the GPU's speed between rounds moves
    both). A program the split lacks (``--read attention`` has one read program, whatever ``k``) is
    the every-SM one. A record with an ``error`` stays as it is."""
    if "error" in rec:
        return
    g, k = rec["G"], rec["k"]
    for name in ("gemm", "stream", *(f"both_{m.lower()}" for m in MODES)):
        key = (g, k, name) if (g, k, name) in rounds else name
        rec[f"{name}_us"] = statistics.median(rounds[key])
    per_round = [c / s for c, s in zip(rounds[(g, k, "both_concurrent")], rounds["serial"])]
    rec.update(vs_serial=statistics.median(per_round), vs_serial_rounds=per_round)


def compiler_options(mode: str) -> dict:
    # min graph size 1: a program of two launches still runs as one CUDA graph
    return {"xla_gpu_command_buffer_scheduling_mode": mode, "xla_gpu_graph_min_graph_size": 1}


def main(argv: Optional[Sequence[str]] = None) -> dict | None:
    from pallas_kernels import dispatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", nargs="*", default=["132:132", "108:24", "116:16", "100:32"])
    ap.add_argument("--scale", type=int, default=8, help="GEMM rows / 1024 and read bytes / 134 MB")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="passes over every program, interleaved")
    ap.add_argument("--read", choices=READS, default="stream")
    ap.add_argument("--seg-rows", type=int, default=128, help="--read attention: rows a segment")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    splits = [parse_split(s) for s in a.splits]
    if a.scale < 1:
        raise ValueError(f"--scale must be positive, got {a.scale}")
    if a.rounds < 1 or a.reps < 1:
        raise ValueError(f"--rounds and --reps must be positive, got {a.rounds} and {a.reps}")
    if a.seg_rows < 1 or ROWS % a.seg_rows:
        raise ValueError(f"--seg-rows must divide {ROWS}, got {a.seg_rows}")
    if not dispatch.hopper_available():
        print("sm_partition needs a Hopper GPU (TMA, wgmma): nothing measured")
        return None
    sms = jax.devices()[0].core_count
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (ROWS * a.scale, HIDDEN), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (HIDDEN, 2, INTER), jnp.bfloat16) * HIDDEN**-0.5
    reads = read_inputs(a.read, a.scale, jax.random.fold_in(key, 2), a.seg_rows)
    args = (x, w, *reads)

    def compiled(parts, g, k, mode="CONCURRENT"):
        return program(parts, g, k, a.read).lower(*args).compile(compiler_options=compiler_options(mode))

    # the engine's way: one program, the GEMM on every SM and then the read on every SM
    programs = {
        "serial": compiled("both", sms, sms, "LHS"),
        "gemm": compiled("gemm", sms, sms),
        "stream": compiled("stream", sms, sms),
    }
    records = []
    for g, k in splits:
        rec = dict(G=g, k=k)
        try:
            split = {"gemm": compiled("gemm", g, k)}
            if a.read == "stream":  # the attention ignores k: its program is the every-SM one
                split["stream"] = compiled("stream", g, k)
            split.update({f"both_{m.lower()}": compiled("both", g, k, m) for m in MODES})
            programs.update({(g, k, name): fn for name, fn in split.items()})
        except Exception as e:  # noqa: BLE001 - a split the GPU refuses is a record, not the end
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        records.append(rec)
    rounds = interleaved_us(programs, args, a.reps, a.rounds)
    serial = statistics.median(rounds["serial"])
    alone = dict(gemm_us=statistics.median(rounds["gemm"]), stream_us=statistics.median(rounds["stream"]))
    print(json.dumps(dict(serial_us=serial, serial_rounds_us=rounds["serial"], sms=sms, **alone)), flush=True)
    for rec in records:
        fill_record(rec, rounds)
        print(json.dumps(rec), flush=True)
    out = dict(
        benchmark="sm_partition",
        device=jax.devices()[0].device_kind,
        sms=sms,
        gemm_rows=ROWS * a.scale,
        gemm_flops=2 * ROWS * a.scale * HIDDEN * 2 * INTER,
        read=a.read,
        seg_rows=a.seg_rows if a.read == "attention" else None,
        stream_bytes=read_bytes(reads),
        rounds=a.rounds,
        serial_us=serial,
        serial_rounds_us=rounds["serial"],
        every_sm_alone=alone,
        records=records,
    )
    from benchmarks.run import save_json

    os.makedirs(a.out, exist_ok=True)
    name = "sm_partition.json" if a.read == "stream" else f"sm_partition_{a.read}{a.seg_rows}.json"
    save_json(out, os.path.join(a.out, name))
    return out


if __name__ == "__main__":
    main()
