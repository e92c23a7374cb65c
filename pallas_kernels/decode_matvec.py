"""The projections of a few decode rows as matvec kernels, optionally fused with the RMSNorms
around them (Pallas, Triton lowering): ``LLM(decode_matmul="fused")``, measured and kept off.

Why they exist: in an 8-row decode step each of Ouro's 24 layers x 4 loops runs ~14 kernels, half
of them tiny (the sandwich RMSNorms and residual adds, the split-K reduces of XLA's O and down
GEMMs, SiLU * up), 1.3-3 us each for a few KB of work. These kernels remove the reduces and the
SiLU kernel, and with ``norm_matvec`` the norm fusions too:

* :func:`matvec`: ``y = x @ w``, no split-K: each program owns whole output columns, so no reduce
  kernel follows; with ``swiglu`` the weight holds gate and up rows and ``y = silu(g) * u``.
* :func:`norm_matvec`: ``x' = x + rmsnorm(u) * wu`` (the pending branch of the residual stream,
  optional), ``n = rmsnorm(x') * wn`` rounded to the weight dtype, ``y = n @ w``; program 0 also
  writes ``x'``. Every program recomputes its rows' norms (two passes over ``[rows, K]`` before
  the product, the input rebuilt from ``x`` and ``u`` at every step of it).

Measured slower than XLA's split-K GEMMs on the H200, hence off (figures, tunings and what would
turn it: docs/decisions.md, "Decode matvec kernels"): without split-K a 2048-column projection has
64-128 programs, each a chain of dependent K steps, and the weight streams more slowly than the
removed reduce and SiLU kernels save.

The weight is read transposed, ``w_t [N, K]`` (laid out once at load time), so that a program's
``block_n`` output columns are ``block_n`` contiguous rows of the weight, streamed in ``block_k``
chunks (coalesced whatever ``block_n``). Rows at or past ``n_rows`` (a traced count: the bucket's
padding) are never loaded and come out as zeros.

Rows: the input has ``R_in <= MAX_ROWS`` rows; outputs always have ``MAX_ROWS`` (one 16-row MMA
tile), so that a kernel's output feeds the next without a slice. Shapes: ``K % block_k == 0`` and
``N % block_n == 0`` (``tuning_for`` picks blocks that divide; :func:`supported` says when none
does), so no load or store of a weight or output needs a column mask.

:func:`norm_matvec_reference` and :func:`matvec_reference` are the jnp twins (the model's own
``RMSNorm`` arithmetic, the same rounding points); the CPU tests run the kernels in interpret mode
against them, the engine test compares whole runs (CPU interpret and H200: same tokens and exit
depths as XLA's path in float32).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = [
    "MAX_ROWS",
    "MatvecTuning",
    "matvec",
    "matvec_reference",
    "norm_matvec",
    "norm_matvec_reference",
    "supported",
    "tuning_for",
]

MAX_ROWS = 16  # rows of every output: one MMA tile (Triton's dot needs >= 16)


@dataclasses.dataclass(frozen=True)
class MatvecTuning:
    """The fastest tuning measured (docs/decisions.md, "Decode matvec kernels": 32 columns a
    program, 256-wide K steps, 4 warps)."""

    block_n: int = 32  # output columns per program
    block_k: int = 256  # reduction chunk per pipeline step
    num_warps: int = 4
    num_stages: int = 4


# ``OURO_JAX_MATVEC_TUNING="block_n,block_k,num_warps,num_stages"``: another default tuning, to
# measure it in the engine. Read at trace time; the runner's program description (the executable
# store's key) records it.
TUNING_ENV = "OURO_JAX_MATVEC_TUNING"


def default_tuning() -> MatvecTuning:
    """``MatvecTuning()`` or the one ``OURO_JAX_MATVEC_TUNING`` names."""
    text = os.environ.get(TUNING_ENV, "").strip()
    if not text:
        return MatvecTuning()
    try:
        return MatvecTuning(*(int(v) for v in text.split(",")))
    except (TypeError, ValueError):
        raise ValueError(f"{TUNING_ENV} must be 'block_n,block_k,num_warps,num_stages', got {text!r}") from None


def _largest_divisor(n: int, options) -> Optional[int]:
    return next((b for b in options if n % b == 0), None)


# Shared memory the pipeline's stages may take (of 227 KB a CTA on Hopper): Triton keeps ``num_stages``
# copies of every tile loaded in the K loop, and refuses to compile past the limit.
SMEM_BUDGET = 200 * 1024


def tuning_for(
    k: int, n: int, base: MatvecTuning = MatvecTuning(), *, itemsize: int = 2, halves: int = 1, norm: bool = False
) -> Optional[MatvecTuning]:
    """``base`` with blocks that divide ``k`` and ``n`` (largest first, never above base's) and no
    more stages than fit ``SMEM_BUDGET``, or None. ``halves``: weight tiles a step (2: swiglu);
    ``norm``: the step also loads the float32 residual and the branch (``norm_matvec``)."""
    bk = _largest_divisor(k, [b for b in (2048, 1024, 512, 256, 128, 64, 32, 16) if b <= base.block_k])
    bn = _largest_divisor(n, [b for b in (128, 64, 32, 16) if b <= base.block_n])
    if bk is None or bn is None:
        return None
    row_bytes = (4 + itemsize) if norm else itemsize  # per input element of a step
    stage = MAX_ROWS * bk * row_bytes + halves * bn * bk * itemsize
    stages = max(1, min(base.num_stages, SMEM_BUDGET // stage))
    return dataclasses.replace(base, block_n=bn, block_k=bk, num_stages=stages)


def supported(rows: int, k: int, n: int) -> Optional[str]:
    """None when the kernels serve ``[rows, k] @ [k, n]``, else why not."""
    if rows > MAX_ROWS:
        return f"{rows} rows > {MAX_ROWS}"
    if tuning_for(k, n) is None:
        return f"k={k} and n={n} must be multiples of 16"
    return None


def _kernel(
    nrows_ref,
    *refs,
    rows_in: int,
    k: int,
    n: int,
    block_n: int,
    block_k: int,
    eps: float,
    norm: bool,
    branch: bool,
    swiglu: bool,
    precision,
):
    """One program: output columns ``[pid * block_n, +block_n)`` of every row (both halves for
    ``swiglu``). Refs: ``x, [u, wu], [wn], w_t, y, [x_out]``."""
    refs = list(refs)
    x_ref = refs.pop(0)
    u_ref, wu_ref = (refs.pop(0), refs.pop(0)) if branch else (None, None)
    wn_ref = refs.pop(0) if norm else None
    w_ref, y_ref = refs.pop(0), refs.pop(0)
    xo_ref = refs.pop(0) if branch else None

    pid = pl.program_id(0)  # outside any branch: interpret mode needs it there
    f32 = jnp.float32
    nk = k // block_k
    nrows = jnp.minimum(nrows_ref[0], rows_in)
    mi = jnp.arange(MAX_ROWS, dtype=jnp.int32)
    rmask = (mi < nrows)[:, None]
    rows = jnp.minimum(mi, rows_in - 1)[:, None]  # masked lanes keep in-range indices
    kr = jnp.arange(block_k, dtype=jnp.int32)
    zeros = jnp.zeros((MAX_ROWS,), f32)

    def load_rows(ref, i):  # [MAX_ROWS, block_k] f32, zero past n_rows
        return plgpu.load(ref.at[rows, (i * block_k + kr)[None, :]], mask=rmask, other=0).astype(f32)

    def vec(ref, i):  # [block_k] f32
        return ref[i * block_k + kr].astype(f32)

    if branch:

        def sum_u(i, ss):
            u = load_rows(u_ref, i)
            return ss + jnp.sum(u * u, axis=1)

        rs_u = lax.rsqrt(lax.fori_loop(0, nk, sum_u, zeros) / k + eps)[:, None]

    def residual(i):  # x' chunk, f32
        x = load_rows(x_ref, i)
        if branch:
            x = x + vec(wu_ref, i)[None, :] * (load_rows(u_ref, i) * rs_u)
        return x

    if norm:

        def sum_x(i, ss):
            x = residual(i)
            if branch:

                @pl.when(pid == 0)
                def _():
                    xo_ref[mi[:, None], (i * block_k + kr)[None, :]] = x

            return ss + jnp.sum(x * x, axis=1)

        rs_x = lax.rsqrt(lax.fori_loop(0, nk, sum_x, zeros) / k + eps)[:, None]

        def inputs(i):
            return (vec(wn_ref, i)[None, :] * (residual(i) * rs_x)).astype(w_ref.dtype)

    else:

        def inputs(i):
            return plgpu.load(x_ref.at[rows, (i * block_k + kr)[None, :]], mask=rmask, other=0).astype(w_ref.dtype)

    cols = pid * block_n + jnp.arange(block_n, dtype=jnp.int32)

    def weight(i, half):
        r = cols + half * n
        return plgpu.load(w_ref.at[r[:, None], (i * block_k + kr)[None, :]], eviction_policy="evict_first")

    def body(i, accs):
        a = inputs(i)
        return tuple(
            acc + plgpu.dot(a, weight(i, half), trans_b=True, precision=precision) for half, acc in enumerate(accs)
        )

    init = tuple(jnp.zeros((MAX_ROWS, block_n), f32) for _ in range(2 if swiglu else 1))
    accs = lax.fori_loop(0, nk, body, init)
    dt = y_ref.dtype
    if swiglu:
        g, u = (acc.astype(dt).astype(f32) for acc in accs)  # the projection's outputs, rounded
        y = g * jax.nn.sigmoid(g) * u
    else:
        y = accs[0]
    y_ref[mi[:, None], cols[None, :]] = y.astype(dt)


def _call(x, w_t, n_rows, *, eps, wn=None, u=None, wu=None, swiglu=False, tuning=None, interpret=False):
    rows_in, k = x.shape
    halves = 2 if swiglu else 1
    n = w_t.shape[0] // halves
    if w_t.shape != (halves * n, k):
        raise ValueError(f"w_t must be [{'2 * ' if swiglu else ''}N, {k}], got {w_t.shape}")
    why = supported(rows_in, k, n)
    if why is not None:
        raise ValueError(f"decode matvec: {why}")
    norm, branch = wn is not None, u is not None
    t = tuning_for(k, n, tuning or default_tuning(), itemsize=w_t.dtype.itemsize, halves=halves, norm=norm)
    precision = lax.Precision.HIGHEST if w_t.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(
        _kernel,
        rows_in=rows_in,
        k=k,
        n=n,
        block_n=t.block_n,
        block_k=t.block_k,
        eps=float(eps),
        norm=norm,
        branch=branch,
        swiglu=swiglu,
        precision=precision,
    )
    operands = [jnp.asarray(n_rows, jnp.int32).reshape(1), x]
    if branch:
        operands += [u, wu]
    if norm:
        operands.append(wn)
    operands.append(w_t)
    out_shape = [jax.ShapeDtypeStruct((MAX_ROWS, n), w_t.dtype)]
    if branch:
        out_shape.append(jax.ShapeDtypeStruct((MAX_ROWS, k), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(n // t.block_n,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"decode_{'norm_' if norm else ''}{'swiglu' if swiglu else 'matvec'}",
    )(*operands)
    return out if branch else out[0]


def matvec(x, w_t, n_rows, *, swiglu: bool = False, tuning: Optional[MatvecTuning] = None, interpret: bool = False):
    """``(x @ w_t.T)`` in ``w_t``'s dtype, ``[MAX_ROWS, N]``; rows ``>= n_rows`` of ``x`` read as zeros.

    ``x [R_in <= MAX_ROWS, K]``, ``w_t [N, K]`` (``[2 * N, K]`` with ``swiglu``: gate rows then
    up rows, giving ``silu(gate) * up``), ``n_rows`` a traced int32 scalar."""
    return _call(x, w_t, n_rows, eps=0.0, swiglu=swiglu, tuning=tuning, interpret=interpret)


def norm_matvec(
    x,
    w_t,
    n_rows,
    *,
    norm_weight,
    eps: float,
    branch=None,
    branch_weight=None,
    swiglu: bool = False,
    tuning: Optional[MatvecTuning] = None,
    interpret: bool = False,
):
    """``y = rmsnorm(x') * norm_weight @ w_t.T`` with ``x' = x + rmsnorm(branch) * branch_weight``.

    ``x [R_in, K]`` float32 (the residual stream), ``branch [R_in', K]`` (a projection's output,
    optional), ``w_t [N, K]`` or, with ``swiglu``, ``[2 * N, K]`` (gate rows then up rows, giving
    ``silu(gate) * up``). Returns ``y [MAX_ROWS, N]`` in ``w_t``'s dtype, and with a branch also
    ``x' [MAX_ROWS, K]`` float32. Rows ``>= n_rows`` read as zeros."""
    if (branch is None) != (branch_weight is None):
        raise ValueError("branch and branch_weight go together")
    if branch is not None and (branch.shape[1] != x.shape[1] or branch.shape[0] < x.shape[0]):
        raise ValueError(f"branch {branch.shape} does not cover x {x.shape}")
    return _call(
        x,
        w_t,
        n_rows,
        eps=eps,
        wn=norm_weight,
        u=branch,
        wu=branch_weight,
        swiglu=swiglu,
        tuning=tuning,
        interpret=interpret,
    )


# ----------------------------------------------------------------------------------------------
# jnp twins
# ----------------------------------------------------------------------------------------------


def _rows(x, n_rows):
    """``x`` padded or cut to ``MAX_ROWS`` rows, rows ``>= n_rows`` zero, in float32."""
    x = x.astype(jnp.float32)
    x = jnp.pad(x, ((0, MAX_ROWS - x.shape[0]), (0, 0)))
    return jnp.where((jnp.arange(MAX_ROWS) < n_rows)[:, None], x, 0.0)


def _rmsnorm(x32, w, eps):
    return w.astype(jnp.float32) * (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))


def _dot(a, w_t):
    prec = lax.Precision.HIGHEST if w_t.dtype == jnp.float32 else lax.Precision.DEFAULT
    return jnp.dot(a.astype(w_t.dtype), w_t.T, preferred_element_type=jnp.float32, precision=prec)


def _swiglu(a, w_t):
    n = w_t.shape[0] // 2
    g, u = (_dot(a, w).astype(w_t.dtype).astype(jnp.float32) for w in (w_t[:n], w_t[n:]))
    return (g * jax.nn.sigmoid(g) * u).astype(w_t.dtype)


def matvec_reference(x, w_t, n_rows, *, swiglu=False):
    a = _rows(x, n_rows)
    return _swiglu(a, w_t) if swiglu else _dot(a, w_t).astype(w_t.dtype)


def norm_matvec_reference(x, w_t, n_rows, *, norm_weight, eps, branch=None, branch_weight=None, swiglu=False):
    xr = _rows(x, n_rows)
    if branch is not None:
        xr = xr + _rmsnorm(_rows(branch, n_rows), branch_weight, eps)
    a = _rmsnorm(xr, norm_weight, eps).astype(w_t.dtype)
    y = _swiglu(a, w_t) if swiglu else _dot(a, w_t).astype(w_t.dtype)
    return (y, xr) if branch is not None else y
