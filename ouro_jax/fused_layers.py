"""One loop of the layer stack for a small bucket (<= 16 rows) on the decode matvec kernels.

``decode_matmul="fused"`` (``pallas_kernels/decode_matvec.py``): each layer's four projections are
matvec kernels without split-K (no reduce kernel after the O and down projections) that stream
transposed weights, the gate/up one with ``silu(gate) * up`` in its epilogue (no SiLU kernel).
The RMSNorms and residual adds stay XLA fusions by default (``NORMS`` below); with
``OURO_JAX_FUSED_NORMS=kernel`` the QKV and gate/up kernels do them too (``norm_matvec``: every
program recomputes its rows' norms, measured slower on the H200, docs/decisions.md). Either way the
arithmetic is ``OuroDecoderLayer``'s with the same rounding points; what moves:

* a layer's last residual add, ``x + rmsnorm(down)``, is done at the start of the *next* layer
  (and after the last layer before ``finish_loop``); layer 0 gets a zero branch (``rmsnorm(0) =
  0``, so ``x' = x`` exactly) so that every layer has one signature and is traced once (a nested
  jit, as the runner's ``one_layer``);
* the projections' outputs carry ``MAX_ROWS`` rows (the kernels' MMA tile); rows at or past the
  bucket's ``num_rows`` are zeros. Attention and the K/V writes see the bucket's ``R`` rows.

The weights are read transposed (``[N, K]``, ``decode_weights``), laid out once at load time next
to the layout the other buckets use: ~2.5 GB more on the device for Ouro-1.4B.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import decode_matvec as dm
from weights.config import OuroConfig

from .model import apply_rope, qkv_groups, rms_norm

__all__ = ["decode_weights", "fused_layers_supported", "norms_option", "run_fused_layers"]

NORMS_ENV = "OURO_JAX_FUSED_NORMS"
NORMS = ("xla", "kernel")


def norms_option() -> str:
    """Who does the norms around the fused projections: ``"xla"`` (default) or ``"kernel"``."""
    v = os.environ.get(NORMS_ENV, "xla").strip().lower() or "xla"
    if v not in NORMS:
        raise ValueError(f"{NORMS_ENV} must be one of {NORMS}, got {v!r}")
    return v


@jax.jit
def decode_weights(layer: dict) -> dict:
    """The transposed projections of one layer (device arrays) in the fused layout
    (``fuse_layer_params``): ``qkv_t [G*(g+2)*hd, D]``, ``o_t [D, q_size]``, ``gate_up_t [2*I, D]``
    (gate rows, then up rows: ``[D, 2, I]`` flattened), ``down_t [D, I]``."""
    att, mlp = layer["self_attn"], layer["mlp"]
    qkv = att["qkv_proj"]["kernel"]
    d = qkv.shape[0]
    return {
        "qkv_t": qkv.reshape(d, -1).T,
        "o_t": att["o_proj"]["kernel"].T,
        "gate_up_t": mlp["gate_up_proj"]["kernel"].reshape(d, -1).T,
        "down_t": mlp["down_proj"]["kernel"].T,
    }


def fused_layers_supported(config: OuroConfig, rows: int) -> str | None:
    """None when a bucket of ``rows`` rows can run the fused layers, else why not."""
    c = config
    G, g = qkv_groups(c)
    for k, n in (
        (c.hidden_size, G * (g + 2) * c.head_dim),
        (c.q_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
        (c.intermediate_size, c.hidden_size),
    ):
        why = dm.supported(rows, k, n)
        if why is not None:
            return why
    return None


def run_fused_layers(
    params: dict,
    weights: dict,
    x,
    cos,
    sin,
    attention,
    pools,
    n_rows,
    *,
    config: OuroConfig,
    interpret: bool,
    norms: str = "xla",
):
    """The stack's layers for ``x [R, D]`` (float32 residual): returns ``(x [R, D] float32, pools)``.

    ``params``: ``{"layers_i": layer}`` in the fused layout, ``weights``: ``{"layers_i":
    decode_weights(...)}``, ``attention``: the bucket's ``PagedAttention``, ``n_rows``: the
    traced count of the bucket's real rows (its first rows), ``norms``: see ``NORMS``."""
    c = config
    R, D = x.shape
    G, g = qkv_groups(c)
    hd, eps = c.head_dim, c.rms_norm_eps
    dt = weights["layers_0"]["qkv_t"].dtype
    mv = dict(interpret=interpret)
    in_kernel = norms == "kernel"

    def scale(p, name):
        return p[name]["scale"]

    def residual_norm_matvec(x, branch, branch_weight, norm_weight, w_t, swiglu=False):
        """``x += rmsnorm(branch) * branch_weight``, then ``rmsnorm(x) * norm_weight @ w_t``:
        returns ``(product, x)``; in one kernel (``norm_matvec``) or XLA's norms and a matvec."""
        if in_kernel:
            return dm.norm_matvec(
                x,
                w_t,
                n_rows,
                norm_weight=norm_weight,
                eps=eps,
                branch=branch,
                branch_weight=branch_weight,
                swiglu=swiglu,
                **mv,
            )
        x = x + rms_norm(branch[:R], branch_weight, eps)
        return dm.matvec(rms_norm(x, norm_weight, eps).astype(dt), w_t, n_rows, swiglu=swiglu, **mv), x

    @jax.jit
    def layer(p, w, x, d, w_prev, pools, i):
        y, x = residual_norm_matvec(x, d, w_prev, scale(p, "input_layernorm"), w["qkv_t"])
        y = y[:R].reshape(R, G, g + 2, hd)
        q = y[:, :, :g].reshape(R, G * g, hd)
        k, v = y[:, :, g], y[:, :, g + 1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, pools = attention(i, q, k, v, pools)
        a = dm.matvec(out.reshape(R, -1).astype(dt), w["o_t"], n_rows, **mv)
        m, x = residual_norm_matvec(
            x,
            a,
            scale(p, "input_layernorm_2"),
            scale(p, "post_attention_layernorm"),
            w["gate_up_t"],
            swiglu=True,
        )
        d = dm.matvec(m, w["down_t"], n_rows, **mv)
        return x, d, pools

    x = x.astype(jnp.float32)
    if in_kernel:  # the kernels' residual carries MAX_ROWS rows
        x = jnp.pad(x, ((0, dm.MAX_ROWS - R), (0, 0)))
    d = jnp.zeros((dm.MAX_ROWS, D), dt)
    w_prev = jnp.ones((D,), dt)
    for i in range(c.num_hidden_layers):
        p = params[f"layers_{i}"]
        x, d, pools = layer(p, weights[f"layers_{i}"], x, d, w_prev, pools, jnp.int32(i))
        w_prev = scale(p, "post_attention_layernorm_2")
    x = x[:R] + rms_norm(d[:R], w_prev, eps)
    return x, pools
