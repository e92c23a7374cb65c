"""Split-K paged attention for decode rows and short segments on Hopper (Pallas, Mosaic GPU).

Same contract as ``ragged_paged_attention`` (docs/contracts.md). Written for what the Triton
kernel does worst and the prefill Mosaic kernel (``ragged_paged_attention_mgpu``) cannot do at
all: a few query rows over a long context, where the work is the K/V read and its latency.

* One CTA = (work item, KV head); a work item is one run of one query tile's context. A *tile*
  is up to ``block_q`` rows of one segment (8 by default in the engine's ``S = R`` buckets: a
  decode row is a tile; a longer segment spans several tiles, each reading its context once),
  times the ``g = H / KVH`` query heads of the KV head, packed head-major into the 64 rows of one
  wgmma tile (row ``m = j * block_q + i``: head ``j``, tile row ``i``). Rows past ``g * block_q``
  are never loaded nor stored: every wgmma and softmax row is independent, so whatever they hold
  stays in them. Compute is irrelevant here (the padding still leaves wgmma far below the memory
  time); bandwidth and latency are not.
* The grid is static (``num_items x KVH``, :func:`decode_tuning`) but the split is decided on
  the device from the *active* tiles' contexts (:func:`make_decode_plan`): the items aim at
  ``target_ctas`` CTAs (~2 per SM) whatever the bucket's padding, share one step quantum (a long
  context gets more runs than a short one) and never cut a run below ``min_split_tokens``.
  Items past the plan's last return at once.
* Per CTA, a memory warpgroup streams the split's K/V, ``block_kv / block_size`` TMA page copies
  per step through the segment's block table (``[L, KVH, NB, BS, hd]`` pool, the traced layer read
  inside the kernel), into a ring of ``max_concurrent_steps`` slots; the compute warpgroup runs
  QK^T and PV on wgmma with an online softmax in f32 (exp2 domain), masking only the steps that
  reach past the tile's first query position.
* Each CTA writes its normalised partial output (f32, only the ``g * block_q`` packed rows) and
  its log2-sum-exp; :func:`merge_splits` (plain jnp, fused by XLA) combines the items of each
  tile (segment reductions over the item list) and unpacks ``[R, H, hd]``. Rows of no
  segment come out as zeros.

Limits (checked, :func:`supported`): bfloat16/float16, head_dim a multiple of 64, ``block_size`` a
multiple of 8 dividing ``block_kv``, ``g <= 8`` (a tile holds at least 8 rows of each head). Like
the prefill Mosaic kernel, the slots of a segment's last page past its context are read and
multiplied by zero probabilities, so they must hold finite values (the engine's pool does); pages
wholly past the context are never read (the segment's first page is loaded in their place).

:func:`decode_attention_splits_reference` computes the same partials in jnp (the same work
items, page substitution and masks) and merges them with the same :func:`merge_splits`, so the
CPU tests check the decomposition against ``ragged_paged_attention_reference``. There is no CPU
interpret mode for the kernel (Pallas' GPU interpreter does not model wgmma).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import (
    _cdiv,
    _check_args,
    _next_pow2,
    _searchsorted_right,
    num_tiles,
    query_tiles,
)
from pallas_kernels.ragged_paged_attention_mgpu import stream_kv

LOG2E = math.log2(math.e)
NEG = -1e30  # finite "minus infinity" (as in the other kernels: never inf - inf)
M_TILE = 64  # rows of one wgmma tile
# Defaults (not yet tuned on the GPU): 64-token steps, two in flight (~112 KB of shared memory
# with head_dim 128, so two CTAs fit an SM), ~2 CTAs per SM of an H200, runs of >= 128 tokens.
BLOCK_KV = 64
MAX_CONCURRENT_STEPS = 2
TARGET_CTAS = 264
MIN_SPLIT_TOKENS = 128
SMEM_LIMIT = 227 * 1024 - 512  # per CTA on Hopper (232448 B on the H200), less the barriers
META_FIELDS = 8  # per work item: seg, row0, nrows, pos0, k0, k1, 0, 0


def supported(
    q_dtype, head_dim: int, block_size: int, num_q_per_kv: int = 1, block_kv: int | None = None
) -> str | None:
    """Why this kernel cannot serve a launch (``None`` when it can); ``block_kv`` as
    :func:`decode_tuning` defaults it."""
    block_kv = max(BLOCK_KV, block_size) if block_kv is None else block_kv
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q_dtype).name} (needs bfloat16 or float16)"
    if head_dim % 64:
        return f"head_dim {head_dim} (needs a multiple of 64)"
    if block_size % 8 or block_kv % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing block_kv={block_kv})"
    if block_kv % 64:  # P.V contracts over the step: wgmma's K is a multiple of 64 (128-byte swizzle)
        return f"block_kv {block_kv} (needs a multiple of 64)"
    if not 1 <= num_q_per_kv <= 8:
        return f"{num_q_per_kv} query heads per KV head (needs 1..8: 8 rows of each in a 64-row tile)"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static knobs of one launch and the static sizes they give the bucket (hashable: the plan
    carries it, so a plan and the launch that uses it cannot disagree)."""

    block_q: int  # rows of one segment per tile (a multiple of 8, block_q * g <= 64)
    block_kv: int  # K/V tokens per pipeline step
    max_concurrent_steps: int  # steps in flight (shared-memory ring slots)
    min_split_tokens: int  # no run of a split context is shorter (a multiple of block_kv)
    target_ctas: int  # CTAs (items x KV heads) the plan aims for
    num_tiles: int  # static query tiles of the bucket
    target_items: int  # ceil(target_ctas / KVH)
    max_splits: int  # static bound on one tile's items
    num_items: int  # static work items (grid = num_items x KVH)


def decode_tuning(
    num_rows: int,
    num_segments: int,
    num_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    *,
    block_q: int | None = None,
    block_kv: int | None = None,
    max_concurrent_steps: int | None = None,
    min_split_tokens: int | None = None,
    target_ctas: int | None = None,
) -> DecodeTuning:
    """Defaults for a bucket ``(R, S)`` and its static sizes; any knob given overrides it.

    ``block_q``: ~rows per segment, at least 8 (``S = R`` engine buckets: 8), at most ``64 / g``.
    With ``T = num_tiles(R, S, block_q)``, ``E = ceil(target_ctas / KVH)`` and ``P_ctx`` =
    ``max(1, max_steps // min_steps)`` (the most runs of ``min_split_tokens`` a ``max_blocks``-page
    context holds): ``max_splits = max(1, min(E - 1, P_ctx))`` and ``num_items`` =
    ``min(max(T, E), T * max_splits)``; :func:`make_decode_plan` proves both bounds.
    """
    g = num_heads // num_kv_heads
    if not 1 <= g <= 8:
        raise ValueError(f"decode_attention_mgpu cannot serve {g} query heads per KV head (needs 1..8)")
    cap = (M_TILE // g) // 8 * 8
    if block_q is None:
        block_q = min(cap, max(8, _next_pow2(_cdiv(num_rows, max(num_segments, 1)))))
    block_kv = max(BLOCK_KV, block_size) if block_kv is None else int(block_kv)
    max_concurrent_steps = MAX_CONCURRENT_STEPS if max_concurrent_steps is None else int(max_concurrent_steps)
    min_split_tokens = MIN_SPLIT_TOKENS if min_split_tokens is None else int(min_split_tokens)
    target_ctas = TARGET_CTAS if target_ctas is None else int(target_ctas)
    if block_q < 8 or block_q % 8 or block_q * g > M_TILE:
        raise ValueError(f"block_q={block_q} must be a multiple of 8 with block_q * g <= 64 (g={g})")
    if max_concurrent_steps < 1 or target_ctas < 1 or min_split_tokens < 1:
        raise ValueError(
            f"max_concurrent_steps, target_ctas and min_split_tokens must be >= 1, got "
            f"{max_concurrent_steps}, {target_ctas}, {min_split_tokens}"
        )
    if block_kv < 8 or block_kv % block_size or block_kv % 8:
        raise ValueError(f"block_kv={block_kv} must be a multiple of block_size={block_size} and of 8")
    min_steps = _cdiv(min_split_tokens, block_kv)
    max_steps = max(1, _cdiv(max_blocks * block_size, block_kv))
    tiles = num_tiles(num_rows, num_segments, block_q)
    target_items = _cdiv(target_ctas, num_kv_heads)
    max_splits = max(1, min(target_items - 1, max_steps // min_steps))
    num_items = min(max(tiles, target_items), tiles * max_splits)
    return DecodeTuning(
        int(block_q),
        block_kv,
        max_concurrent_steps,
        min_steps * block_kv,
        target_ctas,
        tiles,
        target_items,
        max_splits,
        num_items,
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("meta", "item_tile", "row_tile", "row_local"),
    meta_fields=("tuning",),
)
@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Per-invocation inputs of the kernel, built once and shared by every layer.

    ``meta``: per work item ``META_FIELDS`` int32 (seg, row0, nrows, pos0, k0, k1, 0, 0), then
    the block table, flat: one freshly computed array (Mosaic GPU wants 256-byte aligned operands;
    a slice of the engine's packed descriptor is not). ``item_tile [W]``: the item's tile
    (``num_tiles`` for padding items); ``row_tile [R]``: the row's tile (-1: no segment);
    ``row_local [R]``: its row within the tile.
    """

    meta: jax.Array
    item_tile: jax.Array
    row_tile: jax.Array
    row_local: jax.Array
    tuning: DecodeTuning

    @property
    def num_items(self) -> int:
        return self.tuning.num_items


def make_decode_plan(
    seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, *, num_rows: int, tuning: DecodeTuning
) -> DecodePlan:
    """Work items: the active tiles' contexts cut into balanced runs of whole ``block_kv`` steps.

    A tile of ``b`` steps (``kv_len = pos0 + nrows`` tokens, the context its last row sees) gets
    ``n = clamp(min(ceil(b / c), b // min_steps), 1, max_splits)`` items, where the step quantum
    ``c = max(min_steps, ceil(B / max(E - A, 1)))`` is shared by all tiles (``B``: total steps,
    ``A``: active tiles, ``E``: ``tuning.target_items``): long contexts get more splits, and item
    ``j`` runs steps ``[j b // n, (j + 1) b // n)`` (the last cut at ``kv_len``), so no run is
    shorter than ``min_split_tokens`` unless the whole context is. Items come tile by tile.

    Static bounds (``decode_tuning``): if ``A < E``, ``ceil(b / c) <= b / c + (c - 1) / c`` sums
    to less than ``B / c + A <= E`` items, and one tile's ``ceil(b / c) <= E - A <= E - 1``; if
    ``A >= E``, ``c >= B`` gives one item per tile, ``A <= T`` in all. So ``max(T, E)`` items and
    ``max(1, min(E - 1, P_ctx))`` per tile (``P_ctx`` clamps ``n`` too) always suffice.
    """
    bq, bk = tuning.block_q, tuning.block_kv
    t = query_tiles(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, block_q=bq, max_tiles=tuning.num_tiles)
    n_t, n_w = tuning.num_tiles, tuning.num_items
    min_steps = tuning.min_split_tokens // bk
    kv_len = jnp.where(t.nrows > 0, jnp.maximum(t.pos0 + t.nrows, 1), 0)
    steps = _cdiv(kv_len, bk)
    active = steps > 0
    quantum = jnp.maximum(
        min_steps, _cdiv(jnp.sum(steps), jnp.maximum(tuning.target_items - jnp.sum(active, dtype=jnp.int32), 1))
    )
    n_split = jnp.minimum(_cdiv(steps, quantum), lax.div(steps, jnp.int32(min_steps)))
    n_split = jnp.where(active, jnp.clip(n_split, 1, tuning.max_splits), 0).astype(jnp.int32)
    cum = jnp.cumsum(n_split)
    first = cum - n_split
    w = jnp.arange(n_w, dtype=jnp.int32)
    tile = _searchsorted_right(cum, w)
    valid = tile < n_t
    tile = jnp.minimum(tile, n_t - 1)
    j = w - first[tile]
    b, n = steps[tile], jnp.maximum(n_split[tile], 1)
    k0 = jnp.where(valid, lax.div(j * b, n) * bk, 0)
    k1 = jnp.where(valid, jnp.minimum(kv_len[tile], lax.div((j + 1) * b, n) * bk), 0)
    zero = jnp.zeros_like(w)
    items = jnp.stack(
        [t.seg[tile], t.row0[tile], jnp.where(valid, t.nrows[tile], 0), t.pos0[tile], k0, k1, zero, zero], axis=1
    ).astype(jnp.int32)
    meta = jnp.concatenate([items.reshape(-1), seg_block_table.astype(jnp.int32).reshape(-1)])
    i = jnp.arange(bq, dtype=jnp.int32)
    rows = jnp.where(i[None, :] < t.nrows[:, None], t.row0[:, None] + i[None, :], num_rows).reshape(-1)
    tile_id = jnp.broadcast_to(jnp.arange(n_t, dtype=jnp.int32)[:, None], (n_t, bq)).reshape(-1)
    local = jnp.broadcast_to(i[None, :], (n_t, bq)).reshape(-1)
    row_tile = jnp.full((num_rows,), -1, jnp.int32).at[rows].set(tile_id, mode="drop")
    row_local = jnp.zeros((num_rows,), jnp.int32).at[rows].set(local, mode="drop")
    item_tile = jnp.where(valid, tile, n_t).astype(jnp.int32)
    return DecodePlan(meta, item_tile, row_tile, row_local, tuning)


def plan_items(plan: DecodePlan):
    """The item fields back from ``meta`` (jnp; the kernel reads the same words):
    ``(seg, row0, nrows, pos0, k0, k1)``, each ``[num_items]``."""
    items = plan.meta[: plan.num_items * META_FIELDS].reshape(plan.num_items, META_FIELDS)
    return tuple(items[:, f] for f in range(6))


def merge_splits(part_o, part_lse, plan: DecodePlan, *, num_heads: int, dtype):
    """``[R, H, hd]`` from the partials of every item (log-sum-exp merge, plain jnp).

    ``part_o [W, KVH, g * block_q, hd]`` f32, normalised per item; ``part_lse [W, KVH, 64]`` f32,
    log2 of the item's softmax denominator plus its running max. Items are combined per tile by
    segment reductions (work ~ items, not rows x ``max_splits``), then each row takes its tile's
    row. Padding items are never written: they are selected away, never multiplied.
    """
    n_w, kvh, gbq, hd = part_o.shape
    g = num_heads // kvh
    bq, n_t = plan.tuning.block_q, plan.tuning.num_tiles
    real = (plan.item_tile < n_t)[:, None, None, None]
    lse = jnp.where(real, part_lse[..., :gbq].reshape(n_w, kvh, g, bq), NEG)
    o = jnp.where(real[..., None], part_o.reshape(n_w, kvh, g, bq, hd), 0.0)
    seg = dict(segment_ids=plan.item_tile, num_segments=n_t, indices_are_sorted=True)
    m = jax.ops.segment_max(lse, **seg)  # [T, KVH, g, bq]
    w = jnp.where(real, jnp.exp2(lse - m[jnp.minimum(plan.item_tile, n_t - 1)]), 0.0)
    denom = jax.ops.segment_sum(w, **seg)
    acc = jax.ops.segment_sum(o * w[..., None], **seg)  # [T, KVH, g, bq, hd]
    out_t = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    covered = plan.row_tile >= 0
    out = out_t[jnp.maximum(plan.row_tile, 0), :, :, plan.row_local]  # [R, KVH, g, hd]
    out = jnp.where(covered[:, None, None, None], out, 0.0)
    return out.reshape(-1, num_heads, hd).astype(dtype)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


def _kernel(
    meta_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    scoped,
    *,
    g: int,
    block_q: int,
    block_kv: int,
    block_size: int,
    steps: int,
    scale_log2: float,
    num_items: int,
    max_blocks: int,
    num_pages: int,
):
    (q_smem, o_smem, lse_smem, k_smem, v_smem), (q_ready, k_ready, v_ready), (k_free, v_free) = scoped
    w = lax.axis_index("items")
    kvh = lax.axis_index("kvh")
    wg = lax.axis_index("wg")
    base = w * META_FIELDS
    seg = meta_ref[base]
    row0 = meta_ref[base + 1]
    nrows = meta_ref[base + 2]
    pos0 = meta_ref[base + 3]
    k0 = meta_ref[base + 4]  # a multiple of block_kv
    k1 = meta_ref[base + 5]
    kv_len = pos0 + nrows
    active = (nrows > 0) & (k1 > k0)
    n_steps = jnp.where(active, _cdiv(k1 - k0, block_kv), 0)
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype

    @pl.when((wg == 0) & active)
    def _compute():
        for j in range(g):
            plgpu.copy_gmem_to_smem(
                q_ref.at[pl.ds(row0, block_q), kvh * g + j], q_smem.at[pl.ds(j * block_q, block_q)], q_ready
            )
        # Steps whose keys all sit at or before the tile's first query position need no mask.
        full_steps = jnp.clip(lax.div(jnp.maximum(pos0 + 1 - k0, 0), block_kv), 0, n_steps)
        m_i = plgpu.layout_cast(jnp.full((M_TILE,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((M_TILE,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((M_TILE, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        plgpu.barrier_wait(q_ready)
        # Q is the register (A) operand of QK^T: its shared-memory copy is untiled, because a tiled
        # TMA needs a tile-aligned start row and a segment's rows start anywhere.
        q_regs = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA)

        def kv_step(step, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(steps))
            plgpu.barrier_wait(k_ready.at[slot])

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_regs, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk_scope, plgpu.ACC((M_TILE, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * scale_log2
            if masked:
                mi = plgpu.broadcasted_iota(jnp.int32, (M_TILE, block_kv), 0, layout=plgpu.Layout.WGMMA)
                ki = plgpu.broadcasted_iota(jnp.int32, (M_TILE, block_kv), 1, layout=plgpu.Layout.WGMMA)
                q_pos = pos0 + lax.rem(mi, jnp.int32(block_q))
                s = jnp.where(k0 + step * block_kv + ki <= q_pos, s, NEG)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            prob = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + prob.sum(axis=1)
            p_lo = prob.astype(dtype)
            plgpu.barrier_wait(v_ready.at[slot])

            def pv_scope(acc_ref):
                plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])

            acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(full_steps, n_steps, functools.partial(kv_step, masked=True), carry)

        # A row that sees no key of this split (its position is before the split) keeps m = NEG:
        # its lse is NEG and the merge gives it weight 0.
        l_safe = jnp.where(l_i > 0, l_i, 1.0)
        acc = acc / lax.broadcast_in_dim(l_safe, (M_TILE, head_dim), [0])
        lse = jnp.where(m_i > 0.5 * NEG, m_i + jnp.log(l_safe) * LOG2E, NEG)
        o_smem[...] = acc
        lse_smem[...] = lse
        plgpu.commit_smem()
        gbq = g * block_q
        src = o_smem if gbq == M_TILE else o_smem.at[pl.ds(0, gbq)]
        plgpu.copy_smem_to_gmem(src, o_ref.at[w, kvh])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[w, kvh])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((wg == 1) & active)
    def _memory():
        layer = layer_ref[0]
        pages = block_kv // block_size
        # the block table follows the items in meta
        stream_kv(
            meta_ref, (k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free),
            layer=layer, kvh=kvh, table=META_FIELDS * num_items, seg=seg, max_blocks=max_blocks,
            num_pages=num_pages, ctx_pages=_cdiv(kv_len, block_size), first_blk=lax.div(k0, jnp.int32(block_size)),
            n_steps=n_steps, pages=pages, block_size=block_size, steps=steps,
        )  # fmt: skip


_STATIC = ("sm_scale", "block_q", "block_kv", "max_concurrent_steps", "min_split_tokens", "target_ctas")


def smem_bytes(head_dim: int, itemsize: int, block_kv: int, max_concurrent_steps: int) -> int:
    """Shared memory of one CTA (Q, the f32 output staging, lse, the K/V ring; barriers aside)."""
    return M_TILE * head_dim * (itemsize + 4) + M_TILE * 4 + 2 * max_concurrent_steps * block_kv * head_dim * itemsize


def _resolve(q, k_pages, seg_q_len, seg_block_table, plan, knobs, *, kernel: bool = True) -> DecodeTuning:
    """Shapes, checks and the tuning of one call (shared by the kernel and its jnp twin, which
    also takes float32: tight CPU checks of the decomposition). A plan fixes the tuning it was
    built with; a knob given next to it must agree."""
    num_rows, num_heads, head_dim = q.shape
    kvh, num_pages, block_size, _ = k_pages.shape[-4:]
    g = num_heads // kvh
    why = supported(q.dtype if kernel else jnp.bfloat16, head_dim, block_size, g, knobs.get("block_kv"))
    if why is not None:
        raise ValueError(f"decode_attention_mgpu cannot serve {why}")
    tuning = decode_tuning(num_rows, seg_q_len.shape[0], num_heads, kvh, seg_block_table.shape[1], block_size, **knobs)
    if plan is not None:
        given = {k: v for k, v in knobs.items() if v is not None}
        bucket = decode_tuning(
            num_rows, seg_q_len.shape[0], num_heads, kvh, seg_block_table.shape[1], block_size,
            **{k: getattr(plan.tuning, k) for k in knobs},
        )  # fmt: skip
        for name, value in given.items():
            if value != getattr(plan.tuning, name):
                raise ValueError(f"plan built for {name}={getattr(plan.tuning, name)}, the call asks {value}")
        if bucket != plan.tuning:
            raise ValueError(f"plan built for another bucket: {plan.tuning}, this call's is {bucket}")
        tuning = plan.tuning
    why = supported(q.dtype if kernel else jnp.bfloat16, head_dim, block_size, g, tuning.block_kv)
    if kernel and why is None:
        need = smem_bytes(head_dim, q.dtype.itemsize, tuning.block_kv, tuning.max_concurrent_steps)
        if need > SMEM_LIMIT:
            steps = f"block_kv={tuning.block_kv} x {tuning.max_concurrent_steps} steps"
            why = f"{steps} ({need} B of shared memory > {SMEM_LIMIT})"
    if why is not None:
        raise ValueError(f"decode_attention_mgpu cannot serve {why}")
    return tuning


def _knobs(block_q, block_kv, max_concurrent_steps, min_split_tokens, target_ctas):
    return dict(
        block_q=block_q,
        block_kv=block_kv,
        max_concurrent_steps=max_concurrent_steps,
        min_split_tokens=min_split_tokens,
        target_ctas=target_ctas,
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_attention_mgpu(
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
    block_q: int | None = None,
    block_kv: int | None = None,
    max_concurrent_steps: int | None = None,
    min_split_tokens: int | None = None,
    target_ctas: int | None = None,
    plan: DecodePlan | None = None,
):
    """Mosaic GPU split-K twin of ``ragged_paged_attention`` (same arguments; module docstring).

    ``plan``: ``make_decode_plan(...)`` of the same segment arrays (built once per step and shared
    by every layer), or None to build it here. Knobs default by bucket (:func:`decode_tuning`).
    """
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    knobs = _knobs(block_q, block_kv, max_concurrent_steps, min_split_tokens, target_ctas)
    tuning = _resolve(q, k_pages, seg_q_len, seg_block_table, plan, knobs)
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_rows, num_heads, head_dim = q.shape
    _, kvh, num_pages, block_size, _ = k_pages.shape
    g = num_heads // kvh
    bq, bk, steps = tuning.block_q, tuning.block_kv, tuning.max_concurrent_steps
    if plan is None:
        plan = make_decode_plan(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=num_rows, tuning=tuning)
    n_w = tuning.num_items
    if num_rows < bq:  # a tile's TMA box of block_q rows must fit in q (rows past R read as zeros)
        q = jnp.pad(q, ((0, bq - num_rows), (0, 0), (0, 0)))

    def entry(meta_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        ts = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        ts32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
        scratch = (
            plgpu.SMEM((M_TILE, head_dim), q.dtype),
            plgpu.SMEM((M_TILE, head_dim), jnp.float32, transforms=ts32),
            plgpu.SMEM((M_TILE,), jnp.float32),
            plgpu.SMEM((steps, bk, head_dim), q.dtype, transforms=ts),
            plgpu.SMEM((steps, bk, head_dim), q.dtype, transforms=ts),
        )
        pages = bk // block_size
        pl.run_scoped(
            lambda *scoped: _kernel(
                meta_ref,
                layer_ref,
                q_ref,
                k_ref,
                v_ref,
                o_ref,
                lse_ref,
                scoped,
                g=g,
                block_q=bq,
                block_kv=bk,
                block_size=block_size,
                steps=steps,
                scale_log2=float(sm_scale) * LOG2E,
                num_items=n_w,
                max_blocks=seg_block_table.shape[1],
                num_pages=num_pages,
            ),
            scratch,
            (
                plgpu.Barrier(num_arrivals=g),
                plgpu.Barrier(num_arrivals=pages, num_barriers=steps),
                plgpu.Barrier(num_arrivals=pages, num_barriers=steps),
            ),
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps)),
            collective_axes="wg",
        )

    part_o, part_lse = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((n_w, kvh, g * bq, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((n_w, kvh, M_TILE), jnp.float32),
        ),
        grid=(n_w, kvh),
        grid_names=("items", "kvh"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(plan.meta, jnp.asarray(layer, jnp.int32).reshape(1), q, k_pages, v_pages)
    return merge_splits(part_o, part_lse, plan, num_heads=num_heads, dtype=q.dtype)


# ----------------------------------------------------------------------------------------------
# jnp twin of the split decomposition
# ----------------------------------------------------------------------------------------------


def decode_splits_partials(q, k_pages, v_pages, seg_block_table, layer, plan: DecodePlan, *, sm_scale: float):
    """The kernel's partials ``(part_o, part_lse)`` computed in jnp: the same work items, page
    substitution, causal mask (on every step: the kernel's unmasked steps see no masked key of a
    real row), bf16 probabilities into P.V and f32 accumulation."""
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_rows, num_heads, head_dim = q.shape
    _, kvh, _, block_size, _ = k_pages.shape
    g = num_heads // kvh
    bq, bk = plan.tuning.block_q, plan.tuning.block_kv
    max_blocks = seg_block_table.shape[1]
    seg, row0, nrows, pos0, k0, k1 = plan_items(plan)
    n_w = seg.shape[0]
    span = _cdiv(max_blocks * block_size, bk) * bk  # the longest run an item can have (one per tile)
    kv_len = pos0 + nrows
    active = (nrows > 0) & (k1 > k0)
    n_steps = jnp.where(active, _cdiv(k1 - k0, bk), 0)
    kpos = k0[:, None] + jnp.arange(span, dtype=jnp.int32)[None, :]  # [W, span]
    in_run = jnp.arange(span)[None, :] < (n_steps * bk)[:, None]
    blk = kpos // block_size
    ctx_pages = _cdiv(kv_len, block_size)[:, None]
    blk = jnp.where(blk < ctx_pages, jnp.minimum(blk, max_blocks - 1), 0)
    page = seg_block_table.astype(jnp.int32)[seg[:, None], blk]  # [W, span]
    slot = kpos % block_size
    kd = k_pages[layer][:, page, slot]  # [KVH, W, span, hd]
    vd = v_pages[layer][:, page, slot]
    # queries, packed head-major as the kernel loads them: m = j * bq + i
    i = jnp.arange(bq, dtype=jnp.int32)
    rows = row0[:, None] + i[None, :]
    qt = jnp.take(q, jnp.where(rows < num_rows, rows, num_rows), axis=0, mode="fill", fill_value=0)  # [W, bq, H, hd]
    qt = qt.reshape(n_w, bq, kvh, g, head_dim)
    s = jnp.einsum("wikjd,kwsd->wkjis", qt, kd, preferred_element_type=jnp.float32) * (sm_scale * LOG2E)
    q_pos = (pos0[:, None] + i[None, :])[:, None, None, :, None]  # [W,1,1,bq,1]
    ok = (kpos[:, None, None, None, :] <= q_pos) & in_run[:, None, None, None, :]
    s = jnp.where(ok, s, NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.maximum(m, NEG)
    prob = jnp.where(in_run[:, None, None, None, :], jnp.exp2(s - m), 0.0)
    l = jnp.sum(prob, axis=-1)  # [W, KVH, g, bq]
    o = jnp.einsum("wkjis,kwsd->wkjid", prob.astype(q.dtype), vd, preferred_element_type=jnp.float32)
    l_safe = jnp.where(l > 0, l, 1.0)
    o = o / l_safe[..., None]
    m = m[..., 0]
    lse = jnp.where(m > 0.5 * NEG, m + jnp.log2(l_safe), NEG)
    part_o = o.reshape(n_w, kvh, g * bq, head_dim)
    part_lse = jnp.pad(lse.reshape(n_w, kvh, g * bq), ((0, 0), (0, 0), (0, M_TILE - g * bq)))
    return part_o, part_lse


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_attention_splits_reference(
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
    block_q: int | None = None,
    block_kv: int | None = None,
    max_concurrent_steps: int | None = None,
    min_split_tokens: int | None = None,
    target_ctas: int | None = None,
    plan: DecodePlan | None = None,
):
    """jnp twin of :func:`decode_attention_mgpu` (same arguments): the kernel's partials from
    :func:`decode_splits_partials`, merged by the same :func:`merge_splits`. Needs no GPU; its
    memory grows with the work items x the block table's width (small shapes only)."""
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    knobs = _knobs(block_q, block_kv, max_concurrent_steps, min_split_tokens, target_ctas)
    tuning = _resolve(q, k_pages, seg_q_len, seg_block_table, plan, knobs, kernel=False)
    if plan is None:
        plan = make_decode_plan(
            seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=q.shape[0], tuning=tuning
        )
    part_o, part_lse = decode_splits_partials(q, k_pages, v_pages, seg_block_table, layer, plan, sm_scale=sm_scale)
    return merge_splits(part_o, part_lse, plan, num_heads=q.shape[1], dtype=q.dtype)
