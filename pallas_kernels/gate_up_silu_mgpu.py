"""SwiGLU's first half for prompt-sized row counts on Hopper: ``silu(x @ W_gate) * (x @ W_up)`` as
one GEMM whose epilogue applies SiLU x up (Pallas, Mosaic GPU lowering).

XLA runs this as its gate/up GEMM, which writes both halves (``[M, 2I]`` in bf16), and a fusion that
reads them back and writes ``[M, I]``: on one H100 at 1024 rows 72.9 us of kernels a layer,
against 66.5 us here (``benchmarks/results/gate_up_silu.json``; docs/decisions.md, "Gate/up GEMM
with SiLU x up in its epilogue").
Here the products stay in registers until SiLU x up, so the ``[M, 2I]`` round trip goes, and the
result is rounded to bf16 once instead of three times.

    gate_up_silu(x [M, D], w [D, 2, I]) -> [M, I]     (w: ``fuse_layer_params``' gate_up kernel)

Design: a persistent kernel (one CTA an SM, looping over output tiles in a planar snake); a tile is
``block_m`` rows x ``2 * GROUP`` output columns. Two compute warpgroups own ``GROUP`` columns each,
one memory warpgroup streams ``block_k``-deep slices of ``x`` and of the gate and up weight columns
of the tile into ``stages`` shared-memory slots (``emit_pipeline_warp_specialized``). Each compute
warpgroup keeps two float32 accumulators (its gate and its up columns), so the epilogue is
elementwise: SiLU(gate) * up, cast, staged in shared memory and stored by TMA. The weights are read
in the engine's own ``[D, 2, I]`` layout (gate columns at ``j``, up columns at ``I + j`` of its
``[D, 2I]`` view): nothing is laid out for this kernel.

Limits (``supported``): bfloat16/float16, ``M % block_m == 0``, ``D % block_k == 0``,
``I % (2 * GROUP) == 0``. ``gate_up_silu_reference`` is the jnp twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Output columns of one compute warpgroup (the width of one gate and one up accumulator).
GROUP = 64
COMPUTE_WGS = 2
TILE_N = COMPUTE_WGS * GROUP  # output columns of a tile


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Static knobs. The defaults were the fastest at 1024 and 2048 rows on one H100 of the knob
    sets of ``python -m benchmarks.gate_up_silu --sweep`` (``gate_up_silu.json``)."""

    block_m: int = 128  # rows of a tile (each compute warpgroup: all of them, GROUP columns)
    block_k: int = 64  # K depth of one pipeline step
    stages: int = 4  # pipeline steps in flight
    minor_n: bool = True  # the planar snake walks along N first
    snake_width: int = 1
    epilogue_rows: int = 64  # rows of one staged store
    # CTAs of the persistent grid; 0: one a streaming multiprocessor. Fewer leave SMs to a kernel
    # running beside it (benchmarks/sm_partition.py)
    ctas: int = 0


def supported(rows: int, hidden: int, intermediate: int, dtype, tuning: Tuning | None = None) -> str | None:
    """Why the kernel cannot serve these shapes (``None`` when it can)."""
    t = Tuning() if tuning is None else tuning
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    if rows % t.block_m or rows == 0:
        return f"rows {rows} (needs a positive multiple of {t.block_m})"
    if hidden % t.block_k:
        return f"hidden size {hidden} (needs a multiple of {t.block_k})"
    if intermediate % TILE_N:
        return f"intermediate size {intermediate} (needs a multiple of {TILE_N})"
    if t.ctas < 0:
        return f"ctas {t.ctas} (needs 0 for every SM, or a positive grid)"
    return None


def gate_up_silu_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """The jnp twin: both products in float32, SiLU x up, one rounding to ``x.dtype``."""
    y = jnp.einsum("md,dki->mki", x, w, preferred_element_type=jnp.float32)
    return (jax.nn.silu(y[:, 0]) * y[:, 1]).astype(x.dtype)


# SMs of an H100 / H200: the persistent grid's size where the default device reports none (a CPU
# machine cross-lowering the kernel for CUDA, as the tests do)
DEFAULT_SMS = 132


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_SMS


def _body(x_gmem, w_gmem, out_gmem, *, t: Tuning, intermediate: int):
    m, k = x_gmem.shape
    dtype = x_gmem.dtype
    m_tiles, n_tiles, k_steps = m // t.block_m, intermediate // TILE_N, k // t.block_k
    swizzle = plgpu.find_swizzle(t.block_k * jnp.dtype(dtype).itemsize * 8)
    in_transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(GROUP * jnp.dtype(dtype).itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    x_spec = plgpu.BlockSpec(
        (t.block_m, t.block_k), lambda s: (0, s), transforms=in_transforms, memory_space=plgpu.SMEM
    )
    w_spec = plgpu.BlockSpec((t.block_k, TILE_N), lambda s: (s, 0), transforms=in_transforms, memory_space=plgpu.SMEM)

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[x_spec, w_spec, w_spec],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=t.stages,
            compute_context=context,
        )

    def nothing(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        slots=pipeline(nothing, nothing).get_allocations(x_gmem, w_gmem, w_gmem),
        staged=plgpu.SMEM((COMPUTE_WGS, 2, t.epilogue_rows, GROUP), dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scoped(slots, staged):
        wg = lax.axis_index("wg")
        minor = 1 if t.minor_n else 0

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            (flat,) = info.index
            mi, ni = plgpu.planar_snake(flat, (m_tiles, n_tiles), minor, t.snake_width)
            row0 = pl.multiple_of(mi * t.block_m, t.block_m)
            col0 = pl.multiple_of(ni * TILE_N, TILE_N)  # gate columns of the tile; up at I + col0
            own = pl.ds(pl.multiple_of(wg * GROUP, GROUP), GROUP)  # this warpgroup's columns of the tile

            def context(run):
                @functools.partial(
                    pl.run_scoped,
                    acc_gate=plgpu.ACC((t.block_m, GROUP), jnp.float32),
                    acc_up=plgpu.ACC((t.block_m, GROUP), jnp.float32),
                )
                def _accumulate(acc_gate, acc_up):
                    run((acc_gate, acc_up))
                    g, u = acc_gate[...], acc_up[...]
                    h = (g * (1.0 / (1.0 + jnp.exp(-g))) * u).astype(dtype)
                    out_col = pl.multiple_of(col0 + wg * GROUP, GROUP)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read their slots
                    for r in range(t.block_m // t.epilogue_rows):
                        slot = r % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        staged[wg, slot] = h[r * t.epilogue_rows : (r + 1) * t.epilogue_rows]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            staged.at[wg, slot],
                            out_gmem.at[pl.ds(row0 + r * t.epilogue_rows, t.epilogue_rows), pl.ds(out_col, GROUP)],
                        )

            def mma(_, x_smem, gate_smem, up_smem, accs):
                acc_gate, acc_up = accs
                plgpu.wgmma(acc_gate, x_smem, gate_smem.at[:, own])
                plgpu.wgmma(acc_up, x_smem, up_smem.at[:, own])
                plgpu.wgmma_wait(0)
                return accs

            pipeline(mma, context)(
                x_gmem.at[pl.ds(row0, t.block_m), :],
                w_gmem.at[:, pl.ds(col0, TILE_N)],
                w_gmem.at[:, pl.ds(intermediate + col0, TILE_N)],
                allocations=slots,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store done before the kernel exits


def gate_up_silu(x: jax.Array, w: jax.Array, tuning: Tuning | None = None) -> jax.Array:
    """``silu(x @ w[:, 0]) * (x @ w[:, 1])`` for ``x [M, D]`` and ``w [D, 2, I]`` -> ``[M, I]`` in ``x.dtype``."""
    t = Tuning() if tuning is None else tuning
    m, d = x.shape
    if w.ndim != 3 or w.shape[0] != d or w.shape[1] != 2:
        raise ValueError(f"w must be [D={d}, 2, I], got {w.shape}")
    if w.dtype != x.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    inter = w.shape[2]
    why = supported(m, d, inter, x.dtype, t)
    if why is not None:
        raise ValueError(f"gate_up_silu cannot serve {why}")
    kernel = plgpu.kernel(
        functools.partial(_body, t=t, intermediate=inter),
        out_type=jax.ShapeDtypeStruct((m, inter), x.dtype),
        grid=(t.ctas or _num_sms(),),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(x, w.reshape(d, 2 * inter))
