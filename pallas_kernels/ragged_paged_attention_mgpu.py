"""Ragged paged attention for long prompt segments on Hopper (Pallas, Mosaic GPU lowering).

Same contract as ``ragged_paged_attention`` (docs/contracts.md), written for the case the
Triton-lowered kernel handles worst: prompt segments of hundreds or thousands of rows, where the
work is tensor-core bound (docs/decisions.md, "Two attention kernels, one contract"). Triton's
lowering has no TMA and no wgmma on this path; this kernel is
written the FlashAttention-3 way with Mosaic GPU primitives:

* one CTA = one *query tile* of ``2 * block_q`` rows of one segment x one query head; two compute
  warpgroups own ``block_q`` rows each (wgmma with a register accumulator, online softmax in f32,
  exp2 domain), a third (memory) warpgroup streams K/V into a ring of ``max_concurrent_steps``
  shared-memory slots;
* a K/V step of ``block_kv`` tokens is ``block_kv / block_size`` TMA copies, one per page, each
  addressed through the segment's block table (``[L, KVH, NB, BS, hd]`` pool, the traced layer
  index read inside the kernel: the pool is never sliced);
* causal masking only on the steps that cross the diagonal; steps past a warpgroup's last row are
  skipped (the warpgroup still releases their slots so the memory warpgroup never stalls).

A tile is a *window* of ``2 * block_q`` consecutive rows of ``q`` starting at a multiple of
``ALIGN`` (``tile_rows``): its queries are read in place by TMA (rows past ``R`` zero-filled; the
few window rows before its segment's first row compute garbage). Its output is written in
place, its segment's rows only (``store_rows``: the result staged in untiled shared memory, then
one TMA store per power of two in the row count), because a window's first and last 8-row groups
may hold rows of other segments. Every other row of the output keeps the value it came in with
(``out``, zeros by default): in the hybrid split the Triton half then writes its own rows into
the same array, and nothing copies or combines the two (docs/decisions.md, "Hybrid split
without a merge").

Limits (checked): bfloat16/float16, head_dim a multiple of 64, ``block_size`` a multiple of 8 that
divides ``block_kv``. One condition is not checked: the slots of a segment's last page past its
context are read and multiplied by zero probabilities, so they must hold finite values (the
engine's pool is zero-initialised and only ever written with K/V, so they do); a NaN there would
leak through ``0 * NaN`` in the P.V product. Whole pages past the context are never read (the
step loads the segment's first page in their place). The Triton kernel masks its loads per token
and has no such condition.

Decode rows and short segments stay on the Triton kernel: ``dispatch.select_kernel`` chooses per
bucket from the crossover, or splits one invocation per segment (``"hybrid"``: segments
of ``dispatch.HYBRID_MIN_SEGMENT_ROWS`` rows or more here, the rest on Triton). For the hybrid split
the packing takes a small static tile bound (``max_tiles``, from ``mgpu_tiles(...,
min_segment_rows=...)``), so most launches hold a few padding tiles (``nrows == 0``); such a tile
returns at once: no Q load, no K/V step, no store.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import _cdiv, _check_args, num_tiles, query_tiles

LOG2E = math.log2(math.e)
NEG = -1e30  # finite "minus infinity": rows with no visible key never produce inf - inf
COMPUTE_WGS = 2
# K/V tokens per pipeline step (``block_kv / block_size`` page copies) and steps in flight: the
# fastest pair on the H200 (docs/decisions.md, "Mosaic kernel tuning").
BLOCK_KV = 128
MAX_CONCURRENT_STEPS = 2
# A window's first row is a multiple of this: the TMA into the (8, 64)-tiled query buffer needs it.
ALIGN = 8


def supported(q_dtype, head_dim: int, block_size: int, block_kv: int = BLOCK_KV) -> str | None:
    """Why this kernel cannot serve a launch (``None`` when it can)."""
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q_dtype).name} (needs bfloat16 or float16)"
    if head_dim % 64:
        return f"head_dim {head_dim} (needs a multiple of 64)"
    if block_size % 8 or block_kv % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing block_kv={block_kv})"
    return None


def tile_rows(seg_q_start, seg_q_len, seg_ctx_len, *, num_rows: int, block_q: int, max_tiles: int | None = None):
    """Row-aligned windows of ``2 * block_q`` rows: ``[T, 5]`` int32 ``(seg, row0, nrows, pos0,
    lead)``.

    A segment starting at row ``s`` is cut into windows starting at ``a = s - s % ALIGN`` and every
    ``2 * block_q`` rows after it, so the kernel reads a window's queries straight from ``q`` with a
    TMA whose row offset is a multiple of ``ALIGN`` (what the tiled shared-memory layout needs).
    Window ``t`` covers rows ``row0 .. row0 + nrows - 1`` (through the segment's last row in it) at
    positions ``pos0 ..``; its first ``lead`` rows (``s % ALIGN`` in a segment's first window, else
    0) belong to no row of the segment: they compute garbage that is never stored, so a segment of
    ``n`` rows takes ``ceil((n + s % ALIGN) / (2 * block_q))`` windows. ``nrows == 0``: a padding
    window. ``max_tiles``: static window count; default the bound for any segments.
    """
    t = query_tiles(
        seg_q_start,
        seg_q_len,
        seg_ctx_len,
        num_rows=num_rows,
        block_q=COMPUTE_WGS * block_q,
        max_tiles=max_tiles,
        align=ALIGN,
    )
    lead = jnp.where(t.nrows > 0, jnp.maximum(seg_q_start.astype(jnp.int32)[t.seg] - t.row0, 0), 0)
    return jnp.stack([t.seg, t.row0, t.nrows, t.pos0, lead], axis=1).astype(jnp.int32)


TILE_FIELDS = 5  # the columns of ``tile_rows``


class Packing(NamedTuple):
    """Per-invocation input of the kernel, built once and shared by every layer.

    ``meta``: the windows of ``tile_rows`` (``[T, 5]``, flat) followed by the block table, flat
    int32, one freshly computed array. Mosaic GPU wants every operand 256-byte aligned; in the
    engine the block table is a slice of the step's packed descriptor, which XLA passed as an
    unaligned view ("Input buffer 1 is not 256-byte aligned" on the H200). ``T`` follows from the
    shapes (:func:`packed_tiles`).
    """

    meta: jax.Array


def packed_tiles(packing: Packing, seg_block_table) -> int:
    """``T``, the windows of ``packing`` (static)."""
    return (packing.meta.shape[0] - math.prod(seg_block_table.shape)) // TILE_FIELDS


def make_packing(
    seg_q_start,
    seg_q_len,
    seg_ctx_len,
    seg_block_table,
    *,
    num_rows: int,
    block_q: int = 64,
    max_tiles: int | None = None,
) -> Packing:
    """The kernel's per-invocation input. ``max_tiles`` (static) bounds the launch's windows: the
    default holds for any segments (in the engine's ``S = R`` buckets that is ``R`` windows); the
    hybrid dispatch passes ``dispatch.hybrid_tiles(R, S)``, a few times ``R / 128``."""
    tiles = tile_rows(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, block_q=block_q, max_tiles=max_tiles)
    # Computed once, not fused into the copy below: there XLA recomputed the windows' segment
    # search per element of the table (docs/decisions.md, "Hybrid split without a merge").
    tiles = lax.optimization_barrier(tiles)
    meta = jnp.concatenate([tiles.reshape(-1), seg_block_table.astype(jnp.int32).reshape(-1)])
    return Packing(meta)


def _kernel(
    meta_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    scoped,
    *,
    g: int,
    num_tiles: int,
    block_q: int,
    block_kv: int,
    block_size: int,
    steps: int,
    scale_log2: float,
    max_blocks: int,
    num_pages: int,
):
    smem, kv_ready, kv_free, sched = scoped
    q_smem2, k_smem, v_smem, out_smem2 = smem
    k_ready, v_ready, q_ready = kv_ready
    k_free, v_free = kv_free
    head = lax.axis_index("heads")
    t = lax.axis_index("tiles")
    wg = lax.axis_index("wg")
    seg = meta_ref[t * TILE_FIELDS]
    row0 = meta_ref[t * TILE_FIELDS + 1]  # a multiple of ALIGN (``tile_rows``)
    nrows = meta_ref[t * TILE_FIELDS + 2]
    pos0 = meta_ref[t * TILE_FIELDS + 3]
    lead = meta_ref[t * TILE_FIELDS + 4]  # window rows before the segment's first
    bt0 = TILE_FIELDS * num_tiles  # the block table follows the tiles
    tile_steps = jnp.where(nrows > 0, _cdiv(pos0 + nrows, block_kv), 0)
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype

    def schedule_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        # A padding tile (nrows == 0: past the invocation's last tile, see ``mgpu_tiles``) does
        # nothing: the memory warpgroup issues no K/V (``tile_steps == 0``), and here no Q load,
        # no schedule barrier and no store.
        @pl.when(nrows > 0)
        def _tile():
            q_smem = q_smem2.at[wg]
            first = wg * block_q  # this warpgroup's first row within the tile
            rows = jnp.clip(nrows - first, 0, block_q)
            q_pos0 = pos0 + first
            kv_steps = jnp.where(rows > 0, _cdiv(q_pos0 + rows, block_kv), 0)
            # Steps whose keys all sit at or before this warpgroup's first query position.
            full_steps = jnp.clip(lax.div(q_pos0 + 1, block_kv), 0, kv_steps)

            # Straight from the invocation's rows (TMA zero-fills rows past ``R``); window rows
            # that are not the segment's compute garbage that is never stored.
            q_rows = pl.ds(pl.multiple_of(row0 + first, ALIGN), block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head], q_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])

            m_i = plgpu.layout_cast(jnp.full((block_q,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(schedule_barrier)

            def kv_step(step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(steps))

                def qk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(qk_scope, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * scale_log2
                if masked:
                    qi = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                    ki = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(q_pos0 + qi >= step * block_kv + ki, s, NEG)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p_lo = p.astype(dtype)
                acc, l_i, m_new, p_lo = lax.optimization_barrier((acc, l_i, m_new, p_lo))
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(sched)

                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])
                    nxt = step + 1

                    @pl.when(nxt < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, jnp.int32(steps))])

                acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def drain(step, _):
                # Steps this warpgroup does not need: release the slots and keep the schedule
                # barrier in step with the other warpgroup.
                slot = lax.rem(step, jnp.int32(steps))
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(kv_step, masked=True), carry)
            lax.fori_loop(kv_steps, tile_steps, drain, None)
            pl.when(wg == 0)(schedule_barrier)

            l_safe = jnp.where(l_i > 0, l_i, 1.0)
            acc = acc / lax.broadcast_in_dim(l_safe, (block_q, head_dim), [0])
            stage = out_smem2.at[wg]
            stage[...] = acc.astype(dtype)
            plgpu.commit_smem()
            # In place, the segment's rows only: a window shares its first and last 8-row groups
            # with other segments (whose own windows write those rows).
            store_rows(stage, out_ref, head=head, row=row0 + first, lo=jnp.clip(lead - first, 0, block_q), hi=rows)
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kvh = lax.div(head, jnp.int32(g))
        layer = layer_ref[0]
        pages = block_kv // block_size

        stream_kv(
            meta_ref, (k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free),
            layer=layer, kvh=kvh, table=bt0, seg=seg, max_blocks=max_blocks, num_pages=num_pages,
            ctx_pages=_cdiv(pos0 + nrows, block_size), first_blk=None, n_steps=tile_steps, pages=pages,
            block_size=block_size, steps=steps,
        )  # fmt: skip


def store_rows(stage, out_ref, *, head, row, lo, hi):
    """Rows ``lo .. hi - 1`` of the staged output ``stage`` (``[n, hd]``, ``n`` a power of two, no
    tiling) to rows ``row + lo ..`` of ``out_ref[:, head]``, and no other row: one TMA copy per set
    bit of ``hi - lo``, the largest piece first (at most ``log2(n) + 1`` copies)."""
    n = stage.shape[0]
    count = jnp.clip(hi - lo, 0, n)
    for b in reversed(range(n.bit_length())):
        piece = 1 << b
        start = lo + (count & ~(2 * piece - 1))  # after the larger pieces

        @pl.when((count & piece) != 0)
        def _():
            plgpu.copy_smem_to_gmem(stage.at[pl.ds(start, piece)], out_ref.at[pl.ds(row + start, piece), head])


def stream_kv(
    meta_ref, kv_refs, kv_smem, ready, free, *, layer, kvh, table, seg, max_blocks, num_pages, ctx_pages,
    first_blk, n_steps, pages, block_size, steps,
):  # fmt: skip
    """The memory warpgroup of both Mosaic kernels: ``n_steps`` K/V steps of ``pages`` TMA page copies
    each, through segment ``seg``'s row of the block table at ``meta_ref[table:]``, from block
    ``first_blk`` (None: 0) into a
    ring of ``steps`` slots; a slot is refilled once the compute warpgroup freed it.

    Pages past the context (``ctx_pages``) are masked by the consumer, but P.V still multiplies them
    by zero: the segment's first page is loaded in their place, so they hold real (finite) K/V
    instead of whatever the table's tail names."""
    (k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free) = kv_refs, kv_smem, ready, free

    def issue(step, slot, which):
        src_ref, dst_ref, bar = (k_ref, k_smem, k_ready) if which == "k" else (v_ref, v_smem, v_ready)
        for j in range(pages):
            blk = step * pages + j if first_blk is None else first_blk + step * pages + j
            blk = jnp.where(blk < ctx_pages, jnp.minimum(blk, max_blocks - 1), 0)
            page = jnp.clip(meta_ref[table + seg * max_blocks + blk], 0, num_pages - 1)
            plgpu.copy_gmem_to_smem(
                src_ref.at[layer, kvh, page], dst_ref.at[slot, pl.ds(j * block_size, block_size)], bar.at[slot]
            )

    for i in range(steps):

        @pl.when(i < n_steps)
        def _():
            issue(jnp.int32(i), i, "k")
            issue(jnp.int32(i), i, "v")

    @pl.loop(0, jnp.maximum(n_steps - steps, 0))
    def _(step):
        nxt = step + steps
        slot = lax.rem(step, jnp.int32(steps))
        plgpu.barrier_wait(k_free.at[slot])
        issue(nxt, slot, "k")
        plgpu.barrier_wait(v_free.at[slot])
        issue(nxt, slot, "v")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_kv", "max_concurrent_steps"))
def ragged_paged_attention_mgpu(
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
    block_q: int = 64,
    block_kv: int = BLOCK_KV,
    max_concurrent_steps: int = MAX_CONCURRENT_STEPS,
    packing=None,
    out=None,
):
    """Mosaic GPU twin of ``ragged_paged_attention`` (same arguments; see module docstring).

    ``packing``: ``make_packing(...)`` of the same segment arrays (built once per step and shared
    by every layer), or None to build it here. ``out`` (optional, ``q``'s shape): the rows of the
    segments are written into it and every other row keeps its value (default: zeros). The CPU
    tests run the kernel in Pallas' GPU interpreter with a stand-in for wgmma
    (``tests/kernels/conftest.py``).
    """
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_rows, num_heads, head_dim = q.shape
    _, kvh, num_pages, block_size, _ = k_pages.shape
    why = supported(q.dtype, head_dim, block_size, block_kv)
    if why is not None:
        raise ValueError(f"ragged_paged_attention_mgpu cannot serve {why}")
    if block_q != 64 or max_concurrent_steps < 2:
        raise ValueError("block_q must be 64 (one wgmma M tile per warpgroup) and max_concurrent_steps >= 2")
    g = num_heads // kvh
    if packing is None:
        packing = make_packing(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=num_rows, block_q=block_q)
    n_t = packed_tiles(packing, seg_block_table)
    if out is None:
        out = jnp.zeros_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out {out.shape} {out.dtype} must match q {q.shape} {q.dtype}")
    # The TMA's tiled view wants a row count that is a multiple of ALIGN, and a window's Q box
    # never larger than the array: engine buckets (multiples of 8, >= 128) need no padding.
    rows_in = max(COMPUTE_WGS * block_q, -(-num_rows // ALIGN) * ALIGN)
    if rows_in != num_rows:
        q = jnp.pad(q, ((0, rows_in - num_rows), (0, 0), (0, 0)))
        out = jnp.pad(out, ((0, rows_in - num_rows), (0, 0), (0, 0)))

    def entry(meta_ref, layer_ref, q_ref, k_ref, v_ref, out_ref):
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        ts = (tiling, swizzle)
        scratch = [
            plgpu.SMEM((COMPUTE_WGS, block_q, head_dim), q.dtype, transforms=ts),
            plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), q.dtype, transforms=ts),
            plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), q.dtype, transforms=ts),
            plgpu.SMEM((COMPUTE_WGS, block_q, head_dim), q.dtype),  # output rows, untiled: any row is a TMA start
        ]
        pages = block_kv // block_size
        pl.run_scoped(
            lambda *scoped: _kernel(
                meta_ref,
                layer_ref,
                q_ref,
                k_ref,
                v_ref,
                out_ref,
                scoped,
                g=g,
                num_tiles=n_t,
                block_q=block_q,
                block_kv=block_kv,
                block_size=block_size,
                steps=max_concurrent_steps,
                scale_log2=float(sm_scale) * LOG2E,
                max_blocks=seg_block_table.shape[1],
                num_pages=num_pages,
            ),
            scratch,
            (
                plgpu.Barrier(num_arrivals=pages, num_barriers=max_concurrent_steps),
                plgpu.Barrier(num_arrivals=pages, num_barriers=max_concurrent_steps),
                plgpu.Barrier(num_barriers=COMPUTE_WGS),
            ),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=max_concurrent_steps),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    out_ref = jax.new_ref(out)  # written in place: the kernel stores its segments' rows only
    plgpu.kernel(
        entry,
        out_type=(),
        # Heads vary fastest (Mosaic launches the last grid axis as CUDA's x): the padding windows'
        # CTAs come after every real one instead of between them (docs/decisions.md, "Mosaic
        # attention grid: heads vary fastest").
        grid=(n_t, num_heads),
        grid_names=("tiles", "heads"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(packing.meta, jnp.asarray(layer, jnp.int32).reshape(1), q, k_pages, v_pages, out_ref)
    return out_ref[...][:num_rows]


def mgpu_tiles(num_rows: int, num_segments: int, block_q: int = 64, *, min_segment_rows: int = 1) -> int:
    """Query windows the kernel launches for a bucket (static): a true bound on what ``tile_rows``
    needs.

    A segment of ``n`` rows takes ``ceil((n + lead) / 128)`` windows, ``lead < ALIGN``, i.e. at
    most ``(n + 127 + ALIGN - 1) / 128``; ``k`` segments with rows cover at most ``R`` rows, so
    they need at most ``(R + k * (127 + ALIGN - 1)) // 128`` windows, and never more than ``R``
    (every window holds a row of its segment). ``min_segment_rows``: every segment that holds
    rows holds at least this many (the hybrid split's long segments), so ``k <= R //
    min_segment_rows``: with 32, ``(R + (R // 32) * 134) // 128`` windows, about ``R / 26``,
    whatever ``S`` is.
    """
    return num_tiles(num_rows, num_segments, COMPUTE_WGS * block_q, min_segment_rows=min_segment_rows, align=ALIGN)
