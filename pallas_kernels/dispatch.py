"""Which Pallas attention kernel serves a bucket: Triton, Mosaic GPU, or both, split by segment.

The engine compiles one executable per bucket, so the choice is made once per bucket shape, at
trace time, from static facts: the device, dtype, head_dim, block size and the bucket's rows and
segment slots. The rule comes from the H200 sweep (benchmarks/attention_sweep.py times both
kernels on every prefill shape; tests/test_attention_dispatch.py checks the rule against those
records, both as swept and as the engine's ``S = R`` bucket of the same rows):

* decode rows and short segments -> Triton (split-K over the context, 16-row MMA tiles, per-token
  masked page gathers; the Mosaic kernel's 128-row tiles would be mostly padding);
* segments of ``MGPU_MIN_ROWS_PER_SEGMENT`` rows or more on Hopper, bf16/f16, with enough query
  tiles x heads to fill the GPU (``MGPU_MIN_CTAS``) -> Mosaic GPU (TMA page copies, wgmma, warp
  specialisation). Measured on 1024-2048-row segments: 1.8-2.8x the Triton kernel at block_kv 64
  (run 2), 1.6-2.3x at the current 128 (run 9, benchmarks/results/attention_sweep.json).

A bucket with few segment slots (``S < R``, benchmarks and kernel sweeps) says how long its
segments are (``R / S`` rows each, on average), and one kernel serves it: ``"mgpu"`` or
``"triton"``. The engine's buckets have as many segment slots as rows (``S = R``,
scheduler/buckets.py: any row may be its own segment), so the bucket says nothing about segment
lengths: one invocation mixes decode rows, short chunks and long prefill chunks (512 or 1024 rows
with ``prefill_chunk_size`` 512/1024). For those buckets the rule picks ``"hybrid"``: a split *at
run time, per segment*, inside the one executable:

* segments with ``q_len >= MGPU_MIN_ROWS_PER_SEGMENT`` go to the Mosaic kernel, every other
  segment to the Triton kernel (each launch sees the same segment arrays with the other half's
  ``q_len`` set to 0, i.e. as padding segments, which both kernels skip);
* both launches have static shapes. The Triton launch keeps its usual work list. The Mosaic
  launch is packed for ``mgpu_tiles(R, S, min_segment_rows=128)`` tiles: at most ``R // 128``
  segments can hold 128 rows or more, and a segment of ``n >= 128`` rows spans ``ceil(n / 128)
  <= 2n / 128`` tiles, so ``(R + (R // 128) * 127) // 128 < R / 64`` tiles always suffice (the
  generic bound grows with ``S``: ``R`` tiles when ``S = R``). Tiles past the invocation's last
  are padding (``nrows == 0``) and return at once in the kernel;
* each launch leaves the rows it does not own as zeros; the outputs are merged per row by the
  plan's ``long_row`` mask (rows of no segment stay zeros, as with one kernel);
* one plan per invocation (``make_kernel_plan("hybrid", ...)``: both work lists and the mask),
  shared by every layer.

``"hybrid"`` is chosen when Hopper, dtype, head_dim and block size allow the Mosaic kernel, the
bucket has ``S >= R`` slots, ``R >= HYBRID_MIN_ROWS`` (a bucket of fewer rows cannot hold enough
long-segment tiles to beat Triton, and the empty Mosaic launch of an invocation without long
segments, a few microseconds per layer, must stay small next to the invocation), and a bucket
full of long-segment rows would give the Mosaic launch ``MGPU_MIN_CTAS`` CTAs (``(R // 128) x
heads``, the same fill condition as the per-bucket rule: with 16 heads, ``R >= 512``). The split
itself is not gated at run time: a lone long segment in a big bucket goes to the Mosaic kernel
even when its tiles alone under-fill the GPU (on the H200 a lone 256-row segment at 32K context
ran 0.63 ms against Triton's 0.39 ms); a run-time CTA gate would keep small-head models (the test
model, 4 heads) off the Mosaic kernel altogether.

``OURO_JAX_ATTENTION_KERNEL=triton|mgpu|hybrid`` forces one choice (benchmarks, debugging).
Forcing ``mgpu`` in the engine on the H200 first failed with "Input buffer 1 is not 256-byte
aligned" (the block table was a view into the packed descriptor); the kernel now takes the tiles
and the table as one freshly computed int32 array, built once per invocation (``make_packing``).
Both now pass on the H200 (runs 5 and 6 of benchmarks/results: the kernels against the jnp
reference on hypothesis-drawn batches, and engines forced onto ``mgpu`` and ``hybrid`` giving the
Triton engine's tokens). Measured there with the rule: a prefill:1024 invocation of 128-row
segments at 4K context 10.7 ms against 17.7 ms with Triton alone (benchmarks/profile_step.py).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.ragged_paged_attention import Plan, default_tuning, make_plan, ragged_paged_attention

# Rows per segment (bucket average, or a segment's own rows in the hybrid split) from which the
# Mosaic GPU kernel is used...
MGPU_MIN_ROWS_PER_SEGMENT = 128
# ...provided its grid (query tiles x query heads) has at least this many CTAs. It does not split
# the context, so a lone segment under-fills the 132 SMs: 1 x 256 rows at 32K context (32 CTAs)
# ran 0.63 ms against Triton's 0.39 ms (split-K), 4 x 128 at 8K (64 CTAs) 0.21 against 0.25
# (run 2, block_kv 64; run 9 at block_kv 128: 0.54 against 0.35, and 0.19 against 0.22).
MGPU_MIN_CTAS = 64
# Fewest rows of an S = R bucket served by the per-segment split (see the module docstring).
HYBRID_MIN_ROWS = 256
KERNELS = ("triton", "mgpu", "hybrid")
_NO_INTERPRET = "the Mosaic GPU kernel has no CPU interpret mode (wgmma); use kernel='triton'"


@functools.lru_cache(maxsize=None)
def hopper_available() -> bool:
    """A CUDA device of compute capability 9.x or newer is the default device."""
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return int(str(cc).split(".")[0]) >= 9
    except ValueError:
        return False


def hybrid_tiles(num_rows: int, num_segments: int) -> int:
    """Static tile count of the hybrid split's Mosaic launch (only segments of >= 128 rows)."""
    return mgpu.mgpu_tiles(num_rows, num_segments, min_segment_rows=MGPU_MIN_ROWS_PER_SEGMENT)


def select_kernel(
    num_rows: int,
    num_segments: int,
    dtype,
    head_dim: int,
    block_size: int,
    *,
    num_heads: int = 16,
    hopper: bool | None = None,
) -> str:
    """``"triton"``, ``"mgpu"`` or ``"hybrid"`` for a bucket (see the module docstring)."""
    forced = os.environ.get("OURO_JAX_ATTENTION_KERNEL", "").strip().lower()
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"OURO_JAX_ATTENTION_KERNEL must be one of {KERNELS}, got {forced!r}")
        return forced
    if hopper is None:
        hopper = hopper_available()
    if not hopper or mgpu.supported(dtype, head_dim, block_size) is not None:
        return "triton"
    rows_per_segment = num_rows / max(num_segments, 1)
    ctas = mgpu.mgpu_tiles(num_rows, num_segments) * num_heads
    if rows_per_segment >= MGPU_MIN_ROWS_PER_SEGMENT and ctas >= MGPU_MIN_CTAS:
        return "mgpu"
    full_ctas = (num_rows // MGPU_MIN_ROWS_PER_SEGMENT) * num_heads
    if num_segments >= num_rows and num_rows >= HYBRID_MIN_ROWS and full_ctas >= MGPU_MIN_CTAS:
        return "hybrid"
    return "triton"


class HybridPlan(NamedTuple):
    """Per-invocation work of the ``"hybrid"`` split, built once and shared by every layer.

    ``triton_q_len``/``mgpu_q_len``: ``seg_q_len`` with the other half's segments set to 0
    (padding to that kernel). ``long_row`` ``[R]``: rows the Mosaic launch owns (covered by one
    of its tiles); the Triton launch owns the rest, and leaves these rows zero.
    """

    triton_q_len: jax.Array
    mgpu_q_len: jax.Array
    long_row: jax.Array
    triton: Plan
    mgpu: mgpu.Packing


def split_segments(seg_q_len):
    """``(triton_q_len, mgpu_q_len)``: each segment's rows go to exactly one of the kernels."""
    q_len = jnp.maximum(seg_q_len.astype(jnp.int32), 0)
    long = q_len >= MGPU_MIN_ROWS_PER_SEGMENT
    return jnp.where(long, 0, q_len), jnp.where(long, q_len, 0)


def _triton_plan(num_rows, num_heads, num_kv_heads, head_dim, seg_q_start, seg_q_len, seg_ctx_len):
    tuning = default_tuning(num_rows, seg_q_len.shape[0], num_heads, num_kv_heads, head_dim)
    return make_plan(
        seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows, num_q_per_kv=num_heads // num_kv_heads, tuning=tuning
    )


def make_kernel_plan(
    kernel: str,
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seg_q_start,
    seg_q_len,
    seg_ctx_len,
    seg_block_table,
) -> Any:
    """The chosen kernel's per-invocation work list, built once and shared by every layer."""
    if kernel == "mgpu":
        return mgpu.make_packing(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=num_rows)
    if kernel == "hybrid":
        triton_q_len, mgpu_q_len = split_segments(seg_q_len)
        packing = mgpu.make_packing(
            seg_q_start,
            mgpu_q_len,
            seg_ctx_len,
            seg_block_table,
            num_rows=num_rows,
            max_tiles=hybrid_tiles(num_rows, seg_q_len.shape[0]),
        )
        # dst points one past the last packed row for rows of no Mosaic tile.
        long_row = packing.dst < packing.src.shape[0]
        plan = _triton_plan(num_rows, num_heads, num_kv_heads, head_dim, seg_q_start, triton_q_len, seg_ctx_len)
        return HybridPlan(triton_q_len, mgpu_q_len, long_row, plan, packing)
    if kernel != "triton":
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return _triton_plan(num_rows, num_heads, num_kv_heads, head_dim, seg_q_start, seg_q_len, seg_ctx_len)


def paged_attention(
    kernel: str,
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
    plan=None,
    interpret: bool = False,
):
    """Run the chosen kernel (``plan`` from ``make_kernel_plan`` for the same kernel, or None)."""
    args = (q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table)
    if kernel in ("mgpu", "hybrid") and interpret:
        raise ValueError(_NO_INTERPRET)
    if kernel == "mgpu":
        return mgpu.ragged_paged_attention_mgpu(*args, layer=layer, sm_scale=sm_scale, packing=plan)
    if kernel == "hybrid":
        if plan is None:
            plan = make_kernel_plan(
                "hybrid",
                q.shape[0],
                q.shape[1],
                k_pages.shape[-4],
                q.shape[2],
                seg_q_start,
                seg_q_len,
                seg_ctx_len,
                seg_block_table,
            )
        return hybrid_attention(*args, layer=layer, sm_scale=sm_scale, plan=plan)
    if kernel != "triton":
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return ragged_paged_attention(*args, layer=layer, sm_scale=sm_scale, interpret=interpret, plan=plan)


def hybrid_attention(
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
    plan: HybridPlan,
    triton_interpret: bool = False,
):
    """Both halves of the split on one invocation, merged per row by ``plan.long_row``.

    ``seg_q_len`` is only shape-checked: each half reads its own ``q_len`` from the plan.
    ``triton_interpret`` runs the Triton half in Pallas interpret mode (CPU tests, with the
    Mosaic half replaced: it has no interpret mode).
    """
    del seg_q_len
    out_t = ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        seg_q_start,
        plan.triton_q_len,
        seg_ctx_len,
        seg_block_table,
        layer=layer,
        sm_scale=sm_scale,
        interpret=triton_interpret,
        plan=plan.triton,
    )
    out_m = mgpu.ragged_paged_attention_mgpu(
        q,
        k_pages,
        v_pages,
        seg_q_start,
        plan.mgpu_q_len,
        seg_ctx_len,
        seg_block_table,
        layer=layer,
        sm_scale=sm_scale,
        packing=plan.mgpu,
    )
    # A select, not a sum: each launch's rows of the other half are zeros, but a select does not
    # depend on it (and XLA fuses it into the Mosaic half's unpacking gather).
    return jnp.where(plan.long_row[:, None, None], out_m, out_t)
