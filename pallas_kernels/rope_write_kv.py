"""RoPE and the paged K/V write of one layer in one kernel (Pallas, Triton lowering).

Between the fused Q/K/V projection and attention, XLA runs three kernels a layer: one scatter
fusion writes K (with its RoPE) into the pool, one writes V, and one applies RoPE to q; at decode
sizes each is mostly launch time (measured: docs/decisions.md, "RoPE and the K/V write in one
kernel"). This kernel does all three in one launch: each program takes a block of rows of one KV
head's group from the projection's output ``[R, G, g + 2, hd]`` (``g`` query heads, then the key
and the value head, ``model.qkv_groups``), rotates the query heads and the key, stores the
rotated queries to a new ``[R, G * g, hd]`` array and the key and value into the pools at the
rows' slots. The pools are aliased to the outputs, so inside a jitted step that owns them (donated,
or carried through the layer loop) XLA updates them in place, as it does the scatter.

RoPE is the model's (``pallas_kernels.rope.apply_rope``: halves split, ``x * cos + rotate_half(x) * sin`` in
float32, then the input's dtype), written per half: ``x1 * c1 + (-x2) * s1`` and ``x2 * c2 + x1 *
s2``. Rows past ``R``'s real count need no special case: a row with ``slot < 0`` writes nothing into
the pools (its rotated query is still stored; nothing reads it).

Limits (checked): ``hd`` a power of two and ``rows_per_program`` too (Triton block shapes), the
pools ``[L, KVH, NB, BS, hd]`` with ``KVH == G`` (K and V are stored in the pools' dtype). Slots must be distinct
(as ``write_kv``'s): two rows writing one slot leave either value.

``rope_write_kv_reference`` is the pure-jnp twin (``apply_rope`` + ``write_kv``), which is also
what the engine runs wherever the kernel is not used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache import write_kv
from pallas_kernels.rope import apply_rope

__all__ = ["rope_write_kv", "rope_write_kv_reference", "ROWS_PER_PROGRAM"]

# Rows per program: 16 rows x (g + 2) heads x hd per program; 1024 rows x 16 KV heads is 1024
# programs.
ROWS_PER_PROGRAM = 16
NUM_WARPS = 4


def _check(qkv, cos, sin, k_pages, v_pages, slots):
    if qkv.ndim != 4:
        raise ValueError(f"qkv must be [R, G, g + 2, hd], got shape {qkv.shape}")
    R, G, g2, hd = qkv.shape
    if g2 < 3:
        raise ValueError(f"qkv's third axis holds g query heads then K and V (>= 3), got {g2}")
    if hd % 2 or hd & (hd - 1):
        raise ValueError(f"head_dim must be an even power of two, got {hd}")
    if cos.shape != (R, hd) or sin.shape != (R, hd):
        raise ValueError(f"cos/sin must be [R, hd] = {(R, hd)}, got {cos.shape} / {sin.shape}")
    if k_pages.shape != v_pages.shape or k_pages.ndim != 5:
        raise ValueError(f"pools must be equal [L, KVH, NB, BS, hd], got {k_pages.shape} / {v_pages.shape}")
    if k_pages.shape[1] != G or k_pages.shape[-1] != hd:
        raise ValueError(f"pool {k_pages.shape} does not hold {G} KV heads of {hd}")
    if slots.shape != (R,):
        raise ValueError(f"slots must be [R] = ({R},), got {slots.shape}")


def rope_write_kv_reference(qkv, cos, sin, k_pages, v_pages, slots, *, layer):
    """Twin of :func:`rope_write_kv`: ``apply_rope`` on q and k, ``write_kv`` of k and v."""
    _check(qkv, cos, sin, k_pages, v_pages, slots)
    R, G, g2, hd = qkv.shape
    g = g2 - 2
    q = apply_rope(qkv[:, :, :g, :].reshape(R, G * g, hd), cos, sin)
    k = apply_rope(qkv[:, :, g, :], cos, sin)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, qkv[:, :, g + 1, :], slots, layer=layer)
    return q, k_pages, v_pages


def _kernel(layer_ref, slots_ref, qkv_ref, cos_ref, sin_ref, k_in, v_in, q_out, k_out, v_out, *, rows_per_program):
    del k_in, v_in  # aliased to k_out / v_out
    i = pl.program_id(0)
    j = pl.program_id(1)  # KV head = the group of its g query heads
    R, _, g2, hd = qkv_ref.shape
    g = g2 - 2
    _, _, nb, bs, _ = k_out.shape
    half = hd // 2
    rows = i * rows_per_program + jnp.arange(rows_per_program, dtype=jnp.int32)
    row_ok = rows < R
    r = jnp.where(row_ok, rows, 0)[:, None]  # loads (masked)
    r_out = jnp.where(row_ok, rows, R)[:, None]  # stores: past the end (see ``page`` below)
    lo = jnp.arange(half, dtype=jnp.int32)[None, :]
    hi = lo + half
    ok = row_ok[:, None]

    def load(ref, idx):
        return plgpu.load(ref.at[idx], mask=ok, other=0).astype(jnp.float32)

    c1, c2 = load(cos_ref, (r, lo)), load(cos_ref, (r, hi))
    s1, s2 = load(sin_ref, (r, lo)), load(sin_ref, (r, hi))

    def rotated(t):
        x1, x2 = load(qkv_ref, (r, j, t, lo)), load(qkv_ref, (r, j, t, hi))
        return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2

    for t in range(g):
        o1, o2 = rotated(t)
        head = j * g + t
        plgpu.store(q_out.at[r_out, head, lo], o1.astype(q_out.dtype), mask=ok)
        plgpu.store(q_out.at[r_out, head, hi], o2.astype(q_out.dtype), mask=ok)

    slot = plgpu.load(slots_ref.at[jnp.where(row_ok, rows, 0)], mask=row_ok, other=-1)
    write = (row_ok & (slot >= 0) & (slot < nb * bs))[:, None]
    # Rows that write nothing point one page past the pool: masked on the GPU, and dropped by the
    # interpreter, whose masked store would otherwise write the old value back over a real row's
    # write to the same place.
    page = jnp.where(write[:, 0], slot // bs, nb)[:, None]
    off = jnp.where(write[:, 0], slot % bs, 0)[:, None]
    layer = layer_ref[0]
    k1, k2 = rotated(g)
    plgpu.store(k_out.at[layer, j, page, off, lo], k1.astype(k_out.dtype), mask=write)
    plgpu.store(k_out.at[layer, j, page, off, hi], k2.astype(k_out.dtype), mask=write)
    d = jnp.arange(hd, dtype=jnp.int32)[None, :]
    v = plgpu.load(qkv_ref.at[r, j, g + 1, d], mask=ok, other=0)
    plgpu.store(v_out.at[layer, j, page, off, d], v.astype(v_out.dtype), mask=write)


@functools.partial(jax.jit, static_argnames=("interpret", "rows_per_program", "num_warps"))
def rope_write_kv(
    qkv,
    cos,
    sin,
    k_pages,
    v_pages,
    slots,
    *,
    layer,
    interpret: bool = False,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
):
    """Rotated queries ``[R, G * g, hd]`` (qkv's dtype) and the pools with each row's rotated key
    and value written at ``[layer, :, slot]`` (see the module docstring).

    ``qkv``: ``[R, G, g + 2, hd]``; ``cos``/``sin``: ``[R, hd]`` (``pallas_kernels.rope.rope_cos_sin``);
    ``k_pages``/``v_pages``: ``[L, KVH, NB, BS, hd]``; ``slots``: ``[R]`` flat slot (``page * BS +
    offset``) of each row at its plane, ``-1`` for rows that write nothing; ``layer``: traced int.
    """
    _check(qkv, cos, sin, k_pages, v_pages, slots)
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    R, G, g2, hd = qkv.shape
    g = g2 - 2
    operands = (
        jnp.asarray(layer, jnp.int32).reshape(1),
        slots.astype(jnp.int32),
        qkv,
        cos,
        sin,
        k_pages,
        v_pages,
    )
    return pl.pallas_call(
        functools.partial(_kernel, rows_per_program=rows_per_program),
        grid=(pl.cdiv(R, rows_per_program), G),
        out_shape=[
            jax.ShapeDtypeStruct((R, G * g, hd), qkv.dtype),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={5: 1, 6: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rope_write_kv",
    )(*operands)
