"""Which attention kernel serves a bucket: chosen once per bucket, as an ``AttentionKernel``.

The ``attention`` option (``LLM``, ``ModelRunner``; checked by :func:`check_attention`, any case):
``auto`` (``pallas`` on a GPU, else ``reference``), ``pallas`` (the rule below picks a Pallas kernel
per bucket), a forced kernel (``triton``, ``mgpu``, ``hybrid``) or ``reference`` (pure jnp).
:func:`choose_attention` turns it into an :class:`AttentionKernel` from the bucket's static facts
(device, dtype, head_dim, block size, rows, segment slots): it builds each invocation's work list
once (shared by every layer) and runs the kernel with it.

The rule (:func:`select_kernel`; the H200 figures behind it are in docs/decisions.md, and
tests/kernels/test_attention_dispatch.py checks it against benchmarks/results/attention_sweep.json):

* decode rows and short segments -> ``triton``: split-K over the context fills the GPU where the
  Mosaic kernel's 128-row tiles would be mostly padding;
* buckets whose few segment slots average ``MGPU_MIN_ROWS_PER_SEGMENT`` rows or more, with
  ``MGPU_MIN_CTAS`` CTAs (query tiles x heads), on Hopper in bf16/f16 -> ``mgpu`` (TMA, wgmma);
* invocations of decode rows only (a fused decode step's loops, ``generate()``'s decode, a
  speculative draft: the caller says so with ``decode_only``) in buckets of up to
  ``DECODE_MGPU_MAX_ROWS`` rows that the rule gives to ``triton`` -> ``decode`` where it serves
  them (Hopper, bf16/f16, MHA: ``decode_attention_mgpu.supported``): the same split-K plan and
  combine, its first launch streaming pages by TMA into wgmma;
* engine buckets (``S = R``: any row may be its own segment, so the bucket says nothing about
  segment lengths) of ``HYBRID_MIN_ROWS`` rows or more, which a full load of long segments would
  fill -> ``hybrid``: split per segment at run time, segments of ``HYBRID_MIN_SEGMENT_ROWS`` rows
  or more on the Mosaic kernel, the rest on Triton (each launch sees the other half's segments
  with ``q_len = 0``, i.e. as padding). Both write their own rows into one array in place (the
  Mosaic half first, into zeros; the Triton half's two kernels into that): no merge.

An engine bucket that would split also has a *long-segment variant* (``long_segment_rows``): the
same shapes, compiled for invocations whose every segment holds ``HYBRID_MIN_SEGMENT_ROWS`` rows or
more (a wavefront of prompt chunks with no decode row), which the runner picks per descriptor on
the host. It runs the hybrid's Mosaic launch alone: no Triton launch, no combine (issue 37).

The hybrid split's Mosaic launch is packed for ``hybrid_tiles(R, S)`` windows: at most ``R // m``
segments hold ``m = HYBRID_MIN_SEGMENT_ROWS`` rows or more, and one of ``n`` rows spans
``ceil((n + lead) / 128)`` windows of 128 rows aligned to 8 (``lead < 8``), so ``(R + (R // m) *
134) // 128`` windows suffice (``ragged_paged_attention_mgpu.mgpu_tiles``); the rest are padding
and return at once. The threshold is lower than the bucket
rule's 128 because a segment of 32-127 rows still reads its context once on the Mosaic kernel (a
tile's second warpgroup, with no rows, skips its steps) against once per 16 rows on Triton: long
prompts in chunks of 32 and 64 rows gained 12% and 38% (docs/decisions.md, "Hybrid split
threshold"). The split itself is not gated at run time: a CTA gate would keep small-head models off the
Mosaic kernel altogether.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import decode_attention_mgpu
from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.choices import ATTENTION, KERNELS, check_attention
from pallas_kernels.gate_up_silu_mgpu import supported as gate_up_silu_supported
from pallas_kernels.ragged_paged_attention import (
    Plan,
    default_tuning,
    make_plan,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "ATTENTION",
    "KERNELS",
    "AttentionKernel",
    "bucket_kernel",
    "HybridPlan",
    "SILU_EPILOGUE_MIN_ROWS",
    "check_attention",
    "choose_attention",
    "hybrid_attention",
    "hybrid_tiles",
    "long_segment_rows",
    "resolve_attention",
    "select_kernel",
    "silu_epilogue",
    "split_segments",
]

# Rows per segment (bucket average, or a segment's own rows in the hybrid split) from which the
# Mosaic GPU kernel is used...
MGPU_MIN_ROWS_PER_SEGMENT = 128
# ...provided its grid (query tiles x query heads) has at least this many CTAs: it does not split
# the context, so fewer CTAs leave SMs idle and Triton's split-K wins.
MGPU_MIN_CTAS = 64
# Fewest rows of an S = R bucket served by the per-segment split (see the module docstring).
HYBRID_MIN_ROWS = 256
# Rows of one segment from which the hybrid split gives it to the Mosaic kernel (module docstring).
HYBRID_MIN_SEGMENT_ROWS = 32
# Largest decode-only bucket on the decode kernel: from 16 rows both kernels read K/V near the
# bandwidth and the decode kernel is even or slower, in the kernel and in the engine (docs/decisions.md,
# "The decode kernel stays out of buckets over 8 rows").
DECODE_MGPU_MAX_ROWS = 8
_NO_INTERPRET = "the Mosaic GPU kernel has no CPU interpret mode (wgmma); use attention='triton'"


def resolve_attention(name) -> str:
    """``check_attention``, with ``auto`` made concrete: ``pallas`` on a GPU, else ``reference``."""
    value = check_attention(name)
    if value == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return value


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
    """Static tile count of the hybrid split's Mosaic launch (only segments of at least
    ``HYBRID_MIN_SEGMENT_ROWS`` rows)."""
    return mgpu.mgpu_tiles(num_rows, num_segments, min_segment_rows=HYBRID_MIN_SEGMENT_ROWS)


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


def bucket_kernel(
    attention: str, *, num_rows: int, num_segments: int, dtype, head_dim: int, block_size: int, num_heads: int
) -> str:
    """The kernel name of a bucket: the ``attention`` option, ``pallas`` (``auto`` on a GPU)
    resolved by :func:`select_kernel`."""
    name = resolve_attention(attention)
    if name == "pallas":
        name = select_kernel(num_rows, num_segments, dtype, head_dim, block_size, num_heads=num_heads)
    return name


def long_segment_rows(attention: str, **bucket) -> int:
    """Rows per segment of a bucket's long-segment variant (module docstring; ``bucket``: the
    keywords of :func:`bucket_kernel`): ``HYBRID_MIN_SEGMENT_ROWS`` where the bucket splits per
    segment, else 0 (no variant)."""
    return HYBRID_MIN_SEGMENT_ROWS if bucket_kernel(attention, **bucket) == "hybrid" else 0


# Rows from which a bucket's gate/up GEMM runs with SiLU x up in its epilogue: one H100, kernel
# device time against XLA's GEMM + SiLU fusion, 256 / 512 / 1024 / 2048 rows 24.8 / 44.8 / 66.5 /
# 134.2 us against 26.9 / 39.9 / 72.9 / 145.0 (docs/decisions.md, "Gate/up GEMM with SiLU x up").
SILU_EPILOGUE_MIN_ROWS = 1024


def silu_epilogue(num_rows: int, hidden: int, intermediate: int, dtype, attention: str = "auto") -> bool:
    """Whether a bucket of ``num_rows`` rows runs its gate/up GEMM as ``gate_up_silu_mgpu`` (a Hopper
    GPU, shapes it serves, ``SILU_EPILOGUE_MIN_ROWS`` rows or more, Pallas kernels not refused by
    ``attention="reference"``)."""
    if resolve_attention(attention) == "reference" or num_rows < SILU_EPILOGUE_MIN_ROWS or not hopper_available():
        return False
    return gate_up_silu_supported(num_rows, hidden, intermediate, dtype) is None


class HybridPlan(NamedTuple):
    """Per-invocation work of the ``"hybrid"`` split, built once and shared by every layer.

    ``triton_q_len``/``mgpu_q_len``: ``seg_q_len`` with the other half's segments set to 0
    (padding to that kernel).
    """

    triton_q_len: jax.Array
    mgpu_q_len: jax.Array
    triton: Plan
    mgpu: mgpu.Packing


def split_segments(seg_q_len):
    """``(triton_q_len, mgpu_q_len)``: each segment's rows go to exactly one of the kernels."""
    q_len = jnp.maximum(seg_q_len.astype(jnp.int32), 0)
    long = q_len >= HYBRID_MIN_SEGMENT_ROWS
    return jnp.where(long, 0, q_len), jnp.where(long, q_len, 0)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """One bucket's attention: which kernel (``name``) and the static shapes its plan needs.

    ``plan(...)`` builds an invocation's work list once (``None`` for ``reference``; for
    ``hybrid`` both kernels' work lists); calling the object runs the kernel on one layer with
    that plan.
    """

    name: str  # "triton" | "mgpu" | "hybrid" | "decode" | "reference"
    num_rows: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    interpret: bool = False
    # every segment holds at least this many rows: the Mosaic launch packs fewer windows
    min_segment_rows: int = 1

    def __post_init__(self):
        object.__setattr__(self, "name", check_attention(self.name, (*KERNELS, "decode", "reference")))
        if self.interpret and self.name in ("mgpu", "hybrid", "decode"):
            raise ValueError(_NO_INTERPRET)

    def _triton_plan(self, seg_q_start, seg_q_len, seg_ctx_len) -> Plan:
        tuning = default_tuning(self.num_rows, seg_q_len.shape[0], self.num_heads, self.num_kv_heads, self.head_dim)
        return make_plan(
            seg_q_start,
            seg_q_len,
            seg_ctx_len,
            num_rows=self.num_rows,
            num_q_per_kv=self.num_heads // self.num_kv_heads,
            tuning=tuning,
        )

    def plan(self, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table) -> Any:
        """The invocation's work list, built once and shared by every layer."""
        if self.name == "reference":
            return None
        if self.name == "decode":
            seg = (seg_q_start, seg_q_len, seg_ctx_len, seg_block_table)
            return decode_attention_mgpu.make_decode_plan(*seg, num_rows=self.num_rows, num_kv_heads=self.num_kv_heads)
        if self.name == "mgpu":
            # with min_segment_rows = 1 the bound for any segments (make_packing's default)
            tiles = mgpu.mgpu_tiles(self.num_rows, seg_q_len.shape[0], min_segment_rows=self.min_segment_rows)
            return mgpu.make_packing(
                seg_q_start, seg_q_len, seg_ctx_len, seg_block_table, num_rows=self.num_rows, max_tiles=tiles
            )
        if self.name == "hybrid":
            triton_q_len, mgpu_q_len = split_segments(seg_q_len)
            packing = mgpu.make_packing(
                seg_q_start,
                mgpu_q_len,
                seg_ctx_len,
                seg_block_table,
                num_rows=self.num_rows,
                max_tiles=hybrid_tiles(self.num_rows, seg_q_len.shape[0]),
            )
            triton = self._triton_plan(seg_q_start, triton_q_len, seg_ctx_len)
            return HybridPlan(triton_q_len, mgpu_q_len, triton, packing)
        return self._triton_plan(seg_q_start, seg_q_len, seg_ctx_len)

    def __call__(
        self,
        q,
        k_pages,
        v_pages,
        seg_q_start,
        seg_q_len,
        seg_ctx_len,
        seg_block_table,
        *,
        layer=None,
        sm_scale,
        plan=None,
    ):
        """One layer's attention; ``plan`` from :meth:`plan` of the same segments (or None: built here)."""
        args = (q, k_pages, v_pages, seg_q_start, seg_q_len, seg_ctx_len, seg_block_table)
        if self.name == "reference":
            return ragged_paged_attention_reference(*args, layer=layer, sm_scale=sm_scale)
        if self.name == "mgpu":
            return mgpu.ragged_paged_attention_mgpu(*args, layer=layer, sm_scale=sm_scale, packing=plan)
        if self.name == "decode":
            return decode_attention_mgpu.decode_attention_mgpu(*args, layer=layer, sm_scale=sm_scale, plan=plan)
        if self.name == "hybrid":
            if plan is None:
                plan = self.plan(seg_q_start, seg_q_len, seg_ctx_len, seg_block_table)
            return hybrid_attention(*args, layer=layer, sm_scale=sm_scale, plan=plan)
        return ragged_paged_attention(*args, layer=layer, sm_scale=sm_scale, interpret=self.interpret, plan=plan)


def choose_attention(
    attention: str,
    *,
    num_rows: int,
    num_segments: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype,
    interpret: bool = False,
    min_segment_rows: int = 1,
    decode_only: bool = False,
) -> AttentionKernel:
    """The kernel of one bucket: ``pallas`` (or ``auto`` on a GPU) asks :func:`select_kernel`,
    any other ``attention`` value forces its kernel. ``min_segment_rows``: every segment holds at
    least this many rows (a long-segment variant, :func:`long_segment_rows`). ``decode_only``:
    every segment holds one row, so the rule may pick ``decode`` (module docstring)."""
    name = bucket_kernel(
        attention,
        num_rows=num_rows,
        num_segments=num_segments,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        num_heads=num_heads,
    )
    if name == "hybrid" and min_segment_rows >= HYBRID_MIN_SEGMENT_ROWS:
        name = "mgpu"  # the split's Mosaic half alone: no segment is left for Triton
    pallas = check_attention(attention) in ("auto", "pallas")
    if decode_only and name == "triton" and pallas and not interpret and num_rows <= DECODE_MGPU_MAX_ROWS:
        why = decode_attention_mgpu.supported(dtype, num_heads, num_kv_heads, head_dim, block_size, num_rows)
        if why is None and hopper_available():
            name = "decode"
    return AttentionKernel(name, num_rows, num_heads, num_kv_heads, head_dim, interpret, min_segment_rows)


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
    """Both halves of the split on one invocation, each writing its own rows of one array: the
    Mosaic half into zeros, the Triton half in place into that.

    ``seg_q_len`` is only shape-checked: each half reads its own ``q_len`` from the plan.
    ``triton_interpret`` runs the Triton half in Pallas interpret mode (CPU tests; they interpret
    the Mosaic half with a stand-in for wgmma, or replace it).
    """
    del seg_q_len
    long_rows = mgpu.ragged_paged_attention_mgpu(
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
    return ragged_paged_attention(
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
        out=long_rows,
    )
