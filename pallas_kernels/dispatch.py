"""Which Pallas attention kernel serves a bucket: the Triton-lowered one or the Mosaic GPU one.

The engine compiles one executable per bucket, so the choice is made once per bucket shape, at
trace time, from static facts: the device, dtype, head_dim, block size and the bucket's rows per
segment. The rule comes from the H200 sweep (benchmarks/attention_sweep.py times both kernels on
every prefill shape and records which one this function picks next to both timings;
tests/test_attention_dispatch.py checks the rule against those records):

* decode rows and short segments -> Triton (split-K over the context, 16-row MMA tiles, per-token
  masked page gathers; the Mosaic kernel's 128-row tiles would be mostly padding);
* segments of ``MGPU_MIN_ROWS_PER_SEGMENT`` rows or more on Hopper, bf16/f16, with enough query
  tiles x heads to fill the GPU (``MGPU_MIN_CTAS``) -> Mosaic GPU (TMA page copies, wgmma, warp
  specialisation). Measured: 1.8-2.8x the Triton kernel on 1024-2048-row segments.

``OURO_JAX_ATTENTION_KERNEL=triton|mgpu`` forces one kernel (benchmarks, debugging).

In the engine every bucket has as many segment slots as rows (``S = R``, scheduler/buckets.py), so
the rule, which only sees the bucket, picks Triton for every engine bucket. Serving the long
segments of an invocation with the Mosaic kernel and the rest with Triton needs a per-segment
split at run time; it is not built. Forcing ``mgpu`` in the engine on the H200 first failed with
"Input buffer 1 is not 256-byte aligned" (the block table was a view into the packed descriptor);
the kernel now takes the tiles and the table as one freshly computed int32 array, built once per
invocation (``make_packing``); that revision has not yet run on a GPU.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import jax

from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.ragged_paged_attention import (default_tuning, make_plan,
                                                   ragged_paged_attention)

# Rows per segment (bucket average) from which the Mosaic GPU kernel is used...
MGPU_MIN_ROWS_PER_SEGMENT = 128
# ...provided its grid (query tiles x query heads) has at least this many CTAs. It does not split
# the context, so a lone segment under-fills the 132 SMs: 1 x 256 rows at 32K context (32 CTAs)
# ran 0.63 ms against Triton's 0.39 ms (split-K), 4 x 128 at 8K (64 CTAs) 0.21 against 0.25.
MGPU_MIN_CTAS = 64
KERNELS = ("triton", "mgpu")


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


def select_kernel(num_rows: int, num_segments: int, dtype, head_dim: int, block_size: int, *,
                  num_heads: int = 16, hopper: bool | None = None) -> str:
    """``"triton"`` or ``"mgpu"`` for a bucket (see the module docstring)."""
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
    return "triton"


def make_kernel_plan(kernel: str, num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     seg_q_start, seg_q_len, seg_ctx_len, seg_block_table) -> Any:
    """The chosen kernel's per-invocation work list, built once and shared by every layer."""
    if kernel == "mgpu":
        return mgpu.make_packing(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table,
                                 num_rows=num_rows)
    tuning = default_tuning(num_rows, seg_q_len.shape[0], num_heads, num_kv_heads, head_dim)
    return make_plan(seg_q_start, seg_q_len, seg_ctx_len, num_rows=num_rows,
                     num_q_per_kv=num_heads // num_kv_heads, tuning=tuning)


def paged_attention(kernel: str, q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len,
                    seg_block_table, *, layer=None, sm_scale: float, plan=None,
                    interpret: bool = False):
    """Run the chosen kernel (``plan`` from ``make_kernel_plan`` for the same kernel, or None)."""
    args = (q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table)
    if kernel == "mgpu":
        if interpret:
            raise ValueError("the Mosaic GPU kernel has no CPU interpret mode (wgmma); "
                             "use kernel='triton'")
        return mgpu.ragged_paged_attention_mgpu(*args, layer=layer, sm_scale=sm_scale,
                                                packing=plan)
    if kernel != "triton":
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return ragged_paged_attention(*args, layer=layer, sm_scale=sm_scale, interpret=interpret,
                                  plan=plan)
