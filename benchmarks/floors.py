"""Floors: the least time any engine needs for a schedule (bytes / bandwidth vs FLOPs / peak).

The model of docs/performance.md, for any ``OuroConfig`` and the loops actually run: a recurrent
invocation reads every layer weight once whatever its rows; every prompt segment or decode row reads
the K/V of its whole context at its plane once per layer; matmuls and attention cost FLOPs. Use the
ceilings measured in the same run (``benchmarks/ceilings.py``).
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
    return dict(
        floor_s=t,
        bound="bandwidth" if (weights + kv) / bw >= flops / peak else "flops",
        bytes=weights + kv,
        flops=flops,
        invocations=invocations,
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
