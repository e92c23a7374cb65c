"""Ragged paged attention over a paged KV pool (Pallas, Triton lowering).

One launch serves a whole recurrent invocation: decode rows, prompt segments of any length, rows of
different requests at different planes. The contract (docs/contracts.md):

    ragged_paged_attention(q[R,H,hd], k_pages, v_pages, seg_q_start[S], seg_q_len[S],
                           seg_ctx_len[S], seg_block_table[S,MB], *, layer=None, sm_scale,
                           interpret=False) -> [R,H,hd]

Segment ``s`` owns rows ``seg_q_start[s] .. seg_q_start[s]+seg_q_len[s]-1``; its row ``i`` sits at
position ``seg_ctx_len[s]-seg_q_len[s]+i`` and attends causally to every position ``<=`` its own,
read through ``seg_block_table[s]`` from ``k_pages``/``v_pages`` (``[KVH,NB,BS,hd]``, or
``[L,KVH,NB,BS,hd]`` with the traced scalar ``layer``, read inside the kernel: the pool is never
sliced outside). ``seg_q_len == 0`` is padding; rows covered by no segment come out as zeros.

Design (everything shape-static in ``(R, S, MB)``, no host sync):

* **Plan** (``make_plan``, plain jnp, a few tiny fusions; can be built once per step and reused
  by every layer). Each segment is cut into *query tiles* of at most ``block_q`` rows
  (``T <= min(R, (R + S*(block_q-1)) // block_q)`` of them). A tile's rows need the context
  ``[0, pos_last]``. The context of every tile is cut into *work items* of ``chunk`` tokens, where
  ``chunk = max(min_split_tokens, total_tokens / extra_items)`` rounded to ``block_k``: when few
  long sequences are present (batch-1 decode at 32K) the context is split flash-decoding style so
  the GPU is filled; when the work is large each tile is one item. The number of items is bounded
  by ``W = T + extra_items`` (static), since ``sum ceil(n_t/chunk) <= sum n_t/chunk + T``.
* **Kernel 1** (grid ``(P, KVH)``, ``P = min(W, max_programs // KVH)``): one program = one work
  item x one KV head, or, when ``W`` exceeds the cap, a loop over items ``p, p + P, ...`` below
  the plan's count of real items (the plan packs them first): an ``S = R`` bucket of 2048 rows
  would otherwise launch ~33K programs per layer, nearly all empty. For each item it loads the
  ``block_q * G`` query rows of the G query heads sharing that KV head (GQA: each K/V tile is
  loaded once for all of them), loops (``lax.fori_loop``, dynamic trip count) over the item's
  context in ``block_k``-token tiles gathered through the block table (token -> page -> slot
  pointers, masked loads), online softmax in f32 (exp2 domain), and writes the normalised partial
  output and its log-sum-exp. Blocks that need no mask (fully below the first row's position)
  run a loop without masking. Decode rows are tiles of one row padded to a 16-row MMA (Triton
  pipelines MMA loops, CUDA-core dot products it does not); ``block_q=1`` with MHA selects
  a one-row path (vector multiply + reduce, optional register prefetch of the next block).
* **Kernel 2** (grid ``(R, H / heads per program)``): per output row and group of heads, combine
  its tile's items by log-sum-exp (``fori_loop`` over a dynamic count) and write those heads of
  the row (``combine_heads``: small buckets split a row's heads over programs); rows of no segment get
  zeros, or, given ``out``, keep its values (both kernels then write into ``out`` in place: the
  hybrid split's Mosaic half has written its rows there).

``ragged_paged_attention_reference`` is the pure-jnp twin (also the engine's CPU path).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
# Finite "minus infinity": masked logits and empty partials. Never produces NaN (inf - inf).
NEG = -1e30


def _cdiv(a, b):
    return (a + b - 1) // b


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------


# Default cap on kernel 1's programs (items x KV heads): above the decode buckets' grids (128 rows
# + 32 extra items x 16 KV heads = 2560 programs, one item each as without a cap), and 4x fewer
# programs than a 1024-row S = R bucket's grid, whose launch is mostly empty items.
MAX_PROGRAMS = 4096


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Static knobs of one launch. ``make_plan`` depends on the first four."""

    block_q: int  # query rows of one segment per tile (1 = one row per program)
    block_k: int  # context tokens per inner iteration
    extra_items: int  # work items beyond one per tile, for context splitting
    min_split_tokens: int  # never split a context into chunks shorter than this
    num_warps: int
    num_stages: int
    prefetch: bool = True  # one-row path: load block j+1 while reducing block j
    combine_warps: int = 4
    max_programs: int = MAX_PROGRAMS  # kernel 1's grid cap (items x KV heads); beyond it programs loop


def programs_per_kv_head(num_items: int, num_kv_heads: int, max_programs: int) -> int:
    """Kernel 1's programs per KV head: one per work item up to the cap, at least one."""
    return max(1, min(int(num_items), int(max_programs) // max(1, int(num_kv_heads))))


def default_tuning(
    num_rows: int,
    num_segments: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype=jnp.bfloat16,
    block_q=None,
    block_k=None,
    extra_items=None,
    min_split_tokens=None,
    num_warps=None,
    num_stages=None,
    target_programs=None,
    prefetch=None,
    max_programs=None,
) -> Tuning:
    """Heuristic defaults for a bucket ``(R, S)``; any knob given overrides it.

    Decode buckets: 16-row MMA tiles (one decode row padded to 16), 64-token blocks, ~512 programs.
    Prompt segments: the tile height follows the rows per segment (16 / 64 / 128 rows); 128-row
    tiles use 8 warps with 32-token blocks. The sweep behind them: docs/decisions.md, "Triton
    kernel tuning".
    """
    g = num_q_heads // num_kv_heads
    wide = jnp.dtype(dtype).itemsize >= 4  # f32: IEEE dots on CUDA cores, keep tiles small
    rows_per_seg = num_rows / max(num_segments, 1)
    decode_like = rows_per_seg <= 2
    if block_q is None:
        if decode_like:
            block_q = max(1, 16 // g)
        else:
            cap = 16 if wide else (16 if rows_per_seg <= 16 else (64 if rows_per_seg <= 64 else 128))
            block_q = max(1, cap // g)
    m = block_q * g
    m_pad = 1 if m == 1 else _next_pow2(max(16, m))
    if block_k is None:
        if m == 1:
            block_k = 32
        elif wide or head_dim > 128 or m_pad >= 128:
            block_k = 32
        else:
            block_k = 64
    if num_warps is None:
        num_warps = 8 if m_pad >= 128 else 4
    if num_stages is None:
        num_stages = 2 if (m == 1 or m_pad == 64) else 3
    if target_programs is None:
        target_programs = 512 if decode_like else 1024
    if extra_items is None:
        extra_items = max(1, _cdiv(target_programs, num_kv_heads))
    if min_split_tokens is None:
        min_split_tokens = 128 if decode_like else (512 if m_pad <= 16 else 2048)
    if prefetch is None:
        prefetch = True
    if max_programs is None:
        max_programs = MAX_PROGRAMS
    if int(max_programs) < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    return Tuning(
        block_q=int(block_q),
        block_k=int(block_k),
        extra_items=int(extra_items),
        min_split_tokens=int(min_split_tokens),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        prefetch=bool(prefetch),
        max_programs=int(max_programs),
    )


# ----------------------------------------------------------------------------------------------
# Plan: segments -> query tiles -> work items (plain jnp, shape-static)
# ----------------------------------------------------------------------------------------------


def _searchsorted_right(sorted_arr, queries):
    """Number of entries of ``sorted_arr`` that are <= each query (loop-free on small sizes)."""
    if sorted_arr.shape[0] * queries.shape[0] <= (1 << 22):
        return jnp.sum(sorted_arr[None, :] <= queries[:, None], axis=1, dtype=jnp.int32)
    return jnp.searchsorted(sorted_arr, queries, side="right", method="scan_unrolled").astype(jnp.int32)


def num_tiles(num_rows: int, num_segments: int, block_q: int, min_segment_rows: int = 1, align: int = 1) -> int:
    """Static bound on the query tiles of ``block_q`` rows that ``num_segments`` segments need.

    A segment of ``n`` rows needs ``ceil((n + lead) / block_q) <= (n + block_q - 1 + align - 1) /
    block_q`` tiles (``lead < align``, see ``query_tiles``); the segments cover at most
    ``num_rows`` rows, so ``k`` segments that hold rows need at most ``(num_rows + k * (block_q -
    1 + align - 1)) // block_q`` tiles, and never more than ``num_rows`` (a tile holds a row of its
    segment). ``k`` is ``num_segments``, or fewer when every segment that holds rows is known
    to hold at least ``min_segment_rows`` of them (``k <= num_rows // min_segment_rows``): the
    hybrid dispatch (pallas_kernels/dispatch.py) gives the Mosaic kernel only segments of 128 rows
    or more, and in the engine's buckets (``S = R``) the generic bound would be ``R`` tiles.
    """
    k = num_segments
    if min_segment_rows > 1:
        k = min(k, num_rows // min_segment_rows)
    return max(1, min(num_rows, (num_rows + k * (block_q - 1 + align - 1)) // block_q))


class Tiles(NamedTuple):
    seg: jax.Array  # [T] segment of the tile (clamped to a valid index)
    row0: jax.Array  # [T] first packed row
    nrows: jax.Array  # [T] rows in the tile (0 = empty tile)
    pos0: jax.Array  # [T] position of the first row


def query_tiles(
    seg_q_start, seg_q_len, seg_ctx_len, *, num_rows: int, block_q: int, max_tiles: int | None = None, align: int = 1
) -> Tiles:
    """Each segment cut into tiles of at most ``block_q`` rows, in segment order, then empty tiles.

    ``align``: a tile's first row is a multiple of it (the Mosaic kernel's TMA needs 8). A
    segment starting at row ``s`` then has ``lead = s % align`` rows of its first tile before its
    own first row (``row0 = s - lead``, positions from ``pos0`` of the segment minus ``lead``:
    rows nothing reads); ``nrows`` counts from ``row0`` through the segment's last row in the tile.

    ``max_tiles`` (static) sets the number of tiles; by default it is ``num_tiles(num_rows, S,
    block_q)``, which holds for any segments covering at most ``num_rows`` rows. A caller that
    knows more (every segment with rows has >= 128 of them) passes a smaller bound from
    ``num_tiles(..., min_segment_rows=...)``; tiles past the bound would be dropped, so it must be
    a true bound.
    """
    num_segments = seg_q_len.shape[0]
    if max_tiles is None:
        t_max = num_tiles(num_rows, num_segments, block_q, align=align)
    else:
        t_max = int(max_tiles)
    start = seg_q_start.astype(jnp.int32)
    q_len = jnp.maximum(seg_q_len.astype(jnp.int32), 0)
    lead = jnp.where(q_len > 0, start % align, 0) if align > 1 else jnp.zeros_like(q_len)
    n_qt = _cdiv(q_len + lead, block_q) * (q_len > 0)
    cum = jnp.cumsum(n_qt)
    t = jnp.arange(t_max, dtype=jnp.int32)
    seg = _searchsorted_right(cum, t)
    valid = seg < num_segments
    seg = jnp.minimum(seg, num_segments - 1)
    off = (t - (cum - n_qt)[seg]) * block_q - lead[seg]  # the tile's first row, from the segment's
    row0 = start[seg] + off
    nrows = jnp.where(valid, jnp.minimum(block_q, q_len[seg] - off), 0)
    pos0 = seg_ctx_len.astype(jnp.int32)[seg] - q_len[seg] + off
    return Tiles(seg=seg, row0=row0, nrows=nrows, pos0=pos0)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("items", "rows"), meta_fields=("block_q", "block_k"))
@dataclasses.dataclass(frozen=True)
class Plan:
    items: jax.Array  # [W, 8] int32: seg, row0, nrows, pos0, k0, k1, n_split of tile, real items (every row)
    rows: jax.Array  # [R, 4] int32: first item of the row's tile, item count, m-index, 0
    block_q: int  # static: the tiling the plan was built for (checked at launch)
    block_k: int


def make_plan(seg_q_start, seg_q_len, seg_ctx_len, *, num_rows: int, num_q_per_kv: int, tuning: Tuning) -> Plan:
    """Work list for ``ragged_paged_attention`` (depends only on the segment arrays).

    Items come tile by tile in segment order, every item of a tile holding context, so the real
    items are ``items[:n]`` with ``n = items[0, 7]``; the rest are empty (``n_split == 0``).
    """
    bq, bk = tuning.block_q, tuning.block_k
    tiles = query_tiles(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, block_q=bq)
    t_max = tiles.seg.shape[0]
    w_max = t_max + tuning.extra_items
    kv_len = jnp.where(tiles.nrows > 0, jnp.maximum(tiles.pos0 + tiles.nrows, 0), 0)
    blocks = _cdiv(kv_len, bk)
    total = jnp.sum(blocks)
    min_blocks = max(1, _cdiv(tuning.min_split_tokens, bk))
    chunk_blocks = jnp.maximum(min_blocks, _cdiv(total, tuning.extra_items))
    n_split = _cdiv(blocks, chunk_blocks)  # 0 for empty tiles
    cum = jnp.cumsum(n_split)
    first = cum - n_split
    w = jnp.arange(w_max, dtype=jnp.int32)
    tile = _searchsorted_right(cum, w)
    valid = tile < t_max
    tile = jnp.minimum(tile, t_max - 1)
    k0 = (w - first[tile]) * chunk_blocks * bk
    k1 = jnp.minimum(kv_len[tile], k0 + chunk_blocks * bk)
    n_items = jnp.broadcast_to(jnp.minimum(cum[-1], w_max), w.shape)  # <= w_max by the bound above
    items = jnp.stack(
        [
            tiles.seg[tile],
            tiles.row0[tile],
            jnp.where(valid, tiles.nrows[tile], 0),
            tiles.pos0[tile],
            jnp.where(valid, k0, 0),
            jnp.where(valid, k1, 0),
            jnp.where(valid, n_split[tile], 0),
            n_items,
        ],
        axis=1,
    ).astype(jnp.int32)
    # rows -> tile (rows covered by no segment keep -1)
    i = jnp.arange(bq, dtype=jnp.int32)
    row_idx = tiles.row0[:, None] + i[None, :]
    row_idx = jnp.where(i[None, :] < tiles.nrows[:, None], row_idx, num_rows)
    tile_ids = jnp.broadcast_to(jnp.arange(t_max, dtype=jnp.int32)[:, None], row_idx.shape)
    row_tile = jnp.full((num_rows,), -1, jnp.int32).at[row_idx.reshape(-1)].set(tile_ids.reshape(-1), mode="drop")
    covered = row_tile >= 0
    rt = jnp.maximum(row_tile, 0)
    r = jnp.arange(num_rows, dtype=jnp.int32)
    rows = jnp.stack(
        [
            jnp.where(covered, first[rt], 0),
            jnp.where(covered, n_split[rt], 0),
            jnp.where(covered, (r - tiles.row0[rt]) * num_q_per_kv, 0),
            jnp.zeros_like(r),
        ],
        axis=1,
    ).astype(jnp.int32)
    return Plan(items=items, rows=rows, block_q=bq, block_k=bk)


# ----------------------------------------------------------------------------------------------
# Kernel 1: partial attention of one work item and one KV head
# ----------------------------------------------------------------------------------------------


def _attn_kernel(
    items_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, out_ref, o_ref, lse_ref, *, num_programs: int | None, **kw
):
    """An empty work item (``n_split == 0``: padding past the plan's last item, or a tile of no
    rows) returns at once. Its partial output is never read (the combine reads only a row's own
    items) and its rows, if any, are covered by no segment. A hybrid bucket's Triton launch can be
    almost all such items, so they must cost nothing (docs/decisions.md, "Triton kernel tuning").

    ``num_programs`` None: one program per item, partials through per-program blocks. Otherwise
    program ``p`` runs items ``p, p + num_programs, ...`` below the plan's real count (all real, in
    the same order of accumulation as one program each) and writes partials at ``[w, h]``."""
    p, h = pl.program_id(0), pl.program_id(1)  # outside the branch: interpret mode needs it there
    args = (items_ref, bt_ref, layer_ref, q_ref, k_ref, v_ref, out_ref, o_ref, lse_ref)
    if num_programs is None:

        @pl.when(items_ref[p, 6] > 0)
        def _():
            _attn_item(p, h, *args, part=(), **kw)

        return

    def body(i, carry):
        w = p + i * num_programs
        _attn_item(w, h, *args, part=(w, h), **kw)
        return carry

    lax.fori_loop(0, _cdiv(jnp.maximum(items_ref[0, 7] - p, 0), num_programs), body, jnp.int32(0))


def _attn_item(
    w,
    h,
    items_ref,
    bt_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    o_ref,
    lse_ref,
    *,
    part: tuple,
    g: int,
    m_valid: int,
    m_pad: int,
    block_k: int,
    block_size: int,
    scale_log2: float,
    precision,
    prefetch: bool,
):
    seg = items_ref[w, 0]
    row0 = items_ref[w, 1]
    nrows = items_ref[w, 2]
    pos0 = items_ref[w, 3]
    k0 = items_ref[w, 4]
    k1 = items_ref[w, 5]
    # A tile whose context is one item writes its final rows itself; split tiles write partials.
    direct = items_ref[w, 6] == 1
    head_dim = q_ref.shape[-1]
    kv_prefix = (layer_ref[0], h) if layer_ref is not None else (h,)

    n_blocks = _cdiv(jnp.maximum(k1 - k0, 0), block_k)
    n_full = jnp.clip((jnp.minimum(k1, pos0 + 1) - k0) // block_k, 0, n_blocks)
    kr = jnp.arange(block_k, dtype=jnp.int32)
    # Gathers index every axis with arrays (interpret mode cannot mix array indices and slices).
    dr = jnp.arange(head_dim, dtype=jnp.int32)

    def load_kv(start, masked):
        kpos = start + kr
        if masked:
            kvalid = kpos < k1
            pidx = jnp.where(kvalid, lax.div(kpos, block_size), 0)
            page = plgpu.load(bt_ref.at[seg, pidx], mask=kvalid, other=0)
            off = jnp.where(kvalid, lax.rem(kpos, block_size), 0)
            kmask = kvalid[:, None]
            idx = (*kv_prefix, page[:, None], off[:, None], dr[None, :])
            k = plgpu.load(k_ref.at[idx], mask=kmask, other=0)
            v = plgpu.load(v_ref.at[idx], mask=kmask, other=0)
            return kpos, kvalid, k, v
        page = bt_ref[seg, lax.div(kpos, block_size)]
        off = lax.rem(kpos, block_size)
        idx = (*kv_prefix, page[:, None], off[:, None], dr[None, :])
        return kpos, None, k_ref[idx], v_ref[idx]

    if m_pad == 1:
        # One query row (MHA decode): CUDA-core dot products, scalar softmax statistics. No MMA, so
        # Triton does not pipeline the loop; with ``prefetch`` block j+1's K/V (and its page ids) are
        # loaded while block j is reduced (register double buffer; loads past the item's end are
        # masked off).
        q = q_ref[row0, h, :].astype(jnp.float32) * scale_log2  # [hd]

        def step(j, acc, m_i, l_i, k, v):
            kvalid = k0 + j * block_k + kr < k1
            s = jnp.sum(q[None, :] * k.astype(jnp.float32), axis=1)  # [BK]
            s = jnp.where(kvalid, s, NEG)
            m_new = jnp.maximum(m_i, jnp.max(s))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - m_new)
            l_new = l_i * alpha + jnp.sum(p)
            acc = acc * alpha + jnp.sum(p[:, None] * v.astype(jnp.float32), axis=0)
            return acc, m_new, l_new

        init = (jnp.zeros((head_dim,), jnp.float32), jnp.float32(NEG), jnp.float32(0.0))
        if prefetch:

            def f(j, carry):
                acc, m_i, l_i, k, v = carry
                _, _, k_next, v_next = load_kv(k0 + (j + 1) * block_k, True)
                return (*step(j, acc, m_i, l_i, k, v), k_next, v_next)

            _, _, k_first, v_first = load_kv(k0, True)
            acc, m_i, l_i, _, _ = lax.fori_loop(0, n_blocks, f, (*init, k_first, v_first))
        else:

            def f(j, carry):
                _, _, k, v = load_kv(k0 + j * block_k, True)
                return step(j, *carry, k, v)

            acc, m_i, l_i = lax.fori_loop(0, n_blocks, f, init)
        ok = m_i > 0.5 * NEG
        l_safe = jnp.where(ok, l_i, 1.0)
        o = jnp.where(ok, acc / l_safe, 0.0)

        @pl.when(direct)
        def _():
            out_ref[row0, h, :] = o.astype(out_ref.dtype)

        @pl.when(jnp.logical_not(direct))
        def _():
            o_ref[(*part, 0, slice(None))] = o
            lse_ref[(*part, slice(None))] = jnp.full((1,), jnp.where(ok, m_i + jnp.log2(l_safe), NEG), jnp.float32)

        return

    mi = jnp.arange(m_pad, dtype=jnp.int32)
    qi = lax.div(mi, g)
    row_ok = (mi < m_valid) & (qi < nrows)
    rows = jnp.where(row_ok, row0 + qi, 0)
    heads = h * g + lax.rem(mi, g)
    q_idx = (rows[:, None], heads[:, None], dr[None, :])
    q = plgpu.load(q_ref.at[q_idx], mask=row_ok[:, None], other=0)  # [Mp, hd]
    qpos = pos0 + qi

    def body(masked):
        def f(j, carry):
            acc, m_i, l_i = carry
            kpos, kvalid, k, v = load_kv(k0 + j * block_k, masked)
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale_log2  # [Mp, BK] f32
            if masked:
                ok = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
                s = jnp.where(ok, s, NEG)
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - m_new[:, None])
            l_new = l_i * alpha + jnp.sum(p, axis=1)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
            return acc * alpha[:, None] + pv, m_new, l_new

        return f

    carry = (
        jnp.zeros((m_pad, head_dim), jnp.float32),
        jnp.full((m_pad,), NEG, jnp.float32),
        jnp.zeros((m_pad,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_full, body(False), carry)
    acc, m_i, l_i = lax.fori_loop(n_full, n_blocks, body(True), carry)
    ok = m_i > 0.5 * NEG  # rows that saw at least one key in this item
    l_safe = jnp.where(ok, l_i, 1.0)
    o = jnp.where(ok[:, None], acc / l_safe[:, None], 0.0)

    @pl.when(direct)
    def _():
        # Masked lanes keep distinct (possibly out-of-range) rows: interpret mode emulates a masked
        # store by read-modify-write scatter, where colliding indices would race.
        st_idx = ((row0 + qi)[:, None], heads[:, None], dr[None, :])
        plgpu.store(out_ref.at[st_idx], o.astype(out_ref.dtype), mask=row_ok[:, None])

    @pl.when(jnp.logical_not(direct))
    def _():
        o_ref[(*part, slice(None), slice(None))] = o
        lse_ref[(*part, slice(None))] = jnp.where(ok, m_i + jnp.log2(l_safe), NEG)


# ----------------------------------------------------------------------------------------------
# Kernel 2: log-sum-exp combine of a row's items, all heads of the row at once
# ----------------------------------------------------------------------------------------------


def combine_chunk(h_pad: int, head_dim: int) -> int:
    """Items the combine reads per iteration: a power of two, ``chunk x h_pad x head_dim`` f32 at
    most 16K (128 registers a thread at 4 warps; 8 items for 16 heads of 128)."""
    return max(1, min(16, _next_pow2(16384 // (h_pad * head_dim) + 1) // 2))


# Kernel 2's programs below which a row's heads are split over several programs: one program per
# row left a batch-1 decode row's whole merge (32 items x 16 heads x 128 floats at 4K) to one SM.
COMBINE_TARGET_PROGRAMS = 256


def combine_heads(num_rows: int, num_heads: int) -> int:
    """Heads one combine program merges (a power of two): halved from all of them (padded to a
    power of two) while the grid ``(num_rows, heads groups)`` stays under
    ``COMBINE_TARGET_PROGRAMS``, down to one."""
    hp = _next_pow2(num_heads)
    while hp > 1 and num_rows * _cdiv(num_heads, hp) < COMBINE_TARGET_PROGRAMS:
        hp //= 2
    return hp


def _combine_kernel(
    rows_ref, o_part_ref, lse_part_ref, out_in_ref, out_ref, *, g: int, num_heads: int, heads: int, keep: bool
):
    """Rows of split tiles: combine; rows of no segment: zeros, or with ``keep`` left as they are
    (the caller's ``out``); others were written by kernel 1. A program owns ``heads`` heads of
    its row."""
    del out_in_ref  # aliased to out_ref
    r = pl.program_id(0)
    first = rows_ref[r, 0]
    count = rows_ref[r, 1]
    m0 = rows_ref[r, 2]
    head_dim = out_ref.shape[-1]
    hh = pl.program_id(1) * heads + jnp.arange(heads, dtype=jnp.int32)  # past num_heads: masked
    dr = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    h_ok = hh < num_heads
    kvh = jnp.where(h_ok, lax.div(hh, g), 0)
    mi = m0 + lax.rem(hh, g)

    # Items are read ``chunk`` at a time in one masked gather each ([chunk, Hp, hd]), not one by one:
    # the loads of a row's items are independent, and a loop of one item per iteration paid a
    # dependent global-memory round trip per item (8 items at batch-1 decode over 1K tokens).
    chunk = combine_chunk(heads, head_dim)
    jj = jnp.arange(chunk, dtype=jnp.int32)

    # Without ``keep`` a row of no segment (count 0) gets the loop's zero iterations: zeros.
    @pl.when((count > 1) if keep else (count != 1))
    def _():
        def body(c, carry):
            acc, m_i, l_i = carry
            j = c * chunk + jj
            j_ok = j < count
            item = first + jnp.where(j_ok, j, 0)
            ok2 = j_ok[:, None] & h_ok[None, :]
            lse = plgpu.load(lse_part_ref.at[item[:, None], kvh[None, :], mi[None, :]], mask=ok2, other=NEG)
            o = plgpu.load(
                o_part_ref.at[item[:, None, None], kvh[None, :, None], mi[None, :, None], dr[None, :, :]],
                mask=ok2[:, :, None],
                other=0.0,
            )  # [chunk, Hp, hd]
            m_new = jnp.maximum(m_i, jnp.max(lse, axis=0))
            a = jnp.exp2(m_i - m_new)
            b = jnp.where(ok2, jnp.exp2(lse - m_new[None, :]), 0.0)  # [chunk, Hp]
            acc = acc * a[:, None] + jnp.sum(o * b[:, :, None], axis=0)
            return acc, m_new, l_i * a + jnp.sum(b, axis=0)

        carry = (
            jnp.zeros((heads, head_dim), jnp.float32),
            jnp.full((heads,), NEG, jnp.float32),
            jnp.zeros((heads,), jnp.float32),
        )
        acc, _, l_i = lax.fori_loop(0, _cdiv(count, chunk), body, carry)
        out = jnp.where(l_i[:, None] > 0, acc / jnp.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        plgpu.store(out_ref.at[r, hh[:, None], dr], out.astype(out_ref.dtype), mask=h_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer):
    expect = 4 if layer is None else 5
    if k_pages.ndim != expect or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must be {expect}-D and equal "
            f"(layer={'None' if layer is None else 'given'}); got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    r, h, hd = q.shape
    kvh, _, _, hd_k = k_pages.shape[-4:]
    if hd_k != hd or h % kvh:
        raise ValueError(f"q {q.shape} does not match pages {k_pages.shape}")
    s = seg_q_len.shape[0]
    if seg_q_start.shape != (s,) or seg_ctx_len.shape != (s,) or seg_block_table.shape[0] != s:
        raise ValueError("segment arrays disagree in S")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "interpret",
        "block_q",
        "block_k",
        "extra_items",
        "min_split_tokens",
        "num_warps",
        "num_stages",
        "target_programs",
        "prefetch",
        "max_programs",
    ),
)
def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    seg_q_start,
    seg_q_len,
    seg_ctx_len,
    seg_block_table,
    *,
    layer=None,
    sm_scale: float,
    interpret: bool = False,
    block_q=None,
    block_k=None,
    extra_items=None,
    min_split_tokens=None,
    num_warps=None,
    num_stages=None,
    target_programs=None,
    prefetch=None,
    max_programs=None,
    plan: Plan | None = None,
    out=None,
):
    """Ragged paged attention (see module docstring). Tuning knobs default by bucket.

    ``plan`` (optional) is ``make_plan(...)`` for the same segment arrays (built once per step and
    shared by every layer); the launch takes its ``block_q``/``block_k`` from it.
    ``out`` (optional, ``q``'s shape): written in place, the segments' rows only; every other row
    keeps its value (default: a fresh array whose rows of no segment are zeros). The hybrid split
    passes the Mosaic half's output, so neither half copies the other's rows.
    """
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    if plan is not None:  # the plan fixes the tiling it was built for
        block_q = plan.block_q if block_q is None else block_q
        block_k = plan.block_k if block_k is None else block_k
    num_rows, num_heads, head_dim = q.shape
    kvh = k_pages.shape[-4]
    g = num_heads // kvh
    tuning = default_tuning(
        num_rows,
        seg_q_len.shape[0],
        num_heads,
        kvh,
        head_dim,
        dtype=q.dtype,
        block_q=block_q,
        block_k=block_k,
        extra_items=extra_items,
        min_split_tokens=min_split_tokens,
        num_warps=num_warps,
        num_stages=num_stages,
        target_programs=target_programs,
        prefetch=prefetch,
        max_programs=max_programs,
    )
    if plan is None:
        plan = make_plan(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, num_q_per_kv=g, tuning=tuning)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out {out.shape} {out.dtype} must match q {q.shape} {q.dtype}")
    return _launch(
        q,
        k_pages,
        v_pages,
        seg_block_table,
        layer,
        plan,
        tuning=tuning,
        sm_scale=sm_scale,
        interpret=interpret,
        out=out,
    )


def _launch(
    q,
    k_pages,
    v_pages,
    seg_block_table,
    layer,
    plan: Plan,
    *,
    tuning: Tuning,
    sm_scale: float,
    interpret: bool,
    out=None,
):
    num_rows, num_heads, head_dim = q.shape
    kvh, _, block_size, _ = k_pages.shape[-4:]
    g = num_heads // kvh
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if (plan.block_q, plan.block_k) != (tuning.block_q, tuning.block_k):
        raise ValueError(
            f"plan built for block_q={plan.block_q}, block_k={plan.block_k} but the "
            f"launch uses {tuning.block_q}, {tuning.block_k}: pass the same knobs"
        )
    m_valid = tuning.block_q * g
    m_pad = 1 if m_valid == 1 else _next_pow2(max(16, m_valid))
    w_max = plan.items.shape[0]
    n_prog = programs_per_kv_head(w_max, kvh, tuning.max_programs)
    looped = n_prog < w_max
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    has_layer = layer is not None

    kernel = functools.partial(
        _attn_kernel,
        g=g,
        m_valid=m_valid,
        m_pad=m_pad,
        block_k=tuning.block_k,
        block_size=block_size,
        scale_log2=float(sm_scale) * LOG2E,
        precision=precision,
        prefetch=tuning.prefetch,
        num_programs=n_prog if looped else None,
    )
    operands = [plan.items, seg_block_table.astype(jnp.int32)]
    if has_layer:
        operands.append(jnp.asarray(layer, jnp.int32).reshape(1))
    else:
        kernel = functools.partial(_no_layer, kernel)
    operands += [q, k_pages, v_pages]
    aliases = {}
    if out is not None:  # kernel 1 writes its one-item rows straight into it
        aliases = {len(operands): 0}
        operands.append(out)
        kernel = functools.partial(_drop_input, kernel, len(operands) - 1)
    out, o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(n_prog, kvh),
        out_specs=[
            pl.BlockSpec(),  # whole array: rows are scattered by the kernel
            # looped programs write each item's partials at [w, h] themselves
            pl.BlockSpec() if looped else pl.BlockSpec((None, None, m_pad, head_dim), lambda w, h: (w, h, 0, 0)),
            pl.BlockSpec() if looped else pl.BlockSpec((None, None, m_pad), lambda w, h: (w, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((w_max, kvh, m_pad, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((w_max, kvh, m_pad), jnp.float32),
        ],
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{tuning.block_q}_bk{tuning.block_k}",
    )(*operands)

    return combine_partials(
        plan.rows,
        o_part,
        lse_part,
        out,
        num_kv_heads=kvh,
        keep=bool(aliases),
        num_warps=tuning.combine_warps,
        interpret=interpret,
    )


def combine_partials(rows, o_part, lse_part, out, *, num_kv_heads: int, keep=False, num_warps=4, interpret=False):
    """Kernel 2 on ``out`` in place: each row of a split tile (``rows``: ``Plan.rows``) merged from
    its items' partials (``o_part [W, KVH, M, hd]`` f32 and ``lse_part [W, KVH, >= M]``, log2
    domain), rows of no segment zeroed (with ``keep``: left as they are), one-item rows untouched
    (their first kernel wrote them). Also the second launch of ``decode_attention_mgpu``."""
    num_rows, num_heads, _ = out.shape
    g = num_heads // num_kv_heads
    heads = combine_heads(num_rows, num_heads)
    return pl.pallas_call(
        functools.partial(_combine_kernel, g=g, num_heads=num_heads, heads=heads, keep=bool(keep)),
        grid=(num_rows, _cdiv(num_heads, heads)),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_combine",
    )(rows, o_part, lse_part, out)


def _drop_input(kernel, index, *refs):
    """``kernel`` without its input ref ``index`` (an input aliased to its output, read through that)."""
    return kernel(*refs[:index], *refs[index + 1 :])


def _no_layer(kernel, items_ref, bt_ref, q_ref, k_ref, v_ref, out_ref, o_ref, lse_ref):
    return kernel(items_ref, bt_ref, None, q_ref, k_ref, v_ref, out_ref, o_ref, lse_ref)


# ----------------------------------------------------------------------------------------------
# Reference (pure jnp): gather each tile's pages into a dense context, masked softmax
# ----------------------------------------------------------------------------------------------


def reference_block_q(num_rows: int, num_segments: int) -> int:
    """Tile height of the reference: ~rows per segment, so padding waste stays under ~2x."""
    return int(min(256, _next_pow2(_cdiv(num_rows, max(num_segments, 1)))))


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "block_q"))
def ragged_paged_attention_reference(
    q,
    k_pages,
    v_pages,
    seg_q_start,
    seg_q_len,
    seg_ctx_len,
    seg_block_table,
    *,
    layer=None,
    sm_scale: float,
    interpret: bool = False,
    block_q=None,
    **unused_tuning,
):
    """Pure-jnp twin of ``ragged_paged_attention`` (same signature; tuning knobs ignored).

    Rows are grouped into tiles of ``block_q`` rows of one segment; each tile's block table is
    gathered into a dense ``[MB*BS]`` context (one XLA gather straight from the pool, the ``layer``
    index included), scores are masked causally and by the tile's rows, softmax in f32.
    """
    del interpret, unused_tuning
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    num_rows, num_heads, head_dim = q.shape
    kvh, _, block_size, _ = k_pages.shape[-4:]
    num_segments, max_blocks = seg_block_table.shape
    g = num_heads // kvh
    bq = block_q or reference_block_q(num_rows, num_segments)
    tiles = query_tiles(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, block_q=bq)
    t_max = tiles.seg.shape[0]
    i = jnp.arange(bq, dtype=jnp.int32)
    row_ok = i[None, :] < tiles.nrows[:, None]  # [T, BQ]
    rows = jnp.where(row_ok, tiles.row0[:, None] + i[None, :], num_rows)  # OOB = dropped
    qt = jnp.take(q, rows, axis=0, mode="fill", fill_value=0)  # [T, BQ, H, hd]
    qt = qt.reshape(t_max, bq, kvh, g, head_dim)
    bt = seg_block_table.astype(jnp.int32)[tiles.seg]  # [T, MB]
    if layer is None:
        kd, vd = k_pages[:, bt], v_pages[:, bt]  # [KVH, T, MB, BS, hd]
        kv_spec = "ktmbd"
    else:
        kd, vd = k_pages[layer, :, bt], v_pages[layer, :, bt]  # [T, MB, KVH, BS, hd]
        kv_spec = "tmkbd"
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = (
        jnp.einsum(f"tikgd,{kv_spec}->tkgimb", qt, kd, precision=precision, preferred_element_type=jnp.float32)
        * sm_scale
    )
    kpos = (jnp.arange(max_blocks)[:, None] * block_size + jnp.arange(block_size)[None, :]).astype(
        jnp.int32
    )  # [MB, BS]
    qpos = tiles.pos0[:, None] + i[None, :]  # [T, BQ]
    ok = (kpos[None, None] <= qpos[:, :, None, None]) & row_ok[:, :, None, None]  # [T,BQ,MB,BS]
    ok = ok[:, None, None]  # [T, 1, 1, BQ, MB, BS]
    s = jnp.where(ok, s, -jnp.inf)
    # Slots past the tile's context may hold anything (stale or poisoned pages): p is 0 there, but
    # 0 * NaN is NaN, so V is zeroed outside [0, kv_len) (fused into the gather).
    kv_len = jnp.where(tiles.nrows > 0, tiles.pos0 + tiles.nrows, 0)
    kv_ok = kpos[None] < kv_len[:, None, None]  # [T, MB, BS]
    if layer is None:
        vd = jnp.where(kv_ok[None, :, :, :, None], vd, 0)
    else:
        vd = jnp.where(kv_ok[:, :, None, :, None], vd, 0)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(ok, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=(-2, -1))  # [T, KVH, G, BQ]
    o = jnp.einsum(
        f"tkgimb,{kv_spec}->tikgd", p.astype(vd.dtype), vd, precision=precision, preferred_element_type=jnp.float32
    )
    l = jnp.transpose(l, (0, 3, 1, 2))[..., None]  # [T, BQ, KVH, G, 1]
    o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
    o = o.reshape(t_max * bq, num_heads, head_dim).astype(q.dtype)
    out = jnp.zeros_like(q)
    return out.at[rows.reshape(-1)].set(o, mode="drop")
