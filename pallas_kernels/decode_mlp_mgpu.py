"""The SwiGLU MLP of a few decode rows on Hopper in two launches (Pallas, Mosaic GPU): issue 36.

XLA runs a decode layer's MLP as five kernels: the gate/up GEMM, its split-K reduce, SiLU x up,
the down GEMM and its split-K reduce (``docs/roadmap.md``: ~27 us a layer at 8 rows for ~17 us of
weight reads). Here it is two, and the down projection's split sum goes into the norm that
follows it, a fusion XLA runs anyway:

1. gate/up: grid ``I / gate_up_block_n`` CTAs (64 columns by default: 88 at Ouro-1.4B). A CTA
   streams its gate and up columns over all of K, so it owns whole sums and applies
   ``silu(g) * u`` in its epilogue. It writes ``h [16, I]`` in the model dtype.
2. down: grid ``D / down_block_n`` column blocks x ``down_splits`` K ranges (32 x 4 at
   Ouro-1.4B). A CTA streams its weight tiles and the matching columns of ``h`` (L2-resident,
   180 KB at Ouro-1.4B) and writes its f32 partial ``[16, block_n]``; ``decode_mlp_mgpu`` returns
   their sum as ``[M, D]``, which XLA fuses into the consumer.

Both are the decode projections' shape, ``x [M, K] @ w [K, N]`` with M = 1..16 rows: reading ``w``
once is the work, compute an afterthought. wgmma's A operand has 64 rows: the 16 rows of ``x`` (or
``h``) that TMA copies fill the top of a zeroed 64-row tile, and only those rows of the accumulator
are stored (an output row reads only its own row of A). The weight tile ``[block_k, block_n]`` is
the B operand. One warpgroup runs a ring of ``stages`` slots, each filled by TMA copies on one
barrier, so ``stages`` weight tiles are in flight per CTA. (A single-projection kernel of this kind,
measured at ``c47db58``, was 6% faster than XLA's GEMM a call but lost in the engine to a
transpose-and-sum per projection; here nothing is transposed and only the down projection's split
sum is left, inside a fusion XLA runs anyway.)

Layouts: ``w_gate_up`` is the fused ``gate_up_proj`` kernel ``[D, 2, I]`` of the engine's steps and
``generate()`` (a free reshape to ``[D, 2 I]``: gate columns, then up columns) or the checkpoint's
pair ``(gate_proj, up_proj)`` of ``[D, I]`` kernels; ``w_down`` is ``down_proj``'s ``[I, D]``. TMA
needs I and D multiples of 64 (the weight tiles' rows are whole swizzle atoms).

:func:`decode_mlp_reference` is the jnp twin: the same f32 sums, ``h`` rounded to the model dtype
where the kernel stores it, the same split decomposition; it also takes float32 (CPU tests).
Pallas' GPU interpreter does not model wgmma, so the CPU tests cross-lower the kernels for CUDA
instead; the GPU tests compare kernel and twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["MAX_ROWS", "MlpTuning", "decode_mlp_mgpu", "decode_mlp_reference", "mlp_tuning", "supported"]

MAX_ROWS = 16  # rows one launch serves: the rows TMA moves into the A operands and out of the accumulators
A_ROWS = 64  # wgmma's M: the A operand's rows, the first MAX_ROWS of them real
BLOCK_N = 64  # default weight columns per CTA (wgmma's N): 128-byte tile rows, the widest swizzle
BLOCK_NS = (16, 32, 64)  # the widths whose 16-bit rows are a swizzle (32, 64, 128 bytes)
TILE_BYTES = 16 * 1024  # a weight tile per pipeline step, as the skinny GEMM's measured default
NUM_SMS = 132  # an H200
SMEM_LIMIT = 227 * 1024 - 1024  # per CTA on Hopper, less the barriers
MAX_STAGES = 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class MlpTuning:
    """Static knobs of the two launches (``mlp_tuning`` checks and normalises them)."""

    block_k: int  # K per pipeline step of both kernels (a multiple of 64)
    gate_up_stages: int  # slots of kernel 1's ring: a gate tile, an up tile and x's slice each
    down_splits: int  # K ranges of kernel 2 (grid dimension), none empty
    down_steps_per_split: int
    down_stages: int
    gate_up_block_n: int = BLOCK_N  # I columns per kernel-1 CTA (its grid: I / this)
    down_block_n: int = BLOCK_N  # D columns per kernel-2 CTA (its grid: D / this x splits)


def supported(dtype, m: int, d: int, inter: int) -> str | None:
    """Why the kernels cannot serve ``m`` rows of a ``D = d``, ``I = inter`` MLP in ``dtype``
    (``None`` when they can)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (needs 1..{MAX_ROWS})"
    for name, v in (("hidden size", d), ("intermediate size", inter)):
        if v < 64 or v % 64:
            return f"{name} {v} (needs a multiple of 64: the weight tiles' 128-byte rows)"
    return None


def _stage_bytes(block_k: int, block_n: int, weight_tiles: int, itemsize: int = 2) -> int:
    """One ring slot: ``weight_tiles`` weight tiles ``[block_k, block_n]`` and the A tile ``[64, block_k]``."""
    return (weight_tiles * block_k * block_n + A_ROWS * block_k) * itemsize


def smem_bytes(t: MlpTuning, itemsize: int = 2) -> tuple[int, int]:
    """Shared memory of a CTA of each kernel: the ring and the output staging."""
    k1 = (
        t.gate_up_stages * _stage_bytes(t.block_k, t.gate_up_block_n, 2, itemsize)
        + A_ROWS * t.gate_up_block_n * itemsize
    )
    k2 = t.down_stages * _stage_bytes(t.block_k, t.down_block_n, 1, itemsize) + A_ROWS * t.down_block_n * 4
    return k1, k2


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
    target_ctas: int = NUM_SMS,
) -> MlpTuning:
    """Defaults for a ``D = d``, ``I = inter`` MLP; any knob given overrides its default.

    ``block_k``: a ``TILE_BYTES`` weight tile per step at 64 columns. ``down_splits``: enough K
    ranges that the down launch's ``D / down_block_n`` column blocks reach ``target_ctas``
    (Ouro-1.4B: 32 x 4 = 128), cut to the steps and normalised so that none is empty. Stages: as
    many slots as fit one CTA's shared memory, at most ``MAX_STAGES`` and the steps there are.
    ``*_block_n``: 16, 32 or 64 columns a CTA (narrower: more CTAs, narrower swizzles). A given
    knob is checked (``ValueError``)."""
    for name, bn, n in (("gate_up_block_n", gate_up_block_n, inter), ("down_block_n", down_block_n, d)):
        if bn not in BLOCK_NS or n % bn:
            raise ValueError(f"{name}={bn} must be one of {BLOCK_NS} and divide {n}")
    if block_k is None:
        block_k = max(64, TILE_BYTES // (BLOCK_N * itemsize) // 64 * 64)
    if block_k < 64 or block_k % 64:
        raise ValueError(f"block_k={block_k} must be a positive multiple of 64 (128-byte swizzle atoms)")
    k1_steps, k2_steps = _cdiv(d, block_k), _cdiv(inter, block_k)
    if down_splits is None:
        down_splits = max(1, target_ctas // (d // down_block_n))
    if down_splits < 1:
        raise ValueError(f"down_splits={down_splits} must be >= 1")
    down_splits = min(down_splits, k2_steps)
    per_split = _cdiv(k2_steps, down_splits)
    down_splits = _cdiv(k2_steps, per_split)

    def fit(weight_tiles: int, block_n: int, staging: int, steps: int, given: int | None, name: str) -> int:
        per_stage = _stage_bytes(block_k, block_n, weight_tiles, itemsize)
        if given is None:
            given = max(1, min(MAX_STAGES, (SMEM_LIMIT - staging) // per_stage))
        if given < 1:
            raise ValueError(f"{name}={given} must be >= 1")
        given = min(given, steps)  # more slots than steps would stay empty
        if given * per_stage + staging > SMEM_LIMIT:
            raise ValueError(
                f"{name}={given} x block_k={block_k} need {given * per_stage + staging} B of shared memory "
                f"> {SMEM_LIMIT}"
            )
        return given

    k1_out, k2_out = A_ROWS * gate_up_block_n * itemsize, A_ROWS * down_block_n * 4
    gate_up_stages = fit(2, gate_up_block_n, k1_out, k1_steps, gate_up_stages, "gate_up_stages")
    down_stages = fit(1, down_block_n, k2_out, per_split, down_stages, "down_stages")
    return MlpTuning(
        int(block_k),
        int(gate_up_stages),
        int(down_splits),
        int(per_split),
        int(down_stages),
        int(gate_up_block_n),
        int(down_block_n),
    )


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


def _swizzled(minor_bytes: int, itemsize: int):
    """Tiling and swizzle of a shared-memory tile whose rows are ``minor_bytes`` long."""
    return (plgpu.TilingTransform((8, minor_bytes // itemsize)), plgpu.SwizzleTransform(minor_bytes))


def _zero_pad_rows(ref, stages: int) -> None:
    """Zero every slot of an A-operand ring before its first TMA copy: TMA fills only the first
    ``MAX_ROWS`` rows, and a row of wgmma's output reads only its own row of A, so the other rows
    would only put garbage into output rows that are never stored; zeroed all the same (whole
    64-row slots: a register array's rows come in 64s)."""
    for slot in range(stages):
        ref[slot] = jnp.zeros(ref.shape[1:], ref.dtype)
    plgpu.commit_smem()  # the writes above, before the TMA copies and the tensor cores (async proxy)


def _gate_up_kernel(x_ref, wg_ref, wu_ref, o_ref, x_smem, g_smem, u_smem, o_smem, ready, *, t, steps, up_col):
    """One CTA: ``h[:, n0:n0+64] = silu(x W_g) * (x W_u)`` over all of K."""
    bk, stages, bn = t.block_k, t.gate_up_stages, t.gate_up_block_n
    n0 = lax.axis_index("n") * bn
    _zero_pad_rows(x_smem, stages)

    def issue(i, slot):
        k0 = i * bk
        plgpu.copy_gmem_to_smem(wg_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], g_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(wu_ref.at[pl.ds(k0, bk), pl.ds(up_col + n0, bn)], u_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], x_smem.at[slot, pl.ds(0, MAX_ROWS)], ready.at[slot])

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
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, MAX_ROWS)], o_ref.at[:, pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)


def _down_kernel(h_ref, w_ref, o_ref, h_smem, w_smem, o_smem, ready, *, t: MlpTuning, k_steps: int):
    """One CTA: the f32 partial ``y[:, n0:n0+64]`` of its K range, ``h W_d``."""
    bk, stages, sps, bn = t.block_k, t.down_stages, t.down_steps_per_split, t.down_block_n
    n0 = lax.axis_index("n") * bn
    sp = lax.axis_index("split")
    step0 = sp * sps
    n_steps = jnp.minimum(sps, k_steps - step0)  # >= 1: the tuning leaves no split empty
    _zero_pad_rows(h_smem, stages)

    def issue(i, slot):
        k0 = (step0 + i) * bk
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0, bk), pl.ds(n0, bn)], w_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(h_ref.at[:, pl.ds(k0, bk)], h_smem.at[slot, pl.ds(0, MAX_ROWS)], ready.at[slot])

    for i in range(stages):

        @pl.when(i < n_steps)
        def _():
            issue(jnp.int32(i), i)

    def acc_scope(acc_ref):
        @pl.loop(0, n_steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(ready.at[slot])
            plgpu.wgmma(acc_ref, h_smem.at[slot], w_smem.at[slot])
            plgpu.wgmma_wait(0)

            @pl.when(i + stages < n_steps)
            def _():
                issue(i + stages, slot)

        return acc_ref[...]

    o_smem[...] = pl.run_scoped(acc_scope, plgpu.ACC((A_ROWS, bn), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, MAX_ROWS)], o_ref.at[sp, :, pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)


def _gate_up_call(x, w_gate_up, t: MlpTuning):
    """Kernel 1: ``x [MAX_ROWS, D]`` -> ``h [MAX_ROWS, I]`` in ``x``'s dtype."""
    gate, up, up_col, inter = gate_up_sources(w_gate_up)
    d = gate.shape[0]
    dt, size, bn = x.dtype, x.dtype.itemsize, t.gate_up_block_n
    tiles = _swizzled(bn * size, size)  # wgmma takes A and B in one swizzle: the weight tiles' rows

    def entry(x_ref, wg_ref, wu_ref, o_ref):
        kernel = functools.partial(_gate_up_kernel, t=t, steps=_cdiv(d, t.block_k), up_col=up_col)
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
        out_type=jax.ShapeDtypeStruct((MAX_ROWS, inter), dt),
        grid=(inter // bn,),
        grid_names=("n",),
    )(x, gate, up)


def _down_call(h, w_down, t: MlpTuning):
    """Kernel 2: ``h [MAX_ROWS, I]`` -> the f32 partials ``[splits, MAX_ROWS, D]``."""
    inter, d = w_down.shape
    dt, size, bn = h.dtype, h.dtype.itemsize, t.down_block_n
    tiles = _swizzled(bn * size, size)

    def entry(h_ref, w_ref, o_ref):
        pl.run_scoped(
            functools.partial(_down_kernel, h_ref, w_ref, o_ref, t=t, k_steps=_cdiv(inter, t.block_k)),
            plgpu.SMEM((t.down_stages, A_ROWS, t.block_k), dt, transforms=tiles),
            plgpu.SMEM((t.down_stages, t.block_k, bn), dt, transforms=tiles),
            plgpu.SMEM((A_ROWS, bn), jnp.float32, transforms=_swizzled(min(128, bn * 4), 4)),
            plgpu.Barrier(num_arrivals=2, num_barriers=t.down_stages),
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((t.down_splits, MAX_ROWS, d), jnp.float32),
        grid=(d // bn, t.down_splits),
        grid_names=("n", "split"),
    )(h, w_down)


_KNOBS = ("block_k", "gate_up_stages", "down_splits", "down_stages", "gate_up_block_n", "down_block_n")
_STATIC = (*_KNOBS, "reduce")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_mlp_mgpu(
    x,
    w_gate_up,
    w_down,
    *,
    block_k: int | None = None,
    gate_up_stages: int | None = None,
    down_splits: int | None = None,
    down_stages: int | None = None,
    gate_up_block_n: int = BLOCK_N,
    down_block_n: int = BLOCK_N,
    reduce: bool = True,
):
    """``down(silu(x W_g) * (x W_u))`` of ``x [M, D]`` (module docstring). ``reduce=True``: ``[M, D]``
    in float32; ``reduce=False``: the down launch's f32 partials ``[splits, M, D]`` (their sum is the
    output)."""
    knobs = dict(zip(_KNOBS, (block_k, gate_up_stages, down_splits, down_stages, gate_up_block_n, down_block_n)))
    m, d, inter = _check(x, w_gate_up, w_down, kernel=True)
    t = mlp_tuning(d, inter, x.dtype.itemsize, **knobs)
    x = jnp.pad(x, ((0, MAX_ROWS - m), (0, 0)))  # XLA fuses it into the norm that makes x
    part = _down_call(_gate_up_call(x, w_gate_up, t), w_down, t)[:, :m]  # [splits, M, D]
    return jnp.sum(part, axis=0) if reduce else part


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_mlp_reference(
    x,
    w_gate_up,
    w_down,
    *,
    block_k: int | None = None,
    gate_up_stages: int | None = None,
    down_splits: int | None = None,
    down_stages: int | None = None,
    gate_up_block_n: int = BLOCK_N,
    down_block_n: int = BLOCK_N,
    reduce: bool = True,
):
    """jnp twin of :func:`decode_mlp_mgpu` (same arguments and outputs): exact f32 sums of products
    of the inputs, ``h`` rounded to ``x``'s dtype as the kernel stores it, the down partials over
    the same K ranges (split ``s`` covers ``[s * steps_per_split * block_k, ...)``, the last clipped
    at I). Also takes float32 (CPU checks)."""
    knobs = dict(zip(_KNOBS, (block_k, gate_up_stages, down_splits, down_stages, gate_up_block_n, down_block_n)))
    m, d, inter = _check(x, w_gate_up, w_down, kernel=False)
    t = mlp_tuning(d, inter, 2, **knobs)  # the kernel's tuning: its 16-bit tiles, whatever x's dtype
    f32 = jnp.float32
    gate, up, up_col, _ = gate_up_sources(w_gate_up)
    xf = x.astype(f32)
    g = jnp.dot(xf, gate[:, :inter].astype(f32), precision="highest")
    u = jnp.dot(xf, up[:, up_col : up_col + inter].astype(f32), precision="highest")
    h = (g / (1.0 + jnp.exp(-g)) * u).astype(x.dtype).astype(f32)
    chunk = t.down_steps_per_split * t.block_k
    kp = t.down_splits * chunk
    hs = jnp.pad(h, ((0, 0), (0, kp - inter))).reshape(m, t.down_splits, chunk)
    ws = jnp.pad(w_down.astype(f32), ((0, kp - inter), (0, 0))).reshape(t.down_splits, chunk, d)
    part = jnp.einsum("msc,scn->smn", hs, ws, precision="highest")  # [splits, M, D]
    return jnp.sum(part, axis=0) if reduce else part
