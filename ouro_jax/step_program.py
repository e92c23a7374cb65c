"""The program of one executable: what a step computes on the device, apart from who runs it.

``ModelRunner`` (``runner.py``) owns the device state and the compiled executables; this module
holds the traced functions they are compiled from. One loop (:func:`one_loop`) does, in order
(``docs/contracts.md``): LAST_EXITED finalize copies, prelude (embed into ring rows), one loop of
the stack for the rows (K/V written at each row's slot, ragged paged attention per segment, output
scattered back to the ring), the exit gate, and the coda (lm_head + argmax) of the coda rows;
:func:`sample_coda` is the separate sampler of rows that sample. Fused decode steps, which run
several loops and tokens in one program, build on :func:`recurrent` and :func:`coda`
(``fused_step.py``).

The descriptor arrives as one packed int32 array; :func:`unpack` gives its fields by name with the
static offsets of ``scheduler.descriptor.descriptor_layout``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import copy_kv_slots
from pallas_kernels.dispatch import choose_attention, silu_epilogue
from pallas_kernels.rope import rope_cos_sin
from scheduler.buckets import BucketKey
from scheduler.descriptor import HEADER, descriptor_layout, exit_words
from scheduler.speculation import SpecKey, spec_layout
from weights.config import OuroConfig

from .model import OuroDecoderLayer, OuroModel, dtype_of, rms_norm
from .paged_attention import PagedAttention, fuses_norms, fuses_rope
from .parallel import TP_AXIS, local_config, vocab_parallel_embed, vocab_parallel_logits
from .sampling import adjust_logits, greedy, row_keys, sample, sample_stochastic, token_logprobs
from .structured import apply_token_bitmask

__all__ = [
    "CODA_FIELDS",
    "SamplerKey",
    "coda",
    "coda_words",
    "finish_loop",
    "one_loop",
    "packed_shape",
    "packed_size",
    "recurrent",
    "sample_coda",
    "unpack",
]


def unpack(key: BucketKey, packed) -> dict:
    """Device-side views of the packed descriptor (static offsets per key; float32 and uint32
    fields are bit-casts of their int32 words), the header's words by name (``HEADER``)."""
    out = {}
    for spec in descriptor_layout(key):
        w = packed[spec.offset : spec.offset + spec.size]
        if spec.name == "header":
            out.update((name, w[i]) for i, name in enumerate(HEADER))
        if spec.dtype == np.float32:
            w = jax.lax.bitcast_convert_type(w, jnp.float32)
        elif spec.dtype == np.uint32:
            w = jax.lax.bitcast_convert_type(w, jnp.uint32)
        out[spec.name] = w.reshape(spec.shape)
    return out


def packed_size(key: BucketKey) -> int:
    last = descriptor_layout(key)[-1]
    return last.offset + last.size


class SamplerKey(NamedTuple):
    """The separate sampler of ``C`` coda rows (``ModelRunner``, "Sampling on the host's word"),
    with ``H`` penalty entries per row (``sampling.adjust_logits``; 0 for a batch without any)."""

    C: int
    H: int = 0


# the coda's sampling words, contiguous in every descriptor: [temperature, top_k, top_p, seed, step]
CODA_FIELDS = ("coda_temperature", "coda_top_k", "coda_top_p", "coda_seed", "coda_step")


def coda_words(key: BucketKey, packed) -> jax.Array:
    """``[len(CODA_FIELDS), C]`` int32: the coda rows' sampling words of a packed descriptor."""
    layout = {f.name: f for f in descriptor_layout(key)}
    first = layout[CODA_FIELDS[0]].offset
    assert all(layout[n].offset == first + i * key.C for i, n in enumerate(CODA_FIELDS)), "coda fields moved"
    return packed[first : first + len(CODA_FIELDS) * key.C].reshape(len(CODA_FIELDS), key.C)


def packed_shape(key) -> tuple[int, ...]:
    """The uploaded int32 array of an executable: ``[words]`` for a bucket key, ``[n, words +
    exit words]`` for a fused decode step ``(BucketKey, n)``, the coda words ``[5, C]`` for a
    ``SamplerKey``, a round's flat array for either stage of a ``SpecKey`` (``spec_layout``)."""
    if isinstance(key, SamplerKey):
        return (len(CODA_FIELDS), key.C)
    if isinstance(key, BucketKey):
        return (packed_size(key),)
    if isinstance(key, SpecKey):
        return (spec_layout(key).size,)
    bucket, n = key
    return (n, packed_size(bucket) + exit_words(bucket))


def recurrent(
    params,
    kp,
    vp,
    ring,
    a: dict,
    previous_tokens,
    *,
    key: BucketKey,
    config: OuroConfig,
    dtype_name: str,
    attention: str,
    interpret: bool,
    tp_size: int = 1,
    decode_only: bool = False,
):
    """Steps 1-3 of one descriptor (``a``: its unpacked fields): returns ``(kp, vp, ring, h, g)``.

    ``previous_tokens [C]``: the tokens sampled by the token before this one in a fused decode
    step; embedded instead of ``pre_token`` when the descriptor's ``feed_previous_tokens`` is set.
    ``tp_size > 1``: the body of a ``shard_map`` over ``"tp"``; ``config`` and the KV pools are one
    shard's (``parallel.local_config``), embed and lm_head are split by vocabulary.
    ``decode_only``: every segment is one decode row (a fused step's, a draft's loop), which the
    attention choice may serve with the decode kernel (``dispatch.choose_attention``).
    """
    tp = tp_size > 1
    c = local_config(config, tp_size)
    dt = dtype_of(dtype_name)
    model = OuroModel(c, dt, tp_axis=TP_AXIS if tp else None)

    # 1. LAST_EXITED finalize: deeper planes of exited tokens take the exit plane's K/V
    kp, vp = copy_kv_slots(kp, vp, a["fin_src"], a["fin_dst"])
    # 2. prelude: embed into ring rows (padding writes the scratch row 0)
    pre_token = a["pre_token"]
    if previous_tokens is not None:
        prev = jnp.zeros((key.R,), jnp.int32).at[: key.C].set(previous_tokens[: key.R])
        feed = (a["feed_previous_tokens"] == 1) & (jnp.arange(key.R) < a["num_prelude"])
        pre_token = jnp.where(feed, prev, pre_token)
    if tp:
        emb = vocab_parallel_embed(params["top"]["embed_tokens"]["embedding"], pre_token)
    else:
        emb = model.apply({"params": params["top"]}, pre_token, method=OuroModel.prelude)
    ring = ring.at[a["pre_ring"]].set(emb.astype(ring.dtype))
    # 3. one loop for every row
    x = ring[a["row_ring"]]
    kernel = choose_attention(
        attention,
        num_rows=key.R,
        num_segments=key.S,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        block_size=kp.shape[-2],
        dtype=dt,
        interpret=interpret,
        min_segment_rows=key.M,
        decode_only=decode_only,
    )
    seg = (a["seg_q_start"], a["seg_q_len"], a["seg_ctx_len"], a["seg_block_table"])
    attn = PagedAttention(
        a["row_slot"], *seg, c.attn_scale, kernel, kernel.plan(*seg), fuses_rope(kernel), fuses_norms(kernel)
    )
    cos, sin = rope_cos_sin(a["row_pos"], c.head_dim, c.rope_theta)
    x = x.astype(jnp.float32)
    silu = silu_epilogue(key.R, c.hidden_size, c.intermediate_size, dt, attention)
    layer = OuroDecoderLayer(c, dt, tp_axis=TP_AXIS if tp else None, fused_projections=True, silu_epilogue=silu)

    def one_layer(p, x, h, pools, i, next_scale):
        return layer.apply({"params": p}, x, h, cos, sin, attn, pools, layer=i, next_scale=next_scale, method="chain")

    # L calls of one nested jit: traced and lowered once, not L times (start-up time), and inlined
    # by XLA into the same straight-line program as writing the layers out
    one_layer = jax.jit(one_layer)
    pools = (kp, vp)
    L, layers = c.num_hidden_layers, params["layers"]
    # each layer ends with the norm after it (the next layer's input norm, then the final norm)
    h = rms_norm(x, layers["layers_0"]["input_layernorm"]["scale"], c.rms_norm_eps).astype(dt)
    for i in range(L):
        nxt = layers[f"layers_{i + 1}"]["input_layernorm"] if i + 1 < L else params["top"]["norm"]
        x, h, pools = one_layer(layers[f"layers_{i}"], x, h, pools, jnp.int32(i), nxt["scale"])
    kp, vp = pools
    return finish_loop(params, model, kp, vp, ring, a, h)


def finish_loop(params, model, kp, vp, ring, a, h):
    """Gate of a loop from its final-normed rows ``h``; the rows' hidden states back to the ring."""
    g = model.apply({"params": params["top"]}, h, method=OuroModel.gate)
    ring = ring.at[a["row_ring"]].set(h.astype(ring.dtype))
    return kp, vp, ring, h, g.astype(jnp.float32)


def coda(
    params,
    h,
    a: dict,
    *,
    config: OuroConfig,
    dtype_name: str,
    tp_size: int = 1,
    greedy_only: bool = False,
    with_logprobs: bool = False,
    **_,
):
    """Step 4: lm_head + sampling of the coda rows' hidden states ``h [C, D]`` -> tokens ``[C]``
    (``greedy_only``: the argmax, whatever the rows ask for; the separate sampler does the rest);
    ``with_logprobs``: ``(tokens, their logprob records [C, LOGPROB_WORDS])``."""
    dt = dtype_of(dtype_name)
    if tp_size > 1:
        logits = vocab_parallel_logits(h, params["top"]["lm_head"]["kernel"], dt)
    else:
        model = OuroModel(local_config(config, tp_size), dt)
        logits = model.apply({"params": params["top"]}, h, method=OuroModel.coda)
    if greedy_only:
        tokens = greedy(logits)
    else:
        keys = row_keys(a["coda_seed"], a["coda_step"])
        tokens = sample(logits, a["coda_temperature"], a["coda_top_k"], a["coda_top_p"], keys).astype(jnp.int32)
    return (tokens, token_logprobs(logits, tokens)) if with_logprobs else tokens


def one_loop(params, kp, vp, ring, packed, *, separate_sampler: bool = False, **kw):
    """One loop: the executable of a bucket (the module docstring's four steps).

    ``separate_sampler``: the coda takes the argmax only and the step also returns the coda rows'
    hidden states and sampling words, for ``sample_coda`` when the host sees a row that samples."""
    a = unpack(kw["key"], packed)
    kp, vp, ring, h, g = recurrent(params, kp, vp, ring, a, None, **kw)
    hc = h[a["coda_row"]]
    if not separate_sampler:
        return kp, vp, ring, g, coda(params, hc, a, **kw)
    return kp, vp, ring, g, coda(params, hc, a, greedy_only=True, **kw), hc, coda_words(kw["key"], packed)


def sample_coda(top, h, words, bitmask, row_words, entries, *, config: OuroConfig, dtype_name: str):
    """The separate sampler: lm_head of the coda rows' hidden states ``h [C, D]``; the rows'
    allowed tokens ``bitmask [C, ceil(V/32)]`` int32 (structured outputs; all bits set for a free
    row); logit bias and penalties (``adjust_logits``: ``row_words [4, C]``, ``entries [4, C, H]``)
    and the sort-based sampling of ``sample_stochastic`` with the rows' words (``coda_words``) and
    min-p -> ``(tokens [C], their logprob records [C, LOGPROB_WORDS])``, the logprobs of the raw
    logits (its top-k is small next to the sort over the vocabulary that sampling pays)."""
    raw = OuroModel(config, dtype_of(dtype_name)).apply({"params": top}, h, method=OuroModel.coda)
    logits = apply_token_bitmask(raw.astype(jnp.float32), bitmask)
    if entries.shape[-1]:  # a batch with penalties or biases (the key's H > 0)
        logits = adjust_logits(logits, row_words, entries)
    temperature, top_k, top_p, seed, step = (words[i] for i in range(len(CODA_FIELDS)))
    f32 = lambda w: jax.lax.bitcast_convert_type(w, jnp.float32)  # noqa: E731
    keys = row_keys(jax.lax.bitcast_convert_type(seed, jnp.uint32), step)
    tokens = sample_stochastic(logits, f32(temperature), top_k, f32(top_p), keys, f32(row_words[3]))
    return tokens.astype(jnp.int32), token_logprobs(raw, tokens)
