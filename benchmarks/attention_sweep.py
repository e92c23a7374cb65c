"""Paged attention sweep on the GPU: our Pallas kernels vs cuDNN vs the jnp reference.

``ours_ms`` is the kernel the engine picks for the bucket (``pallas_kernels.dispatch``); prefill
shapes also time both Pallas kernels (``triton_ms``, ``mgpu_ms``: Triton- and Mosaic-GPU-lowered),
and every shape records ``selected_kernel`` and ``fastest_kernel``.

Ouro-1.4B heads: H = KVH = 16, head_dim 128, bf16, KV block 16, a stacked ``[L, KVH, NB, BS, hd]``
pool read through the layer index (as the engine does), block tables over a shuffled pool.

* decode: B rows (q_len 1) at context C, batch 1..256, context 512..32K (B*C capped by memory).
* prefill: n segments of ``chunk`` rows at context C (chunk 16..1024, C up to 32K); chunk == C is a
  fresh causal prompt.

cuDNN runs ``jax.nn.dot_product_attention(..., implementation="cudnn")`` on the dense equivalent
(each layer's context gathered once into ``[B, C, H, hd]``, one array per layer, outside timing).
For prefill chunks with history (chunk < C) cuDNN has no bottom-right causal mask, so it runs
non-causal over the whole context: it does ``chunk^2/2`` more work than needed (reported shapes
keep C >= 8 chunk, under 6%), which favours our kernel by that much.

Every shape is first checked: ours vs reference (relative L2 error) and vs cuDNN. Timing: jits
holding ``n`` and ``2n`` dependent calls (each call's output is the next call's query, layers cycled
so that the KV read each call is not L2-resident), 2 warm-ups, median of ``reps`` runs each
(``block_until_ready``); a call is ``(t(2n) - t(n)) / n``, which cancels the jit's launch (files
before run 19 divided ``t(n)`` by ``n``: their small decode figures carry ~10-20 us of it).
``ours_ms`` builds the work plan once per jit (the engine builds it once per step for all layers);
``ours_unplanned_ms`` (decode) rebuilds it per call.

Bucket mode (``--decode-bucket R[,R2]``): ``a`` active decode rows (``--decode-rows``) inside an
engine bucket of ``R`` rows and ``R`` segment slots (the rest padding, as the scheduler emits them),
at each ``--decode-ctx``: Triton with the engine's plan (built once per jit), every call the whole
attention (partials and merge): what the padding rows of a bucket cost. On a GPU each record also
holds ``kernel_us`` (CUPTI device time of each kernel of one call: the chain's per-call figure at 1K
moved by 2x between runs, run 38) and ``device_us`` / ``device_gbps``; on Hopper also the Mosaic
decode attention (``pallas_kernels/decode_attention_mgpu.py``): ``ms["decode_mgpu"]``,
``decode_mgpu_kernel_us`` and ``decode_mgpu_device_us``. Writes
DIR/attention_decode_buckets_<R>[_<R2>].json (and .png), also copied to benchmarks/results/,
instead of the sweep's files.

``--decode-knobs`` (with ``--decode-bucket``, GPU): each record also holds ``knobs``, the
kernels' device time at each of ``DECODE_KNOBS`` (split size, programs, pipeline, block and warps)
and its largest difference from the defaults' output, and ``empty_launch_us``: launches of the
same two grids that read nothing (what is launch, what is the chain of dependent reads).

Mosaic tuning mode (``--mgpu-tune``, Hopper only): the Mosaic kernel's pipeline (``block_kv`` x
steps in flight) on the segment shapes wavefront and split invocations emit (``MGPU_TUNE_SHAPES``),
each against one read of its K/V and its causal FLOPs. Writes DIR/attention_mgpu_tune.json
(records ``sweep: "mgpu_tuning"``) instead of the sweep's files.

Usage: PYTHONPATH=. python3 benchmarks/attention_sweep.py [--out DIR] [--quick] [--tune] [--mgpu-tune]
       [--decode-rows 1,8,32,128 --decode-ctx 512,1024,2048,4096,8192 --no-prefill]
       [--decode-bucket 8,16 --decode-rows 1,2,4,8,16 --decode-ctx 1024,4096 [--decode-knobs]]
Writes DIR/attention_sweep.json (and .png), also copied to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as pl_triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks import ceilings as ceilings_mod  # noqa: E402
from benchmarks.timing import kernels_us, per_call_s  # noqa: E402
from pallas_kernels import decode_attention_mgpu as decode_mgpu  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels import ragged_paged_attention_mgpu as mgpu  # noqa: E402
from pallas_kernels.ragged_paged_attention import (
    combine_heads,
    default_tuning,
    make_plan,  # noqa: E402
    programs_per_kv_head,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

H, KVH, HD, BS = 16, 16, 128, 16
DT = jnp.bfloat16
SCALE = HD**-0.5
KV_TOKEN_BYTES = KVH * HD * 2 * 2  # K and V, bf16
L2_DEFEAT_BYTES = 512 << 20
MAX_TOKENS = 4 << 20  # B*C cap: pool + dense copy + reference gather must fit
MAX_REF_TOKENS = 2 << 20

SMOKE = False
INTERPRET = False  # --smoke: CPU plumbing check in Pallas interpret mode, tiny shapes

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------


def build_case(key, n_seg, q_len, ctx):
    """n_seg segments of q_len rows at context ctx; layers so that the pool defeats L2."""
    mb = math.ceil(ctx / BS)
    kv_bytes = n_seg * mb * BS * KV_TOKEN_BYTES
    layers = int(min(8, max(1, math.ceil(L2_DEFEAT_BYTES / kv_bytes))))
    nb = n_seg * mb + 1  # + trash page 0
    k1, k2, k3, k4 = jax.random.split(key, 4)
    shape = (layers, KVH, nb, BS, HD)
    k_pages = jax.random.normal(k1, shape, DT)
    v_pages = jax.random.normal(k2, shape, DT)
    perm = np.random.default_rng(0).permutation(np.arange(1, nb)).astype(np.int32)
    tables = jnp.asarray(perm.reshape(n_seg, mb))
    r = n_seg * q_len
    q = jax.random.normal(k3, (r, H, HD), DT)
    seg = dict(
        q_start=jnp.arange(n_seg, dtype=jnp.int32) * q_len,
        q_len=jnp.full((n_seg,), q_len, jnp.int32),
        ctx_len=jnp.full((n_seg,), ctx, jnp.int32),
        tables=tables,
    )
    return dict(q=q, k=k_pages, v=v_pages, seg=seg, layers=layers, n_seg=n_seg, q_len=q_len, ctx=ctx)


@jax.jit
def _dense_layer(pages, tables):
    # pages [KVH, NB, BS, hd], tables [B, MB] -> [B, MB*BS, KVH, hd]
    d = pages[:, tables]  # [KVH, B, MB, BS, hd]
    kvh, b, mb, bs, hd = d.shape
    return jnp.transpose(d, (1, 2, 3, 0, 4)).reshape(b, mb * bs, kvh, hd)


def dense_kv(c):
    ks, vs = [], []
    for l in range(c["layers"]):
        ks.append(_dense_layer(c["k"][l], c["seg"]["tables"]))
        vs.append(_dense_layer(c["v"][l], c["seg"]["tables"]))
    return ks, vs


# ----------------------------------------------------------------------------------------------
# Callables (n_calls dependent calls in one jit)
# ----------------------------------------------------------------------------------------------


def ours_fn(n_calls, layers, tune, planned=True, kernel="triton"):
    tune = dict(tune or {})
    if kernel != "triton":  # "mgpu", "hybrid": through the dispatcher, as the engine runs them

        @jax.jit
        def g(q, k, v, qs, ql, cl, bt):
            attn = dispatch.AttentionKernel(kernel, q.shape[0], H, KVH, HD)
            plan = None
            if planned:
                plan = attn.plan(qs, ql, cl, bt)
            for i in range(n_calls):
                q = attn(q, k, v, qs, ql, cl, bt, layer=jnp.int32(i % layers), sm_scale=SCALE, plan=plan)
            return q

        return g

    @jax.jit
    def f(q, k, v, qs, ql, cl, bt):
        plan = None
        if planned:
            t = default_tuning(q.shape[0], ql.shape[0], H, KVH, HD, **tune)
            plan = make_plan(qs, ql, cl, num_rows=q.shape[0], num_q_per_kv=H // KVH, tuning=t)
        for i in range(n_calls):
            q = ragged_paged_attention(
                q,
                k,
                v,
                qs,
                ql,
                cl,
                bt,
                layer=jnp.int32(i % layers),
                sm_scale=SCALE,
                plan=plan,
                interpret=INTERPRET,
                **tune,
            )
        return q

    return f


def ref_fn(n_calls, layers):
    @jax.jit
    def f(q, k, v, qs, ql, cl, bt):
        for i in range(n_calls):
            q = ragged_paged_attention_reference(q, k, v, qs, ql, cl, bt, layer=jnp.int32(i % layers), sm_scale=SCALE)
        return q

    return f


def cudnn_fn(n_calls, layers, n_seg, q_len, causal):
    @jax.jit
    def f(q, ks, vs):
        for i in range(n_calls):
            qb = q.reshape(n_seg, q_len, H, HD)
            o = jax.nn.dot_product_attention(
                qb, ks[i % layers], vs[i % layers], scale=SCALE, is_causal=causal, implementation="cudnn"
            )
            q = o.reshape(n_seg * q_len, H, HD)
        return q

    return f


def timeit(make, args, n_calls, reps):
    """ms per call of the chain ``make(n)`` (``benchmarks.timing.per_call_s``: the jit's launch
    cancelled)."""
    return per_call_s(make, args, n_calls, reps) * 1e3


def rel_err(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if not np.isfinite(a).all():
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------


def useful_flops(n_seg, q_len, ctx):
    # QK^T and PV, causal: row i attends ctx - q_len + i + 1 keys
    keys = n_seg * (q_len * (ctx - q_len) + q_len * (q_len + 1) / 2)
    return 4.0 * H * HD * keys


DECODE_VARIANTS = {
    "no_prefetch": dict(prefetch=False),
    "mma_bq16_bk64": dict(block_q=16, block_k=64, num_warps=4, num_stages=3),
    "bk64_nw8": dict(block_k=64, num_warps=8),
}
PREFILL_VARIANTS = {
    "bq128_bk64": dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
    "bq128_bk128": dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
    "min_split_512": dict(min_split_tokens=512),
    "bq64_bk64": dict(block_q=64, block_k=64, num_warps=4, num_stages=2),
}
VARIANT_SHAPES = {
    ("decode", 1, 1, 2048),
    ("decode", 8, 1, 8192),
    ("decode", 32, 1, 8192),
    ("decode", 128, 1, 2048),
    ("decode", 256, 1, 2048),
    ("decode", 1, 1, 32768),
    ("prefill", 4, 16, 8192),
    ("prefill", 1, 1024, 8192),
    ("prefill", 4, 2048, 2048),
    ("prefill", 1, 1024, 32768),
}


def run_shape(
    kind, n_seg, q_len, ctx, *, key, reps, tune=None, with_ref=True, with_cudnn=True, unplanned=False, variants=None
):
    c = build_case(key, n_seg, q_len, ctx)
    layers = c["layers"]
    kv_bytes = n_seg * ctx * KV_TOKEN_BYTES
    est_ms = kv_bytes / 3e9 + (useful_flops(n_seg, q_len, ctx) / 3e11 if kind == "prefill" else 0)
    n_calls = max(c["layers"], 16 if est_ms < 0.2 else (4 if est_ms < 5 else 2))
    args = (c["q"], c["k"], c["v"], c["seg"]["q_start"], c["seg"]["q_len"], c["seg"]["ctx_len"], c["seg"]["tables"])
    rec = dict(
        kind=kind,
        shape=dict(
            n_seg=n_seg,
            q_len=q_len,
            ctx=ctx,
            rows=n_seg * q_len,
            heads=H,
            kv_heads=KVH,
            head_dim=HD,
            block_size=BS,
            dtype="bfloat16",
            layers_in_pool=c["layers"],
        ),
        n_calls=n_calls,
        tuning=dict(tune or {}),
        default_tuning=vars(default_tuning(n_seg * q_len, n_seg, H, KVH, HD)),
    )
    # Which Pallas kernel the engine would pick for this bucket; prefill shapes time both prefill
    # kernels (decode rows never go to the prefill Mosaic kernel: one row per 128-row tile).
    selected = "triton" if tune else dispatch.select_kernel(n_seg * q_len, n_seg, DT, HD, BS, num_heads=H)
    kernels = ["triton"]
    if not tune and kind == "prefill" and dispatch.hopper_available():
        kernels.append("mgpu")
    if selected not in kernels:
        kernels.append(selected)
    rec["selected_kernel"] = selected
    # correctness first (one call, layer 0)
    try:
        out = ours_fn(1, c["layers"], tune, kernel=selected)(*args)
    except Exception as e:  # noqa: BLE001  (the record says so; the other kernel is still timed)
        rec["selected_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"  selected kernel {selected} failed: {rec['selected_error']}")
        out = ours_fn(1, c["layers"], tune, kernel="triton")(*args)
        kernels = [k for k in kernels if k != selected]
    ref_out = None
    ks = vs = None
    if with_ref and n_seg * ctx <= MAX_REF_TOKENS:
        ref_out = ref_fn(1, c["layers"])(*args)
        rec["err_vs_reference"] = rel_err(out, ref_out)
    if with_cudnn:
        ks, vs = dense_kv(c)
        causal = kind == "prefill" and q_len == ctx
        rec["cudnn_mask"] = (
            "causal"
            if causal
            else (
                "none (decode: every key visible)"
                if kind == "decode"
                else "none over the whole context (over-counts chunk^2/2)"
            )
        )
        try:
            cd = cudnn_fn(1, c["layers"], n_seg, q_len, causal)
            cd_out = cd(c["q"], ks, vs)
            if kind == "decode" or causal:
                rec["err_vs_cudnn"] = rel_err(out, cd_out)
        except Exception as e:  # noqa: BLE001
            rec["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            with_cudnn = False
    errs = [rec.get("err_vs_reference"), rec.get("err_vs_cudnn")]
    rec["correct"] = all(e is None or e < 2e-2 for e in errs) and any(e is not None for e in errs)
    if not rec["correct"]:
        log(f"  !! correctness check failed: {errs}")

    for kern in kernels:
        try:
            if kern != selected and with_ref and rec.get("err_vs_reference") is not None:
                rec[f"{kern}_err_vs_reference"] = rel_err(ours_fn(1, c["layers"], tune, kernel=kern)(*args), ref_out)
            rec[f"{kern}_ms"] = timeit(lambda n: ours_fn(n, layers, tune, kernel=kern), args, n_calls, reps)
        except Exception as e:  # noqa: BLE001
            rec[f"{kern}_ms"] = None
            rec[f"{kern}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  kernel {kern} failed: {rec[f'{kern}_error']}")
    rec["ours_ms"] = rec.get(f"{selected}_ms") or rec.get("triton_ms")
    timed = {k: rec[f"{k}_ms"] for k in kernels if rec.get(f"{k}_ms")}
    rec["fastest_kernel"] = min(timed, key=timed.get) if timed else None
    if variants:
        rec["variants_ms"] = {}
        for name, t in variants.items():
            try:
                rec["variants_ms"][name] = timeit(lambda n, t=t: ours_fn(n, layers, t), args, n_calls, min(reps, 5))
            except Exception as e:  # noqa: BLE001
                rec["variants_ms"][name] = None
                log(f"  variant {name} failed: {type(e).__name__}: {str(e)[:200]}")
    if unplanned:
        rec["ours_unplanned_ms"] = timeit(lambda n: ours_fn(n, layers, tune, planned=False), args, n_calls, reps)
    rec["cudnn_ms"] = None
    if with_cudnn:
        rec["cudnn_ms"] = timeit(
            lambda n: cudnn_fn(n, layers, n_seg, q_len, rec["cudnn_mask"] == "causal"), (c["q"], ks, vs), n_calls, reps
        )
    rec["reference_ms"] = None
    if ref_out is not None:
        nr = min(n_calls, 4)
        rec["reference_ms"] = timeit(lambda n: ref_fn(n, layers), args, nr, max(3, reps // 2))
    if kind == "decode":
        rec["gbps"] = kv_bytes / (rec["ours_ms"] * 1e-3) / 1e9
        if rec["cudnn_ms"]:
            rec["cudnn_gbps"] = kv_bytes / (rec["cudnn_ms"] * 1e-3) / 1e9
    else:
        fl = useful_flops(n_seg, q_len, ctx)
        rec["tflops"] = fl / (rec["ours_ms"] * 1e-3) / 1e12
        rec["gbps"] = kv_bytes / (rec["ours_ms"] * 1e-3) / 1e9
        if rec["cudnn_ms"]:
            rec["cudnn_tflops"] = fl / (rec["cudnn_ms"] * 1e-3) / 1e12
    rec["ratio_to_cudnn"] = (rec["cudnn_ms"] / rec["ours_ms"]) if rec["cudnn_ms"] else None
    del c, ks, vs, out, ref_out
    gc.collect()
    return rec


# ----------------------------------------------------------------------------------------------
# Sweep, tuning, ceilings
# ----------------------------------------------------------------------------------------------


def decode_shapes(quick, rows=None, ctxs=None):
    if rows or ctxs:
        rows = rows or (1, 8, 32, 128, 256)
        ctxs = ctxs or (512, 2048, 8192, 32768)
        return [(b, c) for b in rows for c in ctxs if b * c <= MAX_TOKENS]
    if SMOKE:
        return [(2, 64)]
    if quick:
        return [(1, 2048), (8, 8192), (64, 4096), (256, 2048)]
    out = []
    for b in (1, 8, 32, 128, 256):
        for c in (512, 2048, 8192, 32768):
            if b * c <= MAX_TOKENS:
                out.append((b, c))
    return out


def prefill_shapes(quick):
    if SMOKE:
        return [(1, 16, 64)]
    if quick:
        return [(4, 16, 8192), (1, 1024, 8192), (4, 2048, 2048)]
    return [
        (4, 16, 8192),
        (1, 16, 32768),
        (4, 128, 8192),
        (1, 256, 32768),
        (1, 1024, 1024),
        (1, 1024, 8192),
        (1, 1024, 32768),
        (4, 2048, 2048),
    ]


def measure_ceilings():
    out = {}
    try:
        out["copy_tbps_read_plus_write"] = ceilings_mod.copy_bandwidth() / 1e12
    except Exception as e:  # noqa: BLE001
        out["copy_error"] = str(e)[:200]
    return out


def tune(key, reps):
    """Time tuning variants on representative shapes; returns records (not part of the sweep)."""
    dec = [
        dict(block_q=1, block_k=bk, num_warps=nw, num_stages=2)
        for bk, nw in ((32, 4), (64, 4), (128, 4), (64, 8), (128, 8))
    ]
    dec += [dict(block_q=16, block_k=bk, num_warps=4, num_stages=ns) for bk, ns in ((32, 3), (64, 3), (128, 2))]
    pre = [
        dict(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns)
        for bq, bk, nw, ns in (
            (64, 64, 4, 2),
            (64, 64, 8, 3),
            (64, 32, 8, 3),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 32, 8, 3),
            (128, 128, 8, 2),
            (64, 128, 8, 2),
        )
    ]
    shapes = [
        ("decode", 8, 1, 8192, dec),
        ("decode", 128, 1, 2048, dec),
        ("decode", 1, 1, 32768, dec[:3] + [dict(target_programs=t) for t in (512, 2048)]),
        ("prefill", 1, 1024, 8192, pre),
        ("prefill", 4, 2048, 2048, pre),
    ]
    recs = []
    for kind, n, ql, ctx, variants in shapes:
        c = build_case(key, n, ql, ctx)
        layers = c["layers"]
        args = (c["q"], c["k"], c["v"], c["seg"]["q_start"], c["seg"]["q_len"], c["seg"]["ctx_len"], c["seg"]["tables"])
        kv_bytes = n * ctx * KV_TOKEN_BYTES
        n_calls = max(c["layers"], 8)
        for t in variants:
            try:
                ms = timeit(lambda n, t=t: ours_fn(n, layers, t), args, n_calls, reps)
                r = dict(
                    kind=kind,
                    shape=dict(n_seg=n, q_len=ql, ctx=ctx),
                    tuning=t,
                    ours_ms=ms,
                    gbps=kv_bytes / (ms * 1e-3) / 1e9,
                    tflops=useful_flops(n, ql, ctx) / (ms * 1e-3) / 1e12,
                )
                recs.append(r)
                log(f"tune {kind} {n}x{ql}@{ctx} {t}: {ms:.4f} ms ({r['gbps']:.0f} GB/s, {r['tflops']:.1f} TF/s)")
            except Exception as e:  # noqa: BLE001
                log(f"tune {kind} {n}x{ql}@{ctx} {t} FAILED: {type(e).__name__}: {str(e)[:300]}")
        del c, args
        gc.collect()
    return recs


# (segments, rows each, context): wavefront chunks of 128 and 64 rows at 4K, split chunks of 1024 at
# 8K, 2048-row prompts; (block_kv, steps in flight) pairs, the default first
MGPU_TUNE_SHAPES = ((8, 128, 4096), (16, 64, 4096), (4, 1024, 8192), (2, 2048, 4096))
MGPU_TUNE_PIPELINES = ((mgpu.BLOCK_KV, mgpu.MAX_CONCURRENT_STEPS), (128, 3), (64, 2), (64, 3), (64, 4))


def mgpu_fn(n_calls, layers, block_kv, steps):
    @jax.jit
    def f(q, k, v, qs, ql, cl, bt):
        packing = mgpu.make_packing(qs, ql, cl, bt, num_rows=q.shape[0])
        for i in range(n_calls):
            q = mgpu.ragged_paged_attention_mgpu(
                q, k, v, qs, ql, cl, bt, layer=jnp.int32(i % layers), sm_scale=SCALE, block_kv=block_kv,
                max_concurrent_steps=steps, packing=packing,
            )  # fmt: skip
        return q

    return f


def mgpu_tune(key, reps):
    """The Mosaic kernel's pipelines on ``MGPU_TUNE_SHAPES``: ms a call, TB/s of one K/V read,
    causal TFLOP/s, and the largest difference from the default pipeline's output."""
    recs = []
    for n, ql, ctx in MGPU_TUNE_SHAPES:
        c = build_case(key, n, ql, ctx)
        args = (c["q"], c["k"], c["v"], c["seg"]["q_start"], c["seg"]["q_len"], c["seg"]["ctx_len"], c["seg"]["tables"])
        layers, first = c["layers"], None
        for bk, st in MGPU_TUNE_PIPELINES:
            shape = dict(n_seg=n, q_len=ql, ctx=ctx)
            rec = dict(sweep="mgpu_tuning", kind="prefill", block_kv=bk, stages=st, shape=shape)
            try:
                out = mgpu_fn(1, layers, bk, st)(*args).astype(jnp.float32)
                first = out if first is None else first
                ms = timeit(lambda m, bk=bk, st=st: mgpu_fn(m, layers, bk, st), args, max(layers, 8), reps)
                rec.update(
                    ms=ms,
                    tb_s=n * ctx * KV_TOKEN_BYTES / (ms * 1e-3) / 1e12,
                    tflops=useful_flops(n, ql, ctx) / (ms * 1e-3) / 1e12,
                    max_abs_diff_vs_default=float(jnp.max(jnp.abs(out - first))),
                )
                speed = f"{rec['tb_s']:.2f} TB/s, {rec['tflops']:.0f} TF/s"
                log(f"mgpu {n}x{ql}@{ctx} block_kv {bk} x {st}: {ms:.4f} ms ({speed})")
            except Exception as e:  # noqa: BLE001  (the record says so; the other pipelines still run)
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"mgpu {n}x{ql}@{ctx} block_kv {bk} x {st} FAILED: {rec['error']}")
            recs.append(rec)
        del c, args
        gc.collect()
    return recs


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"no plot: {e}")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    dec = [r for r in records if r["kind"] == "decode" and r.get("ratio_to_cudnn")]
    for b in sorted({r["shape"]["n_seg"] for r in dec}):
        rs = sorted((r for r in dec if r["shape"]["n_seg"] == b), key=lambda r: r["shape"]["ctx"])
        axes[0].plot([r["shape"]["ctx"] for r in rs], [r["gbps"] for r in rs], "o-", label=f"ours B={b}")
        axes[0].plot([r["shape"]["ctx"] for r in rs], [r["cudnn_gbps"] for r in rs], "x--", label=f"cuDNN B={b}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("context")
    axes[0].set_ylabel("KV GB/s")
    axes[0].set_title("decode (H=KVH=16, hd=128, bf16)")
    axes[0].legend(fontsize=6, ncol=2)
    pre = [r for r in records if r["kind"] == "prefill" and r.get("ratio_to_cudnn")]
    labels = [f"{r['shape']['n_seg']}x{r['shape']['q_len']}@{r['shape']['ctx']}" for r in pre]
    x = np.arange(len(pre))
    axes[1].bar(x - 0.2, [r["tflops"] for r in pre], 0.4, label="ours")
    axes[1].bar(x + 0.2, [r["cudnn_tflops"] for r in pre], 0.4, label="cuDNN")
    axes[1].set_xticks(x, labels, rotation=30, fontsize=7)
    axes[1].set_ylabel("useful TFLOP/s")
    axes[1].set_title("prefill segments")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def table(records):
    lines = [
        f"{'kind':8} {'shape':22} {'ours ms':>9} {'cudnn ms':>9} {'ref ms':>9} "
        f"{'ours':>10} {'cudnn':>10} {'ratio':>6} {'err':>8} {'triton ms':>9} {'mgpu ms':>9}"
    ]
    for r in records:
        s = r["shape"]
        shp = f"{s['n_seg']}x{s['q_len']}@{s['ctx']}"
        unit = "TF/s" if r["kind"] == "prefill" else "GB/s"
        ours = r.get("tflops") if r["kind"] == "prefill" else r.get("gbps")
        cud = r.get("cudnn_tflops") if r["kind"] == "prefill" else r.get("cudnn_gbps")
        f = lambda v, w=9, p=4: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        err = r.get("err_vs_reference", r.get("err_vs_cudnn"))
        lines.append(
            f"{r['kind']:8} {shp:22} {f(r['ours_ms'])} {f(r['cudnn_ms'])} "
            f"{f(r['reference_ms'])} {f(ours, 6, 0)} {unit} {f(cud, 6, 0)} {unit} "
            f"{f(r['ratio_to_cudnn'], 6, 2)} {f(err, 8, 5)} {f(r.get('triton_ms'))} {f(r.get('mgpu_ms'))}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Bucket mode: a active decode rows in an R-row engine bucket
# ----------------------------------------------------------------------------------------------


def bucket_case(key, bucket, active, ctx):
    """``active`` decode rows at context ``ctx`` in a bucket of ``bucket`` rows and segment slots."""
    if not 1 <= active <= bucket:
        raise ValueError(f"{active} active rows do not fit a bucket of {bucket}")
    c = build_case(key, active, 1, ctx)
    pad = bucket - active
    c["q"] = jnp.pad(c["q"], ((0, pad), (0, 0), (0, 0)))
    zeros = jnp.zeros((pad,), jnp.int32)
    seg = c["seg"]
    seg["q_start"] = jnp.concatenate([seg["q_start"], zeros])
    seg["q_len"] = jnp.concatenate([seg["q_len"], zeros])
    seg["ctx_len"] = jnp.concatenate([seg["ctx_len"], zeros])
    seg["tables"] = jnp.concatenate([seg["tables"], jnp.zeros((pad, seg["tables"].shape[1]), jnp.int32)])
    return c


def call_args(c) -> tuple:
    """A case's arguments of one attention call: ``(q, k, v, q_start, q_len, ctx_len, tables)``."""
    seg = c["seg"]
    return (c["q"], c["k"], c["v"], seg["q_start"], seg["q_len"], seg["ctx_len"], seg["tables"])


def run_bucket(bucket, active, ctx, *, key, reps, knobs=False):
    c = bucket_case(key, bucket, active, ctx)
    args = call_args(c)
    n_calls = max(c["layers"], 16)
    kv_bytes = active * ctx * KV_TOKEN_BYTES
    rec = dict(
        kind="decode_bucket",
        shape=dict(bucket=bucket, active=active, ctx=ctx, heads=H, kv_heads=KVH, head_dim=HD, block_size=BS),
        layers_in_pool=c["layers"],
        n_calls=n_calls,
        kv_bytes=kv_bytes,
    )
    layers = c["layers"]
    ref = ref_fn(1, layers)(*args)
    fns = {"triton": lambda n: ours_fn(n, layers, None, kernel="triton")}
    if dispatch.hopper_available():
        fns["decode_mgpu"] = lambda n: decode_fn(n, layers)
    rec["ms"], rec["err_vs_reference"], rec["errors"] = {}, {}, {}
    for name, make in fns.items():
        try:
            rec["err_vs_reference"][name] = rel_err(make(1)(*args)[:active], ref[:active])
            rec["ms"][name] = timeit(make, args, n_calls, reps)
        except Exception as e:  # noqa: BLE001  (the record says so)
            rec["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  {name} failed: {rec['errors'][name]}")
    timed = {k: v for k, v in rec["ms"].items() if v}
    rec["gbps"] = {k: kv_bytes / (v * 1e-3) / 1e9 for k, v in timed.items()}
    if not INTERPRET:  # CUPTI: each kernel's device time, the engine's plan built once outside
        try:
            rec["kernel_us"] = bucket_kernels_us(args, reps=max(reps, 20))
            rec["device_us"] = sum(rec["kernel_us"].values())
            rec["device_gbps"] = kv_bytes / (rec["device_us"] * 1e-6) / 1e9
        except Exception as e:  # noqa: BLE001  (the record says so)
            rec["errors"]["kernel_us"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "decode_mgpu" in rec["ms"]:
            try:
                rec["decode_mgpu_kernel_us"] = decode_kernels_us(args, reps=max(reps, 20))
                rec["decode_mgpu_device_us"] = sum(rec["decode_mgpu_kernel_us"].values())
            except Exception as e:  # noqa: BLE001  (the record says so)
                rec["errors"]["decode_mgpu_kernel_us"] = f"{type(e).__name__}: {str(e)[:300]}"
        if knobs:
            rec["knobs"] = bucket_knob_records(args, active, reps=max(reps, 20))
            try:
                rec["empty_launch_us"] = kernels_us(empty_launches(args), iters=max(reps, 20))
            except Exception as e:  # noqa: BLE001  (the record says so)
                rec["errors"]["empty_launch_us"] = f"{type(e).__name__}: {str(e)[:300]}"
    del c, args, ref
    gc.collect()
    return rec


# ``--decode-knobs``: the Triton kernel's knobs around a decode bucket's defaults. Run 45's context
# sweep (docs/roadmap.md) put ~4-5 us of each one-row call in fixed cost (launch, the plan -> block
# table -> K/V chain, the combine launch): which knobs move it.
DECODE_KNOBS = (
    dict(min_split_tokens=64),
    dict(min_split_tokens=256),
    dict(min_split_tokens=1024),
    dict(min_split_tokens=8192),  # one item a row: kernel 1 writes it, the combine finds nothing to merge
    dict(target_programs=128),
    dict(target_programs=256),
    dict(target_programs=384),
    dict(target_programs=2048),
    dict(num_stages=2),
    dict(num_stages=4),
    dict(block_k=32),
    dict(block_k=128),
    dict(num_warps=8),
)


def _planned_call(args, knobs: dict):
    """``(fn, fn's args)``: one Triton call with its plan built once outside, at ``knobs``."""
    q, k, v, qs, ql, cl, bt = args
    t = default_tuning(q.shape[0], ql.shape[0], H, KVH, HD, **knobs)
    plan = jax.jit(lambda *a: make_plan(*a, num_rows=q.shape[0], num_q_per_kv=H // KVH, tuning=t))(qs, ql, cl)

    @jax.jit
    def one(q, k, v, plan, qs, ql, cl, bt):
        return ragged_paged_attention(
            q, k, v, qs, ql, cl, bt, layer=jnp.int32(0), sm_scale=SCALE, plan=plan, interpret=INTERPRET, **knobs
        )

    return one, (q, k, v, plan, qs, ql, cl, bt)


def bucket_kernels_us(args, *, reps):
    """Device time (us) of each kernel of one planned Triton call (attention, combine), by name."""
    one, call_args = _planned_call(args, {})
    return kernels_us(one, *call_args, iters=reps)


def decode_fn(n_calls, layers):
    """``n_calls`` dependent calls of the Mosaic decode attention, its plan built once (as the
    engine shares it between layers)."""

    @jax.jit
    def f(q, k, v, qs, ql, cl, bt):
        plan = decode_mgpu.make_decode_plan(qs, ql, cl, bt, num_rows=q.shape[0], num_kv_heads=KVH)
        for i in range(n_calls):
            q = decode_mgpu.decode_attention_mgpu(
                q, k, v, qs, ql, cl, bt, layer=jnp.int32(i % layers), sm_scale=SCALE, plan=plan
            )
        return q

    return f


def decode_kernels_us(args, *, reps):
    """Device time (us) of each kernel of one Mosaic decode attention call, its plan built outside."""
    q, k, v, qs, ql, cl, bt = args
    plan = jax.jit(lambda *a: decode_mgpu.make_decode_plan(*a, num_rows=q.shape[0], num_kv_heads=KVH))(qs, ql, cl, bt)

    @jax.jit
    def one(q, k, v, plan, qs, ql, cl, bt):
        return decode_mgpu.decode_attention_mgpu(q, k, v, qs, ql, cl, bt, layer=jnp.int32(0), sm_scale=SCALE, plan=plan)

    return kernels_us(one, q, k, v, plan, qs, ql, cl, bt, iters=reps)


def empty_launches(args, *, interpret: bool = False):
    """A jitted call of two Triton launches that only write a zero row a program, one on the
    defaults' kernel-1 grid ``(programs, KV heads)`` and one on the combine's: what a call costs
    before it reads anything (``--decode-knobs`` records their device time as ``empty_launch_us``)."""
    q, _, _, _, ql, _, _ = args
    rows = q.shape[0]
    t = default_tuning(rows, ql.shape[0], H, KVH, HD)
    plan = _planned_call(args, {})[1][3]
    grids = {
        "empty_attention_grid": ((programs_per_kv_head(plan.items.shape[0], KVH, t.max_programs), KVH), t.num_warps),
        "empty_combine_grid": ((rows, -(-H // combine_heads(rows, H))), t.combine_warps),
    }

    def zero(o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    def launch(name):
        grid, warps = grids[name]
        return pl.pallas_call(
            zero,
            grid=grid,
            out_specs=pl.BlockSpec((None, None, 16), lambda i, j: (i, j, 0)),
            out_shape=jax.ShapeDtypeStruct((*grid, 16), jnp.float32),
            compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=1),
            interpret=interpret,
            name=name,
        )()

    return jax.jit(lambda: tuple(launch(name) for name in grids))


def bucket_knob_records(args, active: int, *, reps, timed: bool = True) -> list[dict]:
    """Each of ``DECODE_KNOBS``: its kernels' device time (``timed``: CUPTI, GPU only) and its
    largest difference from the defaults' output on the active rows (knobs change the order of
    accumulation only)."""
    base_fn, base_args = _planned_call(args, {})
    base = np.asarray(base_fn(*base_args)[:active].astype(jnp.float32))
    out = []
    for knobs in DECODE_KNOBS:
        rec = dict(knobs=knobs)
        try:
            one, call_args = _planned_call(args, knobs)
            got = np.asarray(one(*call_args)[:active].astype(jnp.float32))
            rec["max_abs_diff"] = float(np.abs(got - base).max())
            if timed:
                rec["kernel_us"] = kernels_us(one, *call_args, iters=reps)
                rec["device_us"] = sum(rec["kernel_us"].values())
        except Exception as e:  # noqa: BLE001  (the record says so)
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(rec)
    return out


def plot_buckets(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"no plot: {e}")
        return
    panels = sorted({(r["shape"]["bucket"], r["shape"]["ctx"]) for r in records})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for ax, (bucket, ctx) in zip(axes[0], panels):
        rs = sorted((r for r in records if (r["shape"]["bucket"], r["shape"]["ctx"]) == (bucket, ctx)),
                    key=lambda r: r["shape"]["active"])  # fmt: skip
        for name in sorted({k for r in rs for k in r["ms"]}):
            pts = [(r["shape"]["active"], r["ms"][name] * 1e3) for r in rs if r["ms"].get(name)]
            ax.plot(*zip(*pts), "o-", label=name, lw=2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("active rows")
        ax.set_ylabel("us per attention call")
        ax.set_title(f"bucket {bucket} rows, context {ctx}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def bucket_main(args, key, reps, dev, t_start):
    rows = args.decode_rows or (1, 2, 4, 8, 16)
    ctxs = args.decode_ctx or (1024, 4096)
    todo = [(b, a, c) for b in args.decode_bucket for c in ctxs for a in rows if a <= b]
    records = []
    stem = "attention_decode_buckets_" + "_".join(str(b) for b in args.decode_bucket)
    path = os.path.join(args.out, stem + ".json")

    def dump(final):
        with open(path, "w") as fh:
            json.dump(
                dict(
                    workload="decode_bucket",
                    device=dev.device_kind,
                    jax_version=jax.__version__,
                    backend=jax.default_backend(),
                    complete=final,
                    records=records,
                    wall_s=time.time() - t_start,
                ),
                fh,
                indent=1,
            )

    for b, a, c in todo:
        t0 = time.time()
        try:
            rec = run_bucket(b, a, c, key=key, reps=reps, knobs=args.decode_knobs)
        except Exception as e:  # noqa: BLE001
            log(f"bucket {b} active {a} @{c} FAILED: {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc()
            rec = dict(kind="decode_bucket", shape=dict(bucket=b, active=a, ctx=c), error=str(e)[:500], ms={})
        records.append(rec)
        times = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rec["ms"].items() if v)
        kern = ", ".join(
            f"{k} {v:.2f}" for k, v in {**rec.get("kernel_us", {}), **rec.get("decode_mgpu_kernel_us", {})}.items()
        )
        log(f"bucket {b} active {a} @{c}: us {times}; device us {kern} ({time.time() - t0:.1f} s)")
        dump(False)
    dump(True)
    plot_buckets([r for r in records if r.get("ms")], os.path.join(args.out, stem + ".png"))
    if not args.no_copy and os.path.abspath(args.out) != os.path.abspath(RESULTS_DIR):
        os.makedirs(RESULTS_DIR, exist_ok=True)
        for name in (stem + ".json", stem + ".png"):
            src = os.path.join(args.out, name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(RESULTS_DIR, name))
    log(f"wrote {path} in {time.time() - t_start:.0f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time tuning variants first")
    ap.add_argument("--mgpu-tune", action="store_true", help="only the Mosaic kernel's pipelines (Hopper)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--variants", action="store_true", help="also time other tilings on a few shapes (variants_ms)")
    ap.add_argument("--no-copy", action="store_true", help="do not copy to benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="CPU plumbing check (interpret mode)")
    ints = lambda s: tuple(int(x) for x in s.split(",") if x.strip())  # noqa: E731
    ap.add_argument("--decode-rows", type=ints, default=None, help="decode batch sizes, e.g. 1,8,32,128")
    ap.add_argument("--decode-ctx", type=ints, default=None, help="decode contexts, e.g. 512,1024,4096")
    ap.add_argument("--no-prefill", action="store_true", help="decode shapes only")
    ap.add_argument(
        "--decode-bucket", type=ints, default=None, help="bucket mode: active rows (--decode-rows) in buckets of R rows"
    )
    ap.add_argument(
        "--decode-knobs", action="store_true", help="bucket mode, GPU: also each of DECODE_KNOBS' device time"
    )
    args = ap.parse_args()
    global INTERPRET, SMOKE
    if args.smoke:
        INTERPRET = SMOKE = True
        args.no_copy = True
    os.makedirs(args.out, exist_ok=True)
    reps = args.reps or (5 if args.quick else 7)
    key = jax.random.PRNGKey(0)
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    t_start = time.time()
    if args.decode_bucket:
        return bucket_main(args, key, reps, dev, t_start)
    if args.mgpu_tune:
        if not dispatch.hopper_available():
            raise SystemExit("--mgpu-tune needs a Hopper GPU: the Mosaic kernel has no CPU mode")
        path = os.path.join(args.out, "attention_mgpu_tune.json")
        recs = mgpu_tune(key, reps)
        with open(path, "w") as fh:
            json.dump(dict(device=dev.device_kind, jax_version=jax.__version__, records=recs), fh, indent=1)
        return log(f"wrote {path} in {time.time() - t_start:.0f} s")
    ceilings = measure_ceilings()
    log(f"ceilings: {ceilings}")

    if args.tune:
        recs = tune(key, reps)
        with open(os.path.join(args.out, "attention_tune.json"), "w") as fh:
            json.dump(dict(device=dev.device_kind, jax_version=jax.__version__, records=recs), fh, indent=1)
        log(f"tuning done in {time.time() - t_start:.0f} s")

    records = []
    path = os.path.join(args.out, "attention_sweep.json")

    def dump(final):
        result = dict(
            device=dev.device_kind,
            jax_version=jax.__version__,
            backend=jax.default_backend(),
            ceilings=ceilings,
            quick=args.quick,
            complete=final,
            records=records,
            wall_s=time.time() - t_start,
        )
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)

    todo = [("decode", b, 1, c) for b, c in decode_shapes(args.quick, args.decode_rows, args.decode_ctx)]
    if not args.no_prefill:
        todo += [("prefill", n, q, c) for n, q, c in prefill_shapes(args.quick)]
    for kind, n, q, c in todo:
        t0 = time.time()
        try:
            variants = None
            if args.variants and (kind, n, q, c) in VARIANT_SHAPES:
                variants = DECODE_VARIANTS if kind == "decode" else PREFILL_VARIANTS
            rec = run_shape(kind, n, q, c, key=key, reps=reps, unplanned=(kind == "decode"), variants=variants)
            records.append(rec)
            if rec.get("variants_ms"):
                log(
                    "  variants: " + ", ".join(f"{k} {v:.4f}" if v else f"{k} -" for k, v in rec["variants_ms"].items())
                )
            others = ", ".join(f"{k[:-3]} {rec[k]:.4f}" for k in ("triton_ms", "mgpu_ms") if rec.get(k))
            log(
                f"{kind} {n}x{q}@{c}: ours {rec['ours_ms']:.4f} ms ({others}), cudnn {rec['cudnn_ms']}, "
                f"ratio {rec['ratio_to_cudnn']}, err {rec.get('err_vs_reference')}/"
                f"{rec.get('err_vs_cudnn')} ({time.time() - t0:.1f} s)"
            )
        except Exception as e:  # noqa: BLE001
            log(f"{kind} {n}x{q}@{c} FAILED: {type(e).__name__}: {str(e)[:500]}")
            traceback.print_exc()
            records.append(
                dict(
                    kind=kind,
                    shape=dict(n_seg=n, q_len=q, ctx=c),
                    error=str(e)[:500],
                    ours_ms=None,
                    cudnn_ms=None,
                    reference_ms=None,
                    ratio_to_cudnn=None,
                )
            )
        dump(False)  # partial results survive a time limit

    dump(True)
    plot([r for r in records if r.get("ours_ms")], os.path.join(args.out, "attention_sweep.png"))
    if not args.no_copy and os.path.abspath(args.out) != os.path.abspath(RESULTS_DIR):
        os.makedirs(RESULTS_DIR, exist_ok=True)
        for name in ("attention_sweep.json", "attention_sweep.png"):
            src = os.path.join(args.out, name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(RESULTS_DIR, name))
    log(table([r for r in records if r.get("ours_ms")]))
    log(f"wrote {path} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
