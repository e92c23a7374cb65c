"""KV pool updates: write new rows' K/V into their slots, and the LAST_EXITED finalize copy.

Pool layout (docs/contracts.md): ``[KVH, NB, BS, hd]`` or ``[L, KVH, NB, BS, hd]``; a *slot* is
``block * BS + offset`` inside one layer/head.

Both updates are single XLA scatters on a flattened ``[..., NB*BS, hd]`` view of the pool (a
bitcast), with padding entries redirected to distinct out-of-range indices and ``mode="drop"``:
under ``jit(..., donate_argnums=...)`` (or inside a larger jitted step that owns the pool) XLA
updates the buffer in place, touching only the written slots. Every index is then unique (real
slots are distinct by contract), so the scatters say ``unique_indices=True``: XLA's GPU scatter that
must allow for duplicates took 35 us for one layer's K/V of 1024 rows on the H200, 63 us for 2048,
against 17 and 14 us with unique indices (docs/decisions.md, "KV writes"). The ``*_reference`` twins index
``[block, offset]`` on the 4-/5-D pool instead of the flat slot (a different route to the same
result, tested against each other and against a numpy loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _flat_slots(slots, num_slots):
    """Slots in range kept; each padding entry gets its own out-of-range index (dropped), so that
    the indices stay unique."""
    slots = slots.astype(jnp.int32)
    pad = num_slots + jnp.arange(slots.shape[0], dtype=jnp.int32)
    return jnp.where((slots >= 0) & (slots < num_slots), slots, pad)


def write_kv(k_pages, v_pages, k_new, v_new, slots, *, layer=None):
    """``pool[(layer,) h, slot[r]] = new[r, h]`` for every row ``r`` with ``slots[r] >= 0``.

    ``k_new``/``v_new``: ``[R, KVH, hd]``; ``slots``: ``[R]`` int (``-1`` = padding, not written).
    Returns the updated ``(k_pages, v_pages)``. Non-padding slots must be distinct (the scatter
    assumes unique indices; the scheduler never writes one slot twice in an invocation).
    """
    shape = k_pages.shape
    kvh, nb, bs, hd = shape[-4:]
    idx = _flat_slots(slots, nb * bs)

    def upd(pages, new):
        new = new.astype(pages.dtype)
        if layer is None:
            flat = pages.reshape(kvh, nb * bs, hd)
            # advanced index on axis 1 only: update shape [KVH, R, hd]
            flat = flat.at[:, idx].set(jnp.swapaxes(new, 0, 1), mode="drop", unique_indices=True)
        else:
            flat = pages.reshape(shape[0], kvh, nb * bs, hd)
            lyr = jnp.asarray(layer, jnp.int32)
            # scalar + array advanced indices separated by a slice: update shape [R, KVH, hd]
            flat = flat.at[lyr, :, idx].set(new, mode="drop", unique_indices=True)
        return flat.reshape(shape)

    return upd(k_pages, k_new), upd(v_pages, v_new)


def write_kv_reference(k_pages, v_pages, k_new, v_new, slots, *, layer=None):
    """Twin of ``write_kv``: indexes ``[block, offset]`` of the un-flattened pool."""
    kvh, nb, bs, hd = k_pages.shape[-4:]
    slots = slots.astype(jnp.int32)
    valid = slots >= 0
    blk = jnp.where(valid, slots // bs, nb)  # block nb is out of range -> dropped
    off = jnp.where(valid, slots % bs, 0)
    h = jnp.arange(kvh)[None, :]  # [1, KVH] broadcast against [R, 1]

    def upd(pages, new):
        new = new.astype(pages.dtype)
        if layer is None:
            return pages.at[h, blk[:, None], off[:, None]].set(new, mode="drop")
        lyr = jnp.asarray(layer, jnp.int32)
        return pages.at[lyr, h, blk[:, None], off[:, None]].set(new, mode="drop")

    return upd(k_pages, k_new), upd(v_pages, v_new)


def copy_kv_slots(k_pages, v_pages, src, dst):
    """For every layer and KV head: ``pool[..., dst[f]] = pool[..., src[f]]`` (``dst = -1`` pads).

    All reads happen before all writes (a copy chain ``a->b, b->c`` copies the old ``b``).
    Non-padding ``dst`` slots must be distinct (unique scatter indices, as ``write_kv``).
    """
    shape = k_pages.shape
    kvh, nb, bs, hd = shape[-4:]
    lead = shape[:-3]  # (L, KVH) or (KVH,)
    d = _flat_slots(dst, nb * bs)
    s = jnp.where(d < nb * bs, jnp.clip(src.astype(jnp.int32), 0, nb * bs - 1), 0)

    def upd(pages):
        flat = pages.reshape(*lead, nb * bs, hd)
        # Materialise the gathered rows before the scatter: fused into one kernel, the gather would
        # read the buffer the scatter writes, and XLA (GPU) would copy the whole pool to stay safe.
        vals = jax.lax.optimization_barrier(flat[..., s, :])  # [*lead, F, hd]
        return flat.at[..., d, :].set(vals, mode="drop", unique_indices=True).reshape(shape)

    return upd(k_pages), upd(v_pages)


def copy_kv_slots_reference(k_pages, v_pages, src, dst):
    """Twin of ``copy_kv_slots`` on ``[block, offset]`` indices of the un-flattened pool."""
    kvh, nb, bs, hd = k_pages.shape[-4:]
    src = src.astype(jnp.int32)
    dst = dst.astype(jnp.int32)
    valid = dst >= 0
    sb, so = jnp.where(valid, src // bs, 0), jnp.where(valid, src % bs, 0)
    db, do = jnp.where(valid, dst // bs, nb), jnp.where(valid, dst % bs, 0)

    def upd(pages):
        vals = pages[..., sb, so, :]  # [..., F, hd]
        return pages.at[..., db, do, :].set(vals, mode="drop")

    return upd(k_pages), upd(v_pages)


__all__ = ["write_kv", "write_kv_reference", "copy_kv_slots", "copy_kv_slots_reference"]
