"""The Ouro model in Flax linen, split into prelude / one recurrent loop / coda.

Ouro applies its whole layer stack ``T`` times to the same positions with the same weights. The
engine batches work at the granularity of *one loop* (rows of different requests at different
depths share an invocation), so the model exposes exactly that unit:

* ``prelude(ids)``           embed token ids (no scaling);
* ``recurrent(x, positions, attention, cache)``
                             one loop: all ``L`` layers, the final norm (applied after every loop)
                             and the exit gate; returns ``(h, gate_logit, cache)``;
* ``coda(h)``                ``lm_head``.

Attention is a boundary: every layer calls ``attention(layer_index, q, k, v, cache)`` with
RoPE-rotated ``q [..., H, hd]`` and ``k, v [..., KVH, hd]`` and gets back ``(out [..., H, hd],
cache)``. Dense causal attention (``forward``), the dense per-loop cache of ``generate`` and the
paged Pallas kernels of the engine are all just different ``attention`` objects; the model knows
nothing about requests, pages or planes.

Rows may have any leading shape (``[B, S]`` for dense use, ``[R]`` for the engine's packed rows).
Parameters are a plain nested dict (see ``weights/hf_names.py``); ``model.apply`` is only ever
called inside ``jax.jit``, so Flax's module traversal happens once, at trace time.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels.gate_up_silu_mgpu import gate_up_silu
from pallas_kernels.residual_norm import residual_norm
from pallas_kernels.residual_norm import supported as residual_norm_supported
from pallas_kernels.rope import apply_rope, rope_cos_sin
from weights.config import OuroConfig

__all__ = [
    "OuroModel",
    "OuroDecoderLayer",
    "RMSNorm",
    "init_params",
    "Attention",
    "dtype_of",
]


class Attention(Protocol):
    """The model's attention boundary: ``(layer, q, k, v, cache) -> (out, cache)`` with RoPE applied.

    A backend may also take the fused projection's output before RoPE: if its ``fuses_rope`` is
    true, fused-weight layers call ``rope_write(layer, qkv, cos, sin, cache) -> (q, cache)`` (RoPE
    on q and k, k and v written to the cache) and then ``attend(layer, q, cache) -> (out, cache)``
    (``PagedAttention`` with the ``rope_write_kv`` kernel: one launch where XLA runs three).
    If its ``fuses_norms`` is true, a layer adds each sublayer's normed output to the residual and
    norms the sum in one kernel (``pallas_kernels.residual_norm``; interpret mode where its
    ``kernel.interpret`` is set)."""

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, cache: Any) -> tuple[jax.Array, Any]: ...


def dtype_of(name_or_dtype) -> jnp.dtype:
    if isinstance(name_or_dtype, str):
        try:
            return {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[name_or_dtype]
        except KeyError:
            raise ValueError(f"unsupported dtype {name_or_dtype!r}; use bfloat16, float16 or float32") from None
    return jnp.dtype(name_or_dtype)


def rms_norm(x, w, eps: float) -> jax.Array:
    """``w * x * rsqrt(mean(x^2) + eps)`` in float32, unrounded: ``RMSNorm``'s arithmetic."""
    x32 = x.astype(jnp.float32)
    return w.astype(jnp.float32) * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))


class RMSNorm(nn.Module):
    """``w * x * rsqrt(mean(x^2) + eps)`` with statistics and product in float32, rounded once to
    ``out_dtype`` (the reference rounds before and after the weight product; we round once)."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x, out_dtype=None, scale_only: bool = False):
        """The normed ``x``; ``scale_only``: the weight ``[D]`` alone (for a fused kernel)."""
        w = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if scale_only:
            return w
        return rms_norm(x, w, self.eps).astype(self.dtype if out_dtype is None else out_dtype)


def _dense(features: int, dtype, use_bias: bool = False) -> nn.Module:
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
    )


class FusedDense(nn.Module):
    """``x @ kernel`` for a kernel ``[in, *out]`` that holds several projections side by side (one
    GEMM, the outputs sliced after it), with ``nn.Dense``'s dtype rules."""

    shape: tuple
    dtype: Any

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.initializers.variance_scaling(1.0, "fan_in", "normal"), (x.shape[-1], *self.shape), self.dtype
        )
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def qkv_groups(config: OuroConfig) -> tuple[int, int]:
    """``(G, g)``: the fused QKV kernel ``[D, G, g + 2, hd]`` holds, per KV head ``j < G``, its ``g``
    query heads ``j*g .. j*g+g-1`` then its key and value head (tensor parallelism splits ``G``)."""
    return config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads


def fuse_layer_params(layer: dict, config: OuroConfig, concat=None) -> dict:
    """One layer's params with ``q/k/v_proj`` as one ``qkv_proj`` kernel ``[D, G, g + 2, hd]`` and
    ``gate/up_proj`` as one ``gate_up_proj`` kernel ``[D, 2, I]`` (``fused_projections=True``).
    ``concat``: ``np.concatenate`` for host arrays (default: ``jnp.concatenate``)."""
    cat = jnp.concatenate if concat is None else concat
    G, g = qkv_groups(config)
    hd = config.head_dim
    att, mlp = dict(layer["self_attn"]), dict(layer["mlp"])
    q, k, v = (att.pop(n)["kernel"] for n in ("q_proj", "k_proj", "v_proj"))
    d = q.shape[0]
    att["qkv_proj"] = {"kernel": cat([q.reshape(d, G, g, hd), k.reshape(d, G, 1, hd), v.reshape(d, G, 1, hd)], axis=2)}
    gate, up = (mlp.pop(n)["kernel"] for n in ("gate_proj", "up_proj"))
    mlp["gate_up_proj"] = {"kernel": cat([gate[:, None], up[:, None]], axis=1)}
    return {**layer, "self_attn": att, "mlp": mlp}


class OuroAttentionProjections(nn.Module):
    """Q/K/V and O projections around the attention call. ``fused``: Q, K and V come out of one
    kernel (``fuse_layer_params``): XLA merged the three GEMMs anyway, and with separate weights it
    concatenated them on every call (0.8 ms of a 1024-row prefill invocation on the H200)."""

    config: OuroConfig
    dtype: Any
    fused: bool = False

    def setup(self):
        c = self.config
        if self.fused:
            G, g = qkv_groups(c)
            self.qkv_proj = FusedDense((G, g + 2, c.head_dim), self.dtype)
        else:
            self.q_proj = _dense(c.q_size, self.dtype)
            self.k_proj = _dense(c.kv_size, self.dtype)
            self.v_proj = _dense(c.kv_size, self.dtype)
        self.o_proj = _dense(c.hidden_size, self.dtype)

    def __call__(self, x, cos, sin, layer: int, attention: Attention, cache):
        c = self.config
        lead = x.shape[:-1]
        if self.fused and getattr(attention, "fuses_rope", False):
            q, cache = attention.rope_write(layer, self.qkv_proj(x), cos, sin, cache)
            out, cache = attention.attend(layer, q, cache)
            return self.o_proj(out.reshape(*lead, c.q_size).astype(self.dtype)), cache
        if self.fused:
            _, g = qkv_groups(c)
            y = self.qkv_proj(x)  # [..., G, g + 2, hd]
            q = y[..., :g, :].reshape(*lead, c.num_attention_heads, c.head_dim)
            k, v = y[..., g, :], y[..., g + 1, :]
        else:
            q = self.q_proj(x).reshape(*lead, c.num_attention_heads, c.head_dim)
            k = self.k_proj(x).reshape(*lead, c.num_key_value_heads, c.head_dim)
            v = self.v_proj(x).reshape(*lead, c.num_key_value_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = attention(layer, q, k, v, cache)
        return self.o_proj(out.reshape(*lead, c.q_size).astype(self.dtype)), cache


class GateUpSiLU(nn.Module):
    """``silu(x @ gate) * (x @ up)`` from one kernel ``[D, 2, I]`` (``fuse_layer_params``).
    ``epilogue``: one Mosaic GPU GEMM with SiLU x up in its epilogue (``gate_up_silu_mgpu``; 2-D
    ``x`` whose shapes it ``supported``); otherwise XLA's GEMM and a SiLU x up fusion."""

    intermediate: int
    dtype: Any
    epilogue: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
        kernel = self.param("kernel", init, (x.shape[-1], 2, self.intermediate), self.dtype)
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        if self.epilogue:
            return gate_up_silu(x, kernel)
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return nn.silu(y[..., 0, :]) * y[..., 1, :]


class OuroMLP(nn.Module):
    """SwiGLU MLP. ``fused``: gate and up from one kernel ``[D, 2, I]`` (as the attention's QKV);
    ``silu_epilogue``: that GEMM with SiLU x up in its epilogue (``GateUpSiLU``)."""

    config: OuroConfig
    dtype: Any
    fused: bool = False
    silu_epilogue: bool = False

    def setup(self):
        c = self.config
        if self.fused:
            self.gate_up_proj = GateUpSiLU(c.intermediate_size, self.dtype, epilogue=self.silu_epilogue)
        else:
            self.gate_proj = _dense(c.intermediate_size, self.dtype)
            self.up_proj = _dense(c.intermediate_size, self.dtype)
        self.down_proj = _dense(c.hidden_size, self.dtype)

    def __call__(self, x):
        if self.fused:
            return self.down_proj(self.gate_up_proj(x))
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    """One layer with Ouro's "sandwich" norms (4 RMSNorms)."""

    config: OuroConfig
    dtype: Any
    layer_index: int = 0
    # Tensor parallel (ouro_jax/parallel.py): the mesh axis whose shards hold the row-parallel
    # partial sums of o_proj / down_proj; None (one device) adds no collective.
    tp_axis: Optional[str] = None
    # params laid out by ``fuse_layer_params`` (the engine's runner); the checkpoint layout otherwise
    fused_projections: bool = False
    # the fused gate/up GEMM with SiLU x up in its epilogue (``GateUpSiLU``; step_program chooses)
    silu_epilogue: bool = False

    def setup(self):
        c = self.config
        self.self_attn = OuroAttentionProjections(c, self.dtype, fused=self.fused_projections)
        self.mlp = OuroMLP(c, self.dtype, fused=self.fused_projections, silu_epilogue=self.silu_epilogue)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.input_layernorm_2 = RMSNorm(c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.post_attention_layernorm_2 = RMSNorm(c.rms_norm_eps, self.dtype)

    def __call__(self, x, cos, sin, attention: Attention, cache, layer=None):
        """``x`` is the float32 residual stream: matmul inputs are rounded to the model dtype,
        the residual sums are not (cheap, fused, and it halves the bfloat16 drift over T*L layers)."""
        x, _, cache = self.chain(x, self.input_layernorm(x), cos, sin, attention, cache, layer)
        return x, cache

    def chain(self, x, h, cos, sin, attention: Attention, cache, layer=None, next_scale=None):
        """The layer with its input norm ``h = input_layernorm(x)`` already made (by the layer
        before, in its last residual norm): ``(x, h_next, cache)``. ``next_scale``: the weight of
        the norm that follows the layer (the next layer's ``input_layernorm``, or the model's
        final norm), ``h_next`` being ``x`` normed by it in the model dtype; ``None``: no norm
        (``h_next`` is ``None``). Each residual add and the norm after it are one kernel where the
        attention backend ``fuses_norms`` (``_add_norm``)."""
        layer = self.layer_index if layer is None else layer
        a, cache = self.self_attn(h, cos, sin, layer, attention, cache)
        if self.tp_axis is not None:
            a = jax.lax.psum(a, self.tp_axis)
        x, h = self._add_norm(
            x, a, self.input_layernorm_2, self.post_attention_layernorm(x, scale_only=True), attention
        )
        m = self.mlp(h)
        if self.tp_axis is not None:
            m = jax.lax.psum(m, self.tp_axis)
        if next_scale is None:
            return x + self.post_attention_layernorm_2(m, jnp.float32), None, cache
        x, h = self._add_norm(x, m, self.post_attention_layernorm_2, next_scale, attention)
        return x, h, cache

    def _add_norm(self, x, out, out_norm: "RMSNorm", next_scale, attention):
        """``x + out_norm(out)`` in float32 and that normed by ``next_scale`` in the model dtype."""
        if getattr(attention, "fuses_norms", False) and x.ndim == 2 and residual_norm_supported(x.shape[-1]):
            return residual_norm(
                x,
                out,
                out_norm(out, scale_only=True),
                next_scale,
                eps=self.config.rms_norm_eps,
                out_dtype=self.dtype,
                interpret=attention.kernel.interpret,
            )
        x = x + out_norm(out, jnp.float32)
        return x, rms_norm(x, next_scale, self.config.rms_norm_eps).astype(self.dtype)


class LMHead(nn.Module):
    """``h @ W`` with logits accumulated and returned in float32 (never rounded to bfloat16), so
    that sampling and argmax see the full-precision values."""

    features: int
    dtype: Any

    @nn.compact
    def __call__(self, h):
        kernel = self.param(
            "kernel",
            nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
            (h.shape[-1], self.features),
            self.dtype,
        )
        return jnp.dot(h.astype(self.dtype), kernel, preferred_element_type=jnp.float32)


class OuroModel(nn.Module):
    config: OuroConfig
    dtype: Any = jnp.float32
    tp_axis: Optional[str] = None  # see OuroDecoderLayer; the runner does embed/lm_head by vocabulary
    # every layer's params laid out by ``fuse_layer_params`` (the static ``generate``); see OuroDecoderLayer
    fused_projections: bool = False

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=self.dtype,
            param_dtype=self.dtype,
            embedding_init=nn.initializers.normal(1.0),
        )
        self.layers = [
            OuroDecoderLayer(
                c, self.dtype, layer_index=i, tp_axis=self.tp_axis, fused_projections=self.fused_projections
            )
            for i in range(c.num_hidden_layers)
        ]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.early_exit_gate = nn.Dense(1, use_bias=True, dtype=jnp.float32, param_dtype=self.dtype)
        self.lm_head = LMHead(c.vocab_size, self.dtype)

    # -- the three stages -------------------------------------------------------------------
    def prelude(self, ids):
        return self.embed_tokens(ids)

    def recurrent(self, x, positions, attention: Attention, cache: Any):
        """One loop of the stack for rows at any depth; the depth lives in ``attention``'s metadata.

        ``cache`` is opaque to the model: it is threaded through every layer's attention call
        (a list of per-layer dense caches, or one stacked paged pool) and returned updated.
        """
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        x = x.astype(jnp.float32)
        h = self.layers[0].input_layernorm(x)
        for i, layer in enumerate(self.layers):
            x, h, cache = layer.chain(x, h, cos, sin, attention, cache, next_scale=self.next_scale(i, x))
        # h: the final norm (after every loop), rounded to the model dtype: what the next loop and the ring see
        return h, self.gate(h), cache

    def next_scale(self, i: int, x):
        """The weight of the norm after layer ``i``: the next layer's input norm, after the last
        layer the final norm (``x``: a row of the residual, for the weight's shape)."""
        norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
        return norm(x, scale_only=True)

    def gate(self, h):
        """Exit-gate logit ``h . w + b`` in float32 (one scalar per row)."""
        return self.early_exit_gate(h.astype(jnp.float32))[..., 0]

    def coda(self, h):
        return self.lm_head(h)

    def __call__(self, ids, positions, attention: Attention, cache):
        # Only used by ``init``: touches every parameter once.
        h, g, cache = self.recurrent(self.prelude(ids), positions, attention, cache)
        return self.coda(h), g


def init_params(config: OuroConfig, seed: int = 0, dtype="float32") -> dict:
    """Random parameters from Flax's initialisers, drawn on the device: the benchmarks' weights, whose
    values do not matter and whose 1.4B draw must be fast.  ``LLM(preset, seed=)``, the tests and
    ``random-checkpoint`` use ``weights.random_init`` instead (reproducible across dtypes and layouts)."""
    from .attention import DenseCausalAttention

    dt = dtype_of(dtype)
    model = OuroModel(config, dt)
    ids = jnp.zeros((1, 2), jnp.int32)
    pos = jnp.arange(2)[None]
    variables = model.init(jax.random.PRNGKey(seed), ids, pos, DenseCausalAttention(), None)
    return jax.tree.map(lambda x: x.astype(dt), variables["params"])
