"""The residual add of a sublayer's normed output and the next RMSNorm, in one kernel (Pallas,
Triton lowering).

Ouro's layers are "sandwich" normed: after attention, ``x = x + norm_a(a)`` (the output's own
RMSNorm, in float32, added to the float32 residual stream), then ``h = norm_x(x)`` rounded to the
model dtype for the MLP's product; after the MLP the same with the MLP's output and the norm that
follows (the next layer's input norm, or the final norm after the last layer:
``OuroDecoderLayer.chain``). XLA runs the two row reductions as separate kernels, each re-reading
the rows: at decode sizes each is mostly launch time, at 1024 rows each reads the float32 residual
again. This kernel reads a row of ``a`` and ``x`` once and writes ``x`` (float32, in place: ``x``
is aliased to the output) and ``h``.

The arithmetic is ``model.rms_norm``'s, term for term: ``w * (v * rsqrt(mean(v * v) + eps))`` in
float32 for both norms, ``h`` rounded once. Each row is reduced by one program, so a row's result
does not depend on the other rows or on the bucket it runs in.

Limits (checked): ``x`` ``[R, D]`` float32, ``a`` ``[R, D]``, the weights ``[D]``, ``D`` a power of
two (a Triton block). ``residual_norm_reference`` is the pure-jnp twin, which is also what the
engine runs wherever the kernel is not used (``fuses_norms``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["residual_norm", "residual_norm_reference", "supported", "ROWS_PER_PROGRAM"]

ROWS_PER_PROGRAM = 1  # a 2048-wide row is 8 KB of float32: one row a program fills 1024 rows' grid
NUM_WARPS = 4


def supported(hidden_size: int) -> bool:
    """Whether the kernel takes rows of ``hidden_size`` (a power of two)."""
    return hidden_size >= 16 and not hidden_size & (hidden_size - 1)


def _check(x, a, w_a, w_x):
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"x must be the float32 residual [R, D], got {x.dtype} {x.shape}")
    if a.shape != x.shape:
        raise ValueError(f"a must be [R, D] = {x.shape}, got {a.shape}")
    D = x.shape[1]
    if w_a.shape != (D,) or w_x.shape != (D,):
        raise ValueError(f"weights must be [D] = ({D},), got {w_a.shape} / {w_x.shape}")


def _rms(v, w, eps):
    return w * (v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps))


def residual_norm_reference(x, a, w_a, w_x, *, eps: float, out_dtype):
    """Twin of :func:`residual_norm`: ``x + rms_norm(a, w_a)`` and ``rms_norm`` of that by ``w_x``."""
    _check(x, a, w_a, w_x)
    f32 = jnp.float32
    x = x + _rms(a.astype(f32), w_a.astype(f32), eps)
    return x, _rms(x, w_x.astype(f32), eps).astype(out_dtype)


def _kernel(a_ref, x_ref, wa_ref, wx_ref, x_out, h_out, *, eps, rows_per_program):
    i = pl.program_id(0)
    R, D = x_ref.shape
    rows = i * rows_per_program + jnp.arange(rows_per_program, dtype=jnp.int32)
    ok = (rows < R)[:, None]
    r = jnp.where(rows < R, rows, 0)[:, None]
    d = jnp.arange(D, dtype=jnp.int32)[None, :]
    f32 = jnp.float32
    a = plgpu.load(a_ref.at[r, d], mask=ok, other=0).astype(f32)
    x = plgpu.load(x_ref.at[r, d], mask=ok, other=0).astype(f32)
    w_a = wa_ref[...].astype(f32)[None, :]
    w_x = wx_ref[...].astype(f32)[None, :]
    x = x + _rms(a, w_a, eps)
    h = _rms(x, w_x, eps)
    # rows past R point past the end: the interpreter would write a masked row's old value back
    r_out = jnp.where(rows < R, rows, R)[:, None]
    plgpu.store(x_out.at[r_out, d], x, mask=ok)
    plgpu.store(h_out.at[r_out, d], h.astype(h_out.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret", "rows_per_program", "num_warps"))
def residual_norm(
    x,
    a,
    w_a,
    w_x,
    *,
    eps: float,
    out_dtype,
    interpret: bool = False,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
):
    """``(x + rms_norm(a, w_a), rms_norm(that, w_x) in out_dtype)`` (see the module docstring).

    ``x``: ``[R, D]`` float32 residual (aliased to the first output); ``a``: ``[R, D]`` any float
    dtype; ``w_a``/``w_x``: ``[D]``.
    """
    _check(x, a, w_a, w_x)
    R, D = x.shape
    if not supported(D):
        raise ValueError(f"residual_norm: the row width must be a power of two >= 16, got {D}")
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), rows_per_program=rows_per_program),
        grid=(pl.cdiv(R, rows_per_program),),
        out_shape=[jax.ShapeDtypeStruct((R, D), jnp.float32), jax.ShapeDtypeStruct((R, D), jnp.dtype(out_dtype))],
        input_output_aliases={1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="residual_norm",
    )(a, x, w_a, w_x)
