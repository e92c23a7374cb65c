"""Split-K paged attention for decode rows and short segments on Hopper (Pallas, Mosaic GPU).

Same contract as ``ragged_paged_attention`` (docs/contracts.md). Written for what the Triton
kernel does worst and the prefill Mosaic kernel (``ragged_paged_attention_mgpu``) cannot do at
all: a few query rows over a long context, where the work is the K/V read and its latency.

* One CTA = (query tile, context split, KV head). A *tile* is up to ``block_q`` rows of one segment
  (8 by default in the engine's ``S = R`` buckets: a decode row is a tile; a longer segment spans
  several tiles, each reading its context once), times the ``g = H / KVH`` query heads of the KV
  head, packed head-major into the 64 rows of one wgmma tile (row ``m = j * block_q + i``: head
  ``j``, tile row ``i``). Rows past ``g * block_q`` are never loaded nor stored: every wgmma and
  softmax row is independent, so whatever they hold stays in them. Compute is irrelevant here
  (the padding still leaves wgmma far below the memory time); bandwidth and latency are not.
* The context of a tile is cut into ``n_split <= splits`` runs of whole ``block_kv`` steps (the
  number per tile is decided on the device from its context length, so a short context is not
  split into slivers; ``splits`` is static, chosen from the bucket so that a single decode row
  still launches ~2 CTAs per SM). Splits past ``n_split`` and padding tiles return at once.
* Per CTA, a memory warpgroup streams the split's K/V, ``block_kv / block_size`` TMA page copies
  per step through the segment's block table (``[L, KVH, NB, BS, hd]`` pool, the traced layer read
  inside the kernel), into a ring of ``max_concurrent_steps`` slots; the compute warpgroup runs
  QK^T and PV on wgmma with an online softmax in f32 (exp2 domain), masking only the steps that
  reach past the tile's first query position.
* Each CTA writes its normalised partial output (f32, only the ``g * block_q`` packed rows) and
  its log2-sum-exp; :func:`merge_splits` (plain jnp, fused by XLA) combines the splits of each
  row and unpacks ``[R, H, hd]``. Rows of no segment come out as zeros.

Limits (checked, :func:`supported`): bfloat16/float16, head_dim a multiple of 64, ``block_size`` a
multiple of 8 dividing ``block_kv``, ``g <= 8`` (a tile holds at least 8 rows of each head). Like
the prefill Mosaic kernel, the slots of a segment's last page past its context are read and
multiplied by zero probabilities, so they must hold finite values (the engine's pool does); pages
wholly past the context are never read (the segment's first page is loaded in their place).

:func:`decode_attention_splits_reference` computes the same partials in jnp (the same tiles,
splits, page substitution and masks) and merges them with the same :func:`merge_splits`, so the
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

from pallas_kernels.ragged_paged_attention import _cdiv, _check_args, _next_pow2, num_tiles, query_tiles
from pallas_kernels.ragged_paged_attention_mgpu import stream_kv

LOG2E = math.log2(math.e)
NEG = -1e30  # finite "minus infinity" (as in the other kernels: never inf - inf)
M_TILE = 64  # rows of one wgmma tile
# Defaults (not yet tuned on the GPU): 64-token steps, two in flight (~112 KB of shared memory
# with head_dim 128, so two CTAs fit an SM), ~2 CTAs per SM of an H200, splits of >= 128 tokens.
BLOCK_KV = 64
MAX_CONCURRENT_STEPS = 2
TARGET_CTAS = 264
MIN_SPLIT_TOKENS = 128
SMEM_LIMIT = 227 * 1024 - 512  # per CTA on Hopper (232448 B on the H200), less the barriers
META_FIELDS = 8  # per tile: seg, row0, nrows, pos0, n_split, chunk, 0, 0


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
    if not 1 <= num_q_per_kv <= 8:
        return f"{num_q_per_kv} query heads per KV head (needs 1..8: 8 rows of each in a 64-row tile)"
    return None


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static knobs of one launch; :class:`DecodePlan` depends on ``block_q``, ``splits``,
    ``block_kv`` and ``min_split_tokens``."""

    block_q: int  # rows of one segment per tile (a multiple of 8, block_q * g <= 64)
    splits: int  # most context splits of one tile (grid dimension)
    block_kv: int  # K/V tokens per pipeline step
    max_concurrent_steps: int  # steps in flight (shared-memory ring slots)
    min_split_tokens: int  # never split a context into runs shorter than this


def decode_tuning(
    num_rows: int,
    num_segments: int,
    num_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    *,
    block_q: int | None = None,
    splits: int | None = None,
    block_kv: int | None = None,
    max_concurrent_steps: int | None = None,
    min_split_tokens: int | None = None,
    target_ctas: int = TARGET_CTAS,
) -> DecodeTuning:
    """Defaults for a bucket ``(R, S)``; any knob given overrides it.

    ``block_q``: ~rows per segment, at least 8 (``S = R`` engine buckets: 8), at most ``64 / g``.
    ``splits``: enough that the bucket's tiles x KV heads x splits reach ``target_ctas``, but no
    more than a ``max_blocks``-page context has runs of ``min_split_tokens``.
    """
    g = num_heads // num_kv_heads
    if not 1 <= g <= 8:
        raise ValueError(f"decode_attention_mgpu cannot serve {g} query heads per KV head (needs 1..8)")
    cap = (M_TILE // g) // 8 * 8
    if block_q is None:
        block_q = min(cap, max(8, _next_pow2(_cdiv(num_rows, max(num_segments, 1)))))
    if block_kv is None:
        block_kv = max(BLOCK_KV, block_size)
    if max_concurrent_steps is None:
        max_concurrent_steps = MAX_CONCURRENT_STEPS
    if min_split_tokens is None:
        min_split_tokens = MIN_SPLIT_TOKENS
    min_split_tokens = _cdiv(max(min_split_tokens, 1), block_kv) * block_kv
    if splits is None:
        tiles = num_tiles(num_rows, num_segments, block_q)
        want = _cdiv(target_ctas, tiles * num_kv_heads)
        splits = max(1, min(want, _cdiv(max_blocks * block_size, min_split_tokens)))
    t = DecodeTuning(int(block_q), int(splits), int(block_kv), int(max_concurrent_steps), int(min_split_tokens))
    if t.block_q < 8 or t.block_q % 8 or t.block_q * g > M_TILE:
        raise ValueError(f"block_q={t.block_q} must be a multiple of 8 with block_q * g <= 64 (g={g})")
    if t.splits < 1 or t.max_concurrent_steps < 1:
        raise ValueError(f"splits and max_concurrent_steps must be >= 1, got {t}")
    if t.block_kv % block_size or t.block_kv % 8:
        raise ValueError(f"block_kv={t.block_kv} must be a multiple of block_size={block_size} and of 8")
    return t


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("meta", "row_tile", "row_local"),
    meta_fields=("block_q", "splits", "block_kv", "num_tiles"),
)
@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Per-invocation inputs of the kernel, built once and shared by every layer.

    ``meta``: per tile ``META_FIELDS`` int32 (seg, row0, nrows, pos0, n_split, chunk, 0, 0), then
    the block table, flat: one freshly computed array (Mosaic GPU wants 256-byte aligned operands;
    a slice of the engine's packed descriptor is not). ``row_tile [R]``: the row's tile (-1: no
    segment); ``row_local [R]``: its row within the tile.
    """

    meta: jax.Array
    row_tile: jax.Array
    row_local: jax.Array
    block_q: int
    splits: int
    block_kv: int
    num_tiles: int


def make_decode_plan(
    seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, *, num_rows: int, tuning: DecodeTuning
) -> DecodePlan:
    """Tiles of ``block_q`` rows, each split into ``n_split`` runs of ``chunk`` tokens.

    ``n_split = clamp(ceil(kv_len / min_split_tokens), 1, splits)`` and ``chunk`` =
    ``ceil(kv_len / n_split)`` rounded up to whole steps (``n_split`` recomputed from it, so no run
    is empty); ``kv_len = pos0 + nrows`` is the context the tile's last row sees.
    """
    bq, bk = tuning.block_q, tuning.block_kv
    t = query_tiles(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, block_q=bq)
    n_t = t.seg.shape[0]
    kv_len = jnp.where(t.nrows > 0, jnp.maximum(t.pos0 + t.nrows, 1), 0)
    n_split = jnp.clip(_cdiv(kv_len, tuning.min_split_tokens), 1, tuning.splits)
    chunk = _cdiv(_cdiv(kv_len, n_split), bk) * bk
    n_split = jnp.where(t.nrows > 0, _cdiv(kv_len, jnp.maximum(chunk, 1)), 0)
    zero = jnp.zeros_like(t.seg)
    tiles = jnp.stack([t.seg, t.row0, t.nrows, t.pos0, n_split, chunk, zero, zero], axis=1).astype(jnp.int32)
    meta = jnp.concatenate([tiles.reshape(-1), seg_block_table.astype(jnp.int32).reshape(-1)])
    i = jnp.arange(bq, dtype=jnp.int32)
    rows = jnp.where(i[None, :] < t.nrows[:, None], t.row0[:, None] + i[None, :], num_rows).reshape(-1)
    tile_id = jnp.broadcast_to(jnp.arange(n_t, dtype=jnp.int32)[:, None], (n_t, bq)).reshape(-1)
    local = jnp.broadcast_to(i[None, :], (n_t, bq)).reshape(-1)
    row_tile = jnp.full((num_rows,), -1, jnp.int32).at[rows].set(tile_id, mode="drop")
    row_local = jnp.zeros((num_rows,), jnp.int32).at[rows].set(local, mode="drop")
    return DecodePlan(meta, row_tile, row_local, bq, tuning.splits, bk, n_t)


def _plan_fields(plan: DecodePlan):
    """The tile fields back from ``meta`` (jnp; the kernel reads the same words)."""
    n_t = plan.num_tiles
    tiles = plan.meta[: n_t * META_FIELDS].reshape(n_t, META_FIELDS)
    return tiles[:, 0], tiles[:, 1], tiles[:, 2], tiles[:, 3], tiles[:, 4], tiles[:, 5]


def merge_splits(part_o, part_lse, plan: DecodePlan, *, num_heads: int, dtype):
    """``[R, H, hd]`` from the partials of every split (log-sum-exp merge, plain jnp).

    ``part_o [T, P, KVH, g * block_q, hd]`` f32, normalised per split; ``part_lse [T, P, KVH, 64]``
    f32, log2 of the split's softmax denominator plus its running max. Splits past the tile's
    ``n_split`` are never written: they are selected away, never multiplied.
    """
    n_t, p_max, kvh, gbq, hd = part_o.shape
    g = num_heads // kvh
    bq = plan.block_q
    n_split = _plan_fields(plan)[4]
    covered = plan.row_tile >= 0
    t = jnp.maximum(plan.row_tile, 0)
    i = plan.row_local
    o = part_o.reshape(n_t, p_max, kvh, g, bq, hd)[t, :, :, :, i]  # [R, P, KVH, g, hd]
    lse = part_lse[..., :gbq].reshape(n_t, p_max, kvh, g, bq)[t, :, :, :, i]  # [R, P, KVH, g]
    valid = (jnp.arange(p_max, dtype=jnp.int32)[None, :] < n_split[t][:, None]) & covered[:, None]  # [R, P]
    valid = valid[:, :, None, None]
    lse = jnp.where(valid, lse, NEG)
    m = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.where(valid, jnp.exp2(lse - m), 0.0)
    denom = jnp.sum(w, axis=1)  # [R, KVH, g]
    acc = jnp.sum(jnp.where(valid[..., None], o, 0.0) * w[..., None], axis=1)  # [R, KVH, g, hd]
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
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
    num_tiles: int,
    max_blocks: int,
    num_pages: int,
):
    (q_smem, o_smem, lse_smem, k_smem, v_smem), (q_ready, k_ready, v_ready), (k_free, v_free) = scoped
    t = lax.axis_index("tiles")
    p = lax.axis_index("splits")
    kvh = lax.axis_index("kvh")
    wg = lax.axis_index("wg")
    base = t * META_FIELDS
    seg = meta_ref[base]
    row0 = meta_ref[base + 1]
    nrows = meta_ref[base + 2]
    pos0 = meta_ref[base + 3]
    n_split = meta_ref[base + 4]
    chunk = meta_ref[base + 5]
    kv_len = pos0 + nrows
    k0 = p * chunk  # a multiple of block_kv
    k1 = jnp.minimum(kv_len, k0 + chunk)
    active = (nrows > 0) & (p < n_split)
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
        plgpu.copy_smem_to_gmem(src, o_ref.at[t, p, kvh])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[t, p, kvh])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((wg == 1) & active)
    def _memory():
        layer = layer_ref[0]
        pages = block_kv // block_size
        # the block table follows the tiles in meta
        stream_kv(
            meta_ref, (k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free),
            layer=layer, kvh=kvh, table=META_FIELDS * num_tiles, seg=seg, max_blocks=max_blocks,
            num_pages=num_pages, ctx_pages=_cdiv(kv_len, block_size), first_blk=lax.div(k0, jnp.int32(block_size)),
            n_steps=n_steps, pages=pages, block_size=block_size, steps=steps,
        )  # fmt: skip


_STATIC = ("sm_scale", "block_q", "splits", "block_kv", "max_concurrent_steps", "min_split_tokens")


def smem_bytes(head_dim: int, itemsize: int, block_kv: int, max_concurrent_steps: int) -> int:
    """Shared memory of one CTA (Q, the f32 output staging, lse, the K/V ring; barriers aside)."""
    return M_TILE * head_dim * (itemsize + 4) + M_TILE * 4 + 2 * max_concurrent_steps * block_kv * head_dim * itemsize


def _resolve(q, k_pages, seg_q_len, seg_block_table, layer, plan, knobs, *, kernel: bool = True):
    """Shapes, checks and the tuning of one call (shared by the kernel and its jnp twin, which
    also takes float32: tight CPU checks of the decomposition)."""
    num_rows, num_heads, head_dim = q.shape
    kvh, num_pages, block_size, _ = k_pages.shape[-4:]
    g = num_heads // kvh
    if plan is not None:  # the plan fixes the tiling it was built for
        for name in ("block_q", "splits", "block_kv"):
            given = knobs.get(name)
            if given is not None and given != getattr(plan, name):
                raise ValueError(f"plan built for {name}={getattr(plan, name)}, the call asks {given}")
            knobs[name] = getattr(plan, name)
    why = supported(q.dtype if kernel else jnp.bfloat16, head_dim, block_size, g, knobs.get("block_kv"))
    if why is not None:
        raise ValueError(f"decode_attention_mgpu cannot serve {why}")
    tuning = decode_tuning(num_rows, seg_q_len.shape[0], num_heads, kvh, seg_block_table.shape[1], block_size, **knobs)
    why = supported(q.dtype if kernel else jnp.bfloat16, head_dim, block_size, g, tuning.block_kv)
    if kernel and why is None:
        need = smem_bytes(head_dim, q.dtype.itemsize, tuning.block_kv, tuning.max_concurrent_steps)
        if need > SMEM_LIMIT:
            steps = f"block_kv={tuning.block_kv} x {tuning.max_concurrent_steps} steps"
            why = f"{steps} ({need} B of shared memory > {SMEM_LIMIT})"
    if why is not None:
        raise ValueError(f"decode_attention_mgpu cannot serve {why}")
    return tuning


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
    splits: int | None = None,
    block_kv: int | None = None,
    max_concurrent_steps: int | None = None,
    min_split_tokens: int | None = None,
    plan: DecodePlan | None = None,
):
    """Mosaic GPU split-K twin of ``ragged_paged_attention`` (same arguments; module docstring).

    ``plan``: ``make_decode_plan(...)`` of the same segment arrays (built once per step and shared
    by every layer), or None to build it here. Knobs default by bucket (:func:`decode_tuning`).
    """
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    knobs = dict(
        block_q=block_q,
        splits=splits,
        block_kv=block_kv,
        max_concurrent_steps=max_concurrent_steps,
        min_split_tokens=min_split_tokens,
    )
    tuning = _resolve(q, k_pages, seg_q_len, seg_block_table, layer, plan, knobs)
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_rows, num_heads, head_dim = q.shape
    _, kvh, num_pages, block_size, _ = k_pages.shape
    g = num_heads // kvh
    bq, bk, steps = tuning.block_q, tuning.block_kv, tuning.max_concurrent_steps
    if plan is None:
        plan = make_decode_plan(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=num_rows, tuning=tuning)
    n_t, n_p = plan.num_tiles, plan.splits
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
                num_tiles=n_t,
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
            jax.ShapeDtypeStruct((n_t, n_p, kvh, g * bq, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((n_t, n_p, kvh, M_TILE), jnp.float32),
        ),
        grid=(n_t, n_p, kvh),
        grid_names=("tiles", "splits", "kvh"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(plan.meta, jnp.asarray(layer, jnp.int32).reshape(1), q, k_pages, v_pages)
    return merge_splits(part_o, part_lse, plan, num_heads=num_heads, dtype=q.dtype)


# ----------------------------------------------------------------------------------------------
# jnp twin of the split decomposition
# ----------------------------------------------------------------------------------------------


def decode_splits_partials(q, k_pages, v_pages, seg_block_table, layer, plan: DecodePlan, *, sm_scale: float):
    """The kernel's partials ``(part_o, part_lse)`` computed in jnp: the same tiles, splits, page
    substitution, causal mask (on every step: the kernel's unmasked steps see no masked key of a
    real row), bf16 probabilities into P.V and f32 accumulation."""
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_rows, num_heads, head_dim = q.shape
    _, kvh, _, block_size, _ = k_pages.shape
    g = num_heads // kvh
    bq, bk, n_p = plan.block_q, plan.block_kv, plan.splits
    max_blocks = seg_block_table.shape[1]
    seg, row0, nrows, pos0, n_split, chunk = _plan_fields(plan)
    n_t = seg.shape[0]
    span = _cdiv(max_blocks * block_size, bk) * bk  # the longest run a split can have (n_split == 1)
    kv_len = pos0 + nrows
    pi = jnp.arange(n_p, dtype=jnp.int32)
    k0 = pi[None, :] * chunk[:, None]  # [T, P]
    k1 = jnp.minimum(kv_len[:, None], k0 + chunk[:, None])
    active = (nrows[:, None] > 0) & (pi[None, :] < n_split[:, None])
    n_steps = jnp.where(active, _cdiv(k1 - k0, bk), 0)
    kpos = k0[:, :, None] + jnp.arange(span, dtype=jnp.int32)[None, None, :]  # [T, P, span]
    in_run = jnp.arange(span)[None, None, :] < (n_steps * bk)[:, :, None]
    blk = kpos // block_size
    ctx_pages = _cdiv(kv_len, block_size)[:, None, None]
    blk = jnp.where(blk < ctx_pages, jnp.minimum(blk, max_blocks - 1), 0)
    page = seg_block_table.astype(jnp.int32)[seg[:, None, None], blk]  # [T, P, span]
    slot = kpos % block_size
    kd = k_pages[layer][:, page, slot]  # [KVH, T, P, span, hd]
    vd = v_pages[layer][:, page, slot]
    # queries, packed head-major as the kernel loads them: m = j * bq + i
    i = jnp.arange(bq, dtype=jnp.int32)
    rows = row0[:, None] + i[None, :]
    qt = jnp.take(q, jnp.where(rows < num_rows, rows, num_rows), axis=0, mode="fill", fill_value=0)  # [T, bq, H, hd]
    qt = qt.reshape(n_t, bq, kvh, g, head_dim)
    s = jnp.einsum("tikjd,ktpsd->tpkjis", qt, kd, preferred_element_type=jnp.float32) * (sm_scale * LOG2E)
    q_pos = (pos0[:, None] + i[None, :])[:, None, None, None, :, None]  # [T,1,1,1,bq,1]
    ok = (kpos[:, :, None, None, None, :] <= q_pos) & in_run[:, :, None, None, None, :]
    s = jnp.where(ok, s, NEG)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.maximum(m, NEG)
    prob = jnp.where(in_run[:, :, None, None, None, :], jnp.exp2(s - m), 0.0)
    l = jnp.sum(prob, axis=-1)  # [T, P, KVH, g, bq]
    o = jnp.einsum("tpkjis,ktpsd->tpkjid", prob.astype(q.dtype), vd, preferred_element_type=jnp.float32)
    l_safe = jnp.where(l > 0, l, 1.0)
    o = o / l_safe[..., None]
    m = m[..., 0]
    lse = jnp.where(m > 0.5 * NEG, m + jnp.log2(l_safe), NEG)
    part_o = o.reshape(n_t, n_p, kvh, g * bq, head_dim)
    part_lse = jnp.pad(lse.reshape(n_t, n_p, kvh, g * bq), ((0, 0), (0, 0), (0, 0), (0, M_TILE - g * bq)))
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
    splits: int | None = None,
    block_kv: int | None = None,
    max_concurrent_steps: int | None = None,
    min_split_tokens: int | None = None,
    plan: DecodePlan | None = None,
):
    """jnp twin of :func:`decode_attention_mgpu` (same arguments): the kernel's partials from
    :func:`decode_splits_partials`, merged by the same :func:`merge_splits`. Needs no GPU; its
    memory grows with tiles x splits x the block table's width (small shapes only)."""
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    knobs = dict(
        block_q=block_q,
        splits=splits,
        block_kv=block_kv,
        max_concurrent_steps=max_concurrent_steps,
        min_split_tokens=min_split_tokens,
    )
    tuning = _resolve(q, k_pages, seg_q_len, seg_block_table, layer, plan, knobs, kernel=False)
    if plan is None:
        plan = make_decode_plan(
            seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=q.shape[0], tuning=tuning
        )
    part_o, part_lse = decode_splits_partials(q, k_pages, v_pages, seg_block_table, layer, plan, sm_scale=sm_scale)
    return merge_splits(part_o, part_lse, plan, num_heads=q.shape[1], dtype=q.dtype)
