"""Decode attention on Hopper: the split-K plan's first kernel with TMA and wgmma (Pallas, Mosaic GPU).

Same contract as ``ragged_paged_attention`` (docs/contracts.md), written for invocations of decode
rows (one query row per segment, MHA), where the Triton kernel's first launch reads K/V well under
the bandwidth (docs/decisions.md, "Decode attention on TMA and wgmma"):

* the work list is the Triton kernel's ``make_plan`` with one query row per tile (``block_q=1``)
  and a split target of ``TARGET_CTAS`` CTAs: one item a row where rows x heads fill the GPU,
  context chunks of at least ``MIN_SPLIT_TOKENS`` where they do not (one row at 1K: 8 chunks of
  128 tokens x 16 heads);
* one CTA = one work item x one head: a memory warpgroup streams the item's pages into a ring of
  ``STEPS`` slots of ``BLOCK_KV`` tokens by TMA (``ragged_paged_attention_mgpu.stream_kv``), one
  compute warpgroup runs Q.K^T and P.V as wgmma on a 64-row query *window*: the 64 rows of ``q``
  (fewer in a smaller bucket) around the item's row at that head, read in place, of which only the
  item's row is stored (the others attend to this row's context and are dropped: wgmma has no
  shorter M, and they cost no memory traffic);
* an item that is its row's whole context writes the row's output; a split item writes its f32
  partial and log-sum-exp into the Triton kernel's layout, merged by the same combine launch
  (``ragged_paged_attention.combine_partials``).

Limits (checked by :func:`supported`): bfloat16/float16, MHA (one query head per KV head), head_dim
a multiple of 64, ``block_size`` a multiple of 8 dividing ``BLOCK_KV``, a row count that is a
multiple of 8. As for ``ragged_paged_attention_mgpu``, the slots of a context's last page past its
end are read and multiplied by zero probabilities, so they must hold finite values.
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

from pallas_kernels.ragged_paged_attention import Tuning, _cdiv, _check_args, combine_partials, make_plan
from pallas_kernels.ragged_paged_attention_mgpu import stream_kv

LOG2E = math.log2(math.e)
NEG = -1e30
# Tokens per pipeline step and ring slots: four 16-token pages of K and of V a step, 128 KB in
# flight per CTA (one CTA an SM at this shared memory).
BLOCK_KV = 64
STEPS = 4
# Work items x KV heads the split aims at: about one wave of one-CTA-an-SM on 132 SMs.
TARGET_CTAS = 128
MIN_SPLIT_TOKENS = 128
WINDOW = 64  # wgmma's M: query rows computed per CTA
ITEM_FIELDS = 8  # the columns of ``Plan.items``
# The log-sum-exp partial is stored 32-wide, the combine reads lane 0: a TMA store's shared-memory
# source must start on 128 bytes, which a staged row of 8 floats does not (a misaligned address).
LSE_WIDTH = 32


def supported(q_dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_rows: int) -> str | None:
    """Why this kernel cannot serve a launch (``None`` when it can)."""
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q_dtype).name} (needs bfloat16 or float16)"
    if num_heads != num_kv_heads:
        return f"{num_heads} query heads on {num_kv_heads} KV heads (needs MHA)"
    if head_dim % 64:
        return f"head_dim {head_dim} (needs a multiple of 64)"
    if block_size % 8 or BLOCK_KV % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing {BLOCK_KV})"
    if num_rows % 8:
        return f"{num_rows} rows (needs a multiple of 8)"
    return None


class DecodePlan(NamedTuple):
    """Per-invocation input, built once and shared by every layer: ``meta`` is the plan's items
    (``[W, 8]``, flat) then the block table, flat int32 in one fresh array (Mosaic GPU wants its
    operands 256-byte aligned: a slice of the step's descriptor is not); ``rows`` the combine's
    per-row item ranges (``Plan.rows``)."""

    meta: jax.Array
    rows: jax.Array


def num_items(plan: DecodePlan, seg_block_table) -> int:
    """``W``, the work items of ``plan`` (static)."""
    return (plan.meta.shape[0] - math.prod(seg_block_table.shape)) // ITEM_FIELDS


def make_decode_plan(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, *, num_rows: int, num_kv_heads: int):
    """The kernel's work list (``make_plan`` with one-row tiles, ``BLOCK_KV``-token blocks, split for
    ``TARGET_CTAS`` CTAs)."""
    # make_plan reads a Tuning's first four knobs only; the Triton launch knobs have no say here
    tuning = Tuning(
        block_q=1,
        block_k=BLOCK_KV,
        extra_items=max(1, TARGET_CTAS // num_kv_heads),
        min_split_tokens=MIN_SPLIT_TOKENS,
        num_warps=0,
        num_stages=0,
    )
    plan = make_plan(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, num_q_per_kv=1, tuning=tuning)
    items = lax.optimization_barrier(plan.items)  # computed once, not per element of the copy
    meta = jnp.concatenate([items.reshape(-1), seg_block_table.astype(jnp.int32).reshape(-1)])
    return DecodePlan(meta, plan.rows)


def _kernel(
    meta_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    out_ref,
    o_part_ref,
    lse_part_ref,
    scoped,
    *,
    num_items: int,
    window: int,
    block_size: int,
    scale_log2: float,
    max_blocks: int,
    num_pages: int,
):
    (q_smem, k_smem, v_smem, o_stage, lse_stage, out_stage), ready, free = scoped
    k_ready, v_ready, q_ready = ready
    k_free, v_free = free
    head = lax.axis_index("heads")
    w = lax.axis_index("items")
    wg = lax.axis_index("wg")
    base = w * ITEM_FIELDS
    seg = meta_ref[base]
    row = meta_ref[base + 1]  # one-row tiles: the item's row
    k0 = meta_ref[base + 4]  # a multiple of BLOCK_KV
    k1 = meta_ref[base + 5]
    n_split = meta_ref[base + 6]  # 0: an empty item (padding past the plan's last)
    n_steps = jnp.where(n_split > 0, _cdiv(k1 - k0, BLOCK_KV), 0)
    head_dim = q_ref.shape[-1]
    dtype = q_ref.dtype

    @pl.when(wg == 0)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        @pl.when(n_split > 0)
        def _item():
            win = lax.div(row, jnp.int32(window)) * window
            plgpu.copy_gmem_to_smem(
                q_ref.at[pl.ds(pl.multiple_of(win, 8), window), head], q_smem.at[pl.ds(0, window)], q_ready
            )
            plgpu.barrier_wait(q_ready)
            full_steps = lax.div(k1 - k0, jnp.int32(BLOCK_KV))  # steps with no key past ``k1``

            def kv_step(step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(STEPS))
                plgpu.barrier_wait(k_ready.at[slot])

                def qk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk_scope, plgpu.ACC((WINDOW, BLOCK_KV), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * scale_log2
                if masked:
                    ki = plgpu.broadcasted_iota(jnp.int32, (WINDOW, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(k0 + step * BLOCK_KV + ki < k1, s, NEG)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p_lo = p.astype(dtype)
                plgpu.barrier_wait(v_ready.at[slot])

                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p_lo, v_smem.at[slot])

                acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = (
                plgpu.layout_cast(jnp.full((WINDOW, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((WINDOW,), NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
                plgpu.layout_cast(jnp.full((WINDOW,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            )
            carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(full_steps, n_steps, functools.partial(kv_step, masked=True), carry)
            l_safe = jnp.where(l_i > 0, l_i, 1.0)
            o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            r_in = row - win

            @pl.when(n_split == 1)
            def _direct():
                out_stage[...] = o.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_stage.at[pl.ds(r_in, 1)], out_ref.at[pl.ds(row, 1), head])
                plgpu.wait_smem_to_gmem(0)

            @pl.when(n_split > 1)
            def _partial():
                o_stage[...] = o
                lse = m_i + jnp.log2(l_safe)
                lse_stage[...] = lax.broadcast_in_dim(lse, (WINDOW, LSE_WIDTH), [0])
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_stage.at[pl.ds(r_in, 1)], o_part_ref.at[w, head])
                plgpu.copy_smem_to_gmem(lse_stage.at[pl.ds(r_in, 1)], lse_part_ref.at[w, pl.ds(head, 1)])
                plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        stream_kv(
            meta_ref, (k_ref, v_ref), (k_smem, v_smem), (k_ready, v_ready), (k_free, v_free),
            layer=layer_ref[0], kvh=head, table=ITEM_FIELDS * num_items, seg=seg, max_blocks=max_blocks,
            num_pages=num_pages, ctx_pages=_cdiv(k1, block_size), first_blk=lax.div(k0, jnp.int32(block_size)),
            n_steps=n_steps, pages=BLOCK_KV // block_size, block_size=block_size, steps=STEPS,
        )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("sm_scale", "combine_interpret"))
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
    plan: DecodePlan | None = None,
    combine_interpret: bool = False,
):
    """Mosaic GPU twin of ``ragged_paged_attention`` for decode invocations (module docstring).

    ``plan``: ``make_decode_plan(...)`` of the same segment arrays (built once per step, shared by
    every layer), or None to build it here. ``combine_interpret``: the combine launch in Pallas'
    interpret mode (CPU tests). Rows of no segment come out as zeros. Any segments are
    served correctly (a prompt segment's rows become one-row tiles), but each row of a segment then
    reads the segment's context once: prompt rows belong on the other kernels.
    """
    _check_args(q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, layer)
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    num_rows, num_heads, head_dim = q.shape
    _, kvh, num_pages, block_size, _ = k_pages.shape
    why = supported(q.dtype, num_heads, kvh, head_dim, block_size, num_rows)
    if why is not None:
        raise ValueError(f"decode_attention_mgpu cannot serve {why}")
    if plan is None:
        seg = (seg_q_start, seg_q_len, seg_ctx_len, seg_block_table)
        plan = make_decode_plan(*seg, num_rows=num_rows, num_kv_heads=kvh)
    out, o_part, lse_part = decode_partials(q, k_pages, v_pages, seg_block_table, layer, plan, sm_scale=sm_scale)
    return combine_partials(plan.rows, o_part, lse_part, out, num_kv_heads=kvh, interpret=combine_interpret)


def decode_partials(q, k_pages, v_pages, seg_block_table, layer, plan: DecodePlan, *, sm_scale: float):
    """The first launch alone (stacked pool, traced ``layer``): ``(out, o_part, lse_part)``, where
    ``out`` holds the rows of one-item tiles and nothing else is defined."""
    num_rows, num_heads, head_dim = q.shape
    _, kvh, num_pages, block_size, _ = k_pages.shape
    w_max = num_items(plan, seg_block_table)
    window = min(WINDOW, num_rows)  # a multiple of 8 (checked): the query box's row offset and size

    def entry(*refs):  # meta, layer, q, k, v, then the outputs out, o_part, lse_part
        ts = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        scratch = [
            plgpu.SMEM((WINDOW, head_dim), q.dtype, transforms=ts),
            plgpu.SMEM((STEPS, BLOCK_KV, head_dim), q.dtype, transforms=ts),
            plgpu.SMEM((STEPS, BLOCK_KV, head_dim), q.dtype, transforms=ts),
            # staged results, untiled: any row is a TMA start
            plgpu.SMEM((WINDOW, head_dim), jnp.float32),
            plgpu.SMEM((WINDOW, LSE_WIDTH), jnp.float32),
            plgpu.SMEM((WINDOW, head_dim), q.dtype),
        ]
        pages = BLOCK_KV // block_size
        kernel = functools.partial(
            _kernel,
            num_items=w_max,
            window=window,
            block_size=block_size,
            scale_log2=float(sm_scale) * LOG2E,
            max_blocks=seg_block_table.shape[1],
            num_pages=num_pages,
        )
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            scratch,
            (
                plgpu.Barrier(num_arrivals=pages, num_barriers=STEPS),
                plgpu.Barrier(num_arrivals=pages, num_barriers=STEPS),
                plgpu.Barrier(),
            ),
            (plgpu.Barrier(num_barriers=STEPS),) * 2,
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((w_max, kvh, 1, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((w_max, kvh, LSE_WIDTH), jnp.float32),
        ),
        # heads vary fastest: the empty items' CTAs come after every real one
        grid=(w_max, num_heads),
        grid_names=("items", "heads"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(plan.meta, jnp.asarray(layer, jnp.int32).reshape(1), q, k_pages, v_pages)
