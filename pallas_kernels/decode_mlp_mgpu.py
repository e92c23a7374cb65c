"""The SwiGLU MLP of a few decode rows on Hopper in two launches (Pallas, Mosaic GPU): issue 36.

XLA runs a decode layer's MLP as five kernels: the gate/up GEMM, its split-K reduce, SiLU x up,
the down GEMM and its split-K reduce (``docs/roadmap.md``: ~27 us a layer at 8 rows for ~17 us of
weight reads). Here it is two, and the down projection's split sum goes into the norm that
follows it, a fusion XLA runs anyway:

1. gate/up: grid ``I / gate_up_block_n`` CTAs (64 columns by default: 88 at Ouro-1.4B). A CTA
   streams its gate and up columns over all of K, so it owns whole sums and applies
   ``silu(g) * u`` in its epilogue. It writes ``h [R, I]`` in the model dtype (``R``: the rows
   rounded up to 8).
2. down: grid ``D / down_block_n`` column blocks x ``down_splits`` K ranges (32 x 4 at
   Ouro-1.4B). A CTA streams its weight tiles and the matching columns of ``h`` (L2-resident,
   at most 180 KB at Ouro-1.4B) and writes its f32 partial ``[R, block_n]``; ``decode_mlp_mgpu``
   returns their sum as ``[M, D]``, which XLA fuses into the consumer.

Kernel 2 is ``decode_gemm_mgpu``'s launch; kernel 1 is its loop with two weight tiles a step (the
gate and up columns of the same block) and SiLU x up in the epilogue. Both read the rows of ``x``
(or ``h``) into the top of wgmma's 64-row A operand and stream the weights at HBM bandwidth
(``pallas_kernels/decode_gemm_mgpu.py`` says how).

Layouts: ``w_gate_up`` is the fused ``gate_up_proj`` kernel ``[D, 2, I]`` of the engine's steps and
``generate()`` (a free reshape to ``[D, 2 I]``: gate columns, then up columns) or the checkpoint's
pair ``(gate_proj, up_proj)`` of ``[D, I]`` kernels; ``w_down`` is ``down_proj``'s ``[I, D]``. TMA
needs I and D multiples of 64 (the weight tiles' rows are whole swizzle atoms).

:func:`decode_mlp_reference` is the jnp twin: the same f32 sums, ``h`` rounded to the model dtype
where the kernel stores it, the same split decomposition; it also takes float32 (CPU tests).
The CPU tests cross-lower the kernels for CUDA and run them in Pallas' GPU interpreter with wgmma,
which the interpreter does not model, stood in for; the GPU tests compare kernel and twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_gemm_mgpu import (
    A_ROWS,
    BLOCK_N,
    MAX_ROWS,
    GemmTuning,
    cdiv,
    check_knobs,
    default_block_k,
    fit_stages,
    gemm_call,
    gemm_tuning,
    pad_rows,
    rows_and_dtype_unsupported,
    split_products,
    stage_bytes,
    swizzled,
    zero_pad_rows,
)

__all__ = ["MAX_ROWS", "MlpTuning", "decode_mlp_mgpu", "decode_mlp_reference", "mlp_tuning", "supported"]


@dataclasses.dataclass(frozen=True)
class MlpTuning:
    """Static knobs of the two launches (``mlp_tuning`` checks and normalises them)."""

    block_k: int  # K per pipeline step of both kernels (a multiple of 64)
    gate_up_stages: int  # slots of kernel 1's ring: a gate tile, an up tile and x's slice each
    gate_up_block_n: int  # I columns per kernel-1 CTA (its grid: I / this)
    down: GemmTuning  # kernel 2

    def smem_bytes(self, itemsize: int = 2) -> tuple[int, int]:
        """Shared memory of a CTA of each kernel: the ring and the output staging."""
        bn = self.gate_up_block_n
        k1 = self.gate_up_stages * stage_bytes(self.block_k, bn, 2, itemsize) + A_ROWS * bn * itemsize
        return k1, self.down.smem_bytes(itemsize)


def supported(dtype, m: int, d: int, inter: int) -> str | None:
    """Why the kernels cannot serve ``m`` rows of a ``D = d``, ``I = inter`` MLP in ``dtype``
    (``None`` when they can)."""
    why = rows_and_dtype_unsupported(dtype, m)
    if why is not None:
        return why
    for name, v in (("hidden size", d), ("intermediate size", inter)):
        if v < 64 or v % 64:
            return f"{name} {v} (needs a multiple of 64: the tiles' rows are whole swizzle atoms)"
    return None


def mlp_tuning(
    d: int,
    inter: int,
    itemsize: int = 2,
    *,
    block_k: int | None = None,
    gate_up_stages: int | None = None,
    down_splits: int | None = None,
    down_stages: int | None = None,
    gate_up_block_n: int = BLOCK_N,
    down_block_n: int = BLOCK_N,
) -> MlpTuning:
    """Defaults for a ``D = d``, ``I = inter`` MLP; any knob given overrides its default (checked:
    ``ValueError``). ``block_k``: both kernels' step. The down launch is ``gemm_tuning(I, D)``'s
    (Ouro-1.4B: 32 column blocks x 4 splits); kernel 1 takes as many slots as fit a CTA.
    ``*_block_n``: 16, 32 or 64 columns a CTA (narrower: more CTAs, narrower swizzles)."""
    block_k = default_block_k(itemsize) if block_k is None else block_k
    check_knobs(block_k, gate_up_block_n=(gate_up_block_n, inter))
    down = gemm_tuning(
        inter,
        d,
        itemsize,
        block_k=block_k,
        splits=down_splits,
        stages=down_stages,
        block_n=down_block_n,
        knob_prefix="down_",
    )
    per_stage = stage_bytes(block_k, gate_up_block_n, 2, itemsize)
    staging = A_ROWS * gate_up_block_n * itemsize
    stages = fit_stages(per_stage, staging, cdiv(d, block_k), gate_up_stages, "gate_up_stages")
    return MlpTuning(int(block_k), int(stages), int(gate_up_block_n), down)


def gate_up_sources(w_gate_up) -> tuple:
    """``(gate [D, *], up [D, *], column of up's first output, I)`` of either layout: the fused
    ``[D, 2, I]`` kernel as one ``[D, 2 I]`` matrix read twice, or the ``(gate, up)`` pair."""
    if isinstance(w_gate_up, (tuple, list)):
        gate, up = w_gate_up
        if gate.ndim != 2 or gate.shape != up.shape:
            raise ValueError(f"(w_gate, w_up) must be two [D, I] kernels, got {gate.shape} and {up.shape}")
        return gate, up, 0, gate.shape[1]
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != 2:
        raise ValueError(f"w_gate_up must be [D, 2, I] or a (w_gate, w_up) pair, got {w_gate_up.shape}")
    d, _, inter = w_gate_up.shape
    both = w_gate_up.reshape(d, 2 * inter)
    return both, both, inter, inter


def _check(x, w_gate_up, w_down, *, kernel: bool):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, D], got {x.shape}")
    m, d = x.shape
    gate, up, _, inter = gate_up_sources(w_gate_up)
    if gate.shape[0] != d:
        raise ValueError(f"x {x.shape} and the gate/up kernels {gate.shape} disagree on D")
    if w_down.shape != (inter, d):
        raise ValueError(f"w_down must be [I, D] = {(inter, d)}, got {w_down.shape}")
    if not (x.dtype == gate.dtype == up.dtype == w_down.dtype):
        raise ValueError(
            f"x and the weights must share a dtype, got {x.dtype}, {gate.dtype}, {up.dtype}, {w_down.dtype}"
        )
    why = supported(x.dtype if kernel else jnp.bfloat16, m, d, inter)
    if why is not None:
        raise ValueError(f"decode_mlp_mgpu cannot serve {why}")
    return m, d, inter


def _gate_up_kernel(x_ref, wg_ref, wu_ref, o_ref, x_smem, g_smem, u_smem, o_smem, ready, *, t, steps, up_col):
    """One CTA: ``h[:, n0:n0+block_n] = silu(x W_g) * (x W_u)`` over all of K."""
    bk, stages, bn = t.block_k, t.gate_up_stages, t.gate_up_block_n
    rows = x_ref.shape[0]  # a whole number of row groups (pad_rows)
    n0 = lax.axis_index("n") * bn
    zero_pad_rows(x_smem, stages)

    def issue(i, slot):
        k0 = i * bk
        plgpu.copy_gmem_to_smem(wg_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], g_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(wu_ref.at[pl.ds(k0, bk), pl.ds(up_col + n0, bn)], u_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], x_smem.at[slot, pl.ds(0, rows)], ready.at[slot])

    for i in range(stages):  # stages <= steps (mlp_tuning)
        issue(jnp.int32(i), i)

    def acc_scope(acc_g, acc_u):
        @pl.loop(0, steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(ready.at[slot])
            plgpu.wgmma(acc_g, x_smem.at[slot], g_smem.at[slot])
            plgpu.wgmma(acc_u, x_smem.at[slot], u_smem.at[slot])
            plgpu.wgmma_wait(0)  # the slot is read: refill it

            @pl.when(i + stages < steps)
            def _():
                issue(i + stages, slot)

        return acc_g[...], acc_u[...]

    acc = plgpu.ACC((A_ROWS, bn), jnp.float32)
    g, u = pl.run_scoped(acc_scope, acc, acc)
    o_smem[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_ref.at[:, pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)


def _gate_up_call(x, w_gate_up, t: MlpTuning):
    """Kernel 1: ``x [R, D]`` -> ``h [R, I]`` in ``x``'s dtype (``R``: ``pad_rows``')."""
    gate, up, up_col, inter = gate_up_sources(w_gate_up)
    d = gate.shape[0]
    dt, size, bn = x.dtype, x.dtype.itemsize, t.gate_up_block_n
    tiles = swizzled(bn, size)  # wgmma takes A and B in one swizzle: the weight tiles' rows

    def entry(x_ref, wg_ref, wu_ref, o_ref):
        kernel = functools.partial(_gate_up_kernel, t=t, steps=cdiv(d, t.block_k), up_col=up_col)
        pl.run_scoped(
            functools.partial(kernel, x_ref, wg_ref, wu_ref, o_ref),
            plgpu.SMEM((t.gate_up_stages, A_ROWS, t.block_k), dt, transforms=tiles),
            plgpu.SMEM((t.gate_up_stages, t.block_k, bn), dt, transforms=tiles),
            plgpu.SMEM((t.gate_up_stages, t.block_k, bn), dt, transforms=tiles),
            plgpu.SMEM((A_ROWS, bn), dt, transforms=tiles),
            plgpu.Barrier(num_arrivals=3, num_barriers=t.gate_up_stages),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((x.shape[0], inter), dt),
        grid=(inter // bn,),
        grid_names=("n",),
    )(x, gate, up)


_KNOBS = ("block_k", "gate_up_stages", "down_splits", "down_stages", "gate_up_block_n", "down_block_n")
_STATIC = (*_KNOBS, "reduce")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_mlp_mgpu(x, w_gate_up, w_down, *, reduce: bool = True, **knobs):
    """``down(silu(x W_g) * (x W_u))`` of ``x [M, D]`` (module docstring). ``reduce=True``: ``[M, D]``
    in float32; ``reduce=False``: the down launch's f32 partials ``[splits, M, D]`` (their sum is the
    output). ``knobs``: :func:`mlp_tuning`'s (``block_k``, ``gate_up_stages``, ``down_splits``,
    ``down_stages``, ``gate_up_block_n``, ``down_block_n``)."""
    m, d, inter = _check(x, w_gate_up, w_down, kernel=True)
    t = mlp_tuning(d, inter, x.dtype.itemsize, **knobs)
    part = gemm_call(_gate_up_call(pad_rows(x), w_gate_up, t), w_down, t.down)[:, :m]  # [splits, M, D]
    return jnp.sum(part, axis=0) if reduce else part


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_mlp_reference(x, w_gate_up, w_down, *, reduce: bool = True, **knobs):
    """jnp twin of :func:`decode_mlp_mgpu` (same arguments and outputs): exact f32 sums of products
    of the inputs, ``h`` rounded to ``x``'s dtype as the kernel stores it, the down partials over
    the same K ranges (split ``s`` covers ``[s * steps_per_split * block_k, ...)``, the last clipped
    at I). Also takes float32 (CPU checks)."""
    m, d, inter = _check(x, w_gate_up, w_down, kernel=False)
    t = mlp_tuning(d, inter, 2, **knobs)  # the kernel's tuning: its 16-bit tiles, whatever x's dtype
    f32 = jnp.float32
    gate, up, up_col, _ = gate_up_sources(w_gate_up)
    xf = x.astype(f32)
    g = jnp.dot(xf, gate[:, :inter].astype(f32), precision="highest")
    u = jnp.dot(xf, up[:, up_col : up_col + inter].astype(f32), precision="highest")
    h = (g / (1.0 + jnp.exp(-g)) * u).astype(x.dtype)
    part = split_products(h, w_down, t.down)  # [splits, M, D]
    return jnp.sum(part, axis=0) if reduce else part
