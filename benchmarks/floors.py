"""Floors: the least time any engine needs for a schedule (bytes / bandwidth vs FLOPs / peak).

The model of docs/performance.md, for any ``OuroConfig`` and the loops actually run: a recurrent
invocation reads every layer weight once whatever its rows; every prompt segment or decode row reads
the K/V of its whole context at its plane once per layer; matmuls and attention cost FLOPs. Use the
ceilings measured in the same run (``benchmarks/ceilings.py``).

``prefill_floor`` also gives a *sequential bound*: what kernels that run one after another can reach
when each runs at its own roofline (an invocation's GEMMs at ``max(weight bytes, FLOPs)``, each
segment's attention at ``max(K/V bytes, FLOPs)``). The floor lets K/V reads hide under GEMM FLOPs;
kernels in one stream cannot overlap them, so where small chunks make attention bandwidth-bound the
bound sits well under the floor (``long4`` wavefront chunk 64: ~72% of it on the H200).

    python -m benchmarks.floors --prompts 4x8064 --chunk 16 64 128 --rows 256 1024 1024
"""

from __future__ import annotations

from weights.config import OuroConfig


def shape(c: OuroConfig, dtype_bytes: int = 2) -> dict:
    d, f = c.hidden_size, c.intermediate_size
    layer_params = d * c.q_size * 2 + d * c.kv_size * 2 + 3 * d * f
    L = c.num_hidden_layers
    return dict(
        layer_bytes=dtype_bytes * L * layer_params,
        layer_flops_per_row=2 * L * layer_params,
        kv_bytes_per_token_plane=2 * L * c.kv_size * dtype_bytes,
        head_bytes=dtype_bytes * d * c.vocab_size,
        head_flops_per_row=2 * d * c.vocab_size,
        attn_flops_per_query_key=4 * c.q_size * L,
    )


def prefill_floor(
    c: OuroConfig, requests: int, prompt: int, chunk: int, rows_per_invocation: int, bw: float, peak: float
) -> dict:
    s = shape(c)
    T = c.num_loops
    rows = requests * prompt * T
    invocations = -(-rows // rows_per_invocation)
    n = -(-prompt // chunk)
    ctx_sum = sum(min((i + 1) * chunk, prompt) for i in range(n))
    kv = requests * T * ctx_sum * s["kv_bytes_per_token_plane"]
    pairs = (
        requests
        * T
        * sum(min(chunk, prompt - i * chunk) * (i * chunk + (min(chunk, prompt - i * chunk) + 1) / 2) for i in range(n))
    )
    flops = rows * s["layer_flops_per_row"] + pairs * s["attn_flops_per_query_key"]
    weights = invocations * s["layer_bytes"]
    t = max((weights + kv) / bw, flops / peak)
    # the sequential bound (module doc): full invocations, then each segment's attention on its own
    full, last = divmod(rows, rows_per_invocation)
    gemm_s = sum(
        k * max(s["layer_bytes"] / bw, r * s["layer_flops_per_row"] / peak)
        for k, r in ((full, rows_per_invocation), (1 if last else 0, last))
    )
    attn_s = 0.0
    for i in range(n):
        q = min(chunk, prompt - i * chunk)
        ctx, seg_pairs = i * chunk + q, q * (i * chunk + (q + 1) / 2)
        attn_s += max(ctx * s["kv_bytes_per_token_plane"] / bw, seg_pairs * s["attn_flops_per_query_key"] / peak)
    return dict(
        floor_s=t,
        bound="bandwidth" if (weights + kv) / bw >= flops / peak else "flops",
        bytes=weights + kv,
        flops=flops,
        invocations=invocations,
        sequential_s=gemm_s + requests * T * attn_s,
    )


def decode_step_floor(c: OuroConfig, batch: int, context: float, loops: float, bw: float, peak: float) -> dict:
    """One decode step of ``batch`` rows (each running ``loops`` loops on average) at ``context``:
    the layer weights once per loop, each row's K/V of its context at each loop's plane, the lm_head
    once (Ouro-1.4B bf16: 2.47 GB of weights a loop, 192 KiB of K/V per context token a plane, 0.2 GB
    of lm_head; the embedding row read per token is left out)."""
    s = shape(c)
    weights, kv = loops * s["layer_bytes"], loops * batch * context * s["kv_bytes_per_token_plane"]
    b = weights + kv + s["head_bytes"]
    f = (
        loops * batch * (s["layer_flops_per_row"] + context * s["attn_flops_per_query_key"])
        + batch * s["head_flops_per_row"]
    )
    t = max(b / bw, f / peak)
    return dict(
        floor_s=t,
        bound="bandwidth" if b / bw >= f / peak else "flops",
        bytes=b,
        flops=f,
        weight_bytes=weights,
        kv_bytes=kv,
        head_bytes=s["head_bytes"],
    )


def generate_floor(
    c: OuroConfig, batch: int, prompt: int, new_tokens: int, bw: float, peak: float, loops: float | None = None
) -> dict:
    """Static-batch generation: one-shot prefill of the whole prompt, then ``new_tokens - 1`` steps."""
    loops = c.num_loops if loops is None else loops
    pre = prefill_floor(c, batch, prompt, prompt, batch * prompt, bw, peak)
    dec = sum(decode_step_floor(c, batch, prompt + i + 1, loops, bw, peak)["floor_s"] for i in range(new_tokens - 1))
    return dict(floor_s=pre["floor_s"] + dec, prefill_floor_s=pre["floor_s"], decode_floor_s=dec)


def main(argv=None) -> None:
    """Print the prefill floor and the sequential bound of equal prompts per chunk (module doc)."""
    import argparse

    from ouro_jax import get_preset

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--prompts", default="4x8064", help="REQUESTSxLENGTH")
    ap.add_argument("--chunk", nargs="+", type=int, default=[16, 64, 128])
    ap.add_argument("--rows", nargs="+", type=int, default=[1024], help="rows per invocation (one, or one per chunk)")
    ap.add_argument("--peak", type=float, default=785e12, help="FLOP/s (benchmarks/ceilings.py measures it)")
    ap.add_argument("--bw", type=float, default=4.0e12, help="bytes/s")
    a = ap.parse_args(argv)
    if len(a.rows) not in (1, len(a.chunk)):
        ap.error("--rows takes one value or one per --chunk")
    c = get_preset(a.preset)
    requests, prompt = map(int, a.prompts.split("x"))
    for chunk, rows in zip(a.chunk, a.rows * len(a.chunk) if len(a.rows) == 1 else a.rows):
        f = prefill_floor(c, requests, prompt, chunk, rows, a.bw, a.peak)
        tok = requests * prompt
        print(
            f"chunk {chunk:5d}, {rows:5d} rows: floor {tok / f['floor_s']:9,.0f} tok/s ({f['bound']}); sequential "
            f"bound {tok / f['sequential_s']:9,.0f} tok/s = {f['floor_s'] / f['sequential_s']:.0%} of the floor"
        )


if __name__ == "__main__":
    main()
