"""The fused Q/K/V projection for prompt-sized row counts on Hopper, with RoPE in its epilogue
(Pallas, Mosaic GPU lowering).

Today a prompt step runs the projection as XLA's GEMM, which writes ``[M, G, g + 2, hd]`` in bf16,
and ``rope_write_kv`` reads it back to rotate the query and key heads. Here each head's
products stay in float32 registers until they are rotated, and come out as the two arrays the
rest of the layer reads: the rotated queries ``[M, G * g, hd]`` (attention's input as it is) and
the rotated keys with the values ``[M, G, 2, hd]`` (what the K/V write stores in the pools).

    qkv_rope(x [M, D], w [D, G, g + 2, hd], cos [M, hd], sin [M, hd]) -> (q, kv)

``w`` is ``model.fuse_layer_params``' ``qkv_proj`` kernel: per KV head ``j``, its ``g`` query heads,
then its key and its value head, each ``hd`` columns. RoPE is the model's (``rope.apply_rope``:
halves split, ``x1 * c - x2 * s`` and ``x2 * c + x1 * s``) on ``rope.rope_cos_sin``'s tables, of
which the kernel reads the first half of each row: that function repeats each frequency in both
halves. The result differs from the XLA path by rounding only: each output is rounded to bf16
once, from float32 products, where XLA's path rounds the projection and then the rotation.

Design: a persistent kernel (one CTA an SM, looping over output tiles in a planar snake), as
``gate_up_silu_mgpu``. A tile is ``block_m`` rows x ``heads`` heads of ``hd`` columns. Two compute
warpgroups split it: with ``heads == 1`` each takes half of the rows of the one head, with ``heads
== 2`` each takes one head and all the rows. A warpgroup keeps two float32 accumulators, the low and
the high half of its head's columns, so the rotation pairs elements of the same registers; one
memory warpgroup streams ``block_k``-deep slices of ``x`` and of the tile's weight columns into
``stages`` shared-memory slots (``emit_pipeline_warp_specialized``). The epilogue rotates query and
key heads (a value head is stored as it is) in slices of 64 rows, stages them in shared memory and
stores them by TMA into ``q`` or ``kv``.

Limits (``supported``): bfloat16/float16, ``hd == 128``, ``M % block_m == 0``, ``D % block_k == 0``,
``G * (g + 2) % heads == 0``. ``qkv_rope_reference`` is the jnp twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rope import apply_rope

HALF = 64  # columns of one accumulator: half a head (the kernel serves head_dim 128)
HEAD_DIM = 2 * HALF
COMPUTE_WGS = 2
EPILOGUE_ROWS = 64  # rows of one staged store (one wgmma row block)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Static knobs (``python -m benchmarks.qkv_rope --sweep`` times them)."""

    block_m: int = 128  # rows of a tile
    heads: int = 1  # heads of a tile: 1 (the warpgroups split the rows) or 2 (one head each)
    block_k: int = 64  # K depth of one pipeline step
    stages: int = 4  # pipeline steps in flight
    minor_n: bool = True  # the planar snake walks along the heads first
    snake_width: int = 1

    @property
    def wg_rows(self) -> int:
        return self.block_m // COMPUTE_WGS if self.heads == 1 else self.block_m


def supported(rows: int, hidden: int, num_kv_heads: int, group: int, head_dim: int, dtype, tuning=None) -> str | None:
    """Why the kernel cannot serve these shapes (``None`` when it can); ``group`` is ``g``."""
    t = Tuning() if tuning is None else tuning
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (needs bfloat16 or float16)"
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim} (needs {HEAD_DIM})"
    if t.heads not in (1, 2) or t.wg_rows % EPILOGUE_ROWS:
        return f"tiling {t} (heads 1 or 2, {EPILOGUE_ROWS}-row multiples a warpgroup)"
    if rows % t.block_m or rows == 0:
        return f"rows {rows} (needs a positive multiple of {t.block_m})"
    if hidden % t.block_k:
        return f"hidden size {hidden} (needs a multiple of {t.block_k})"
    if (num_kv_heads * (group + 2)) % t.heads:
        return f"{num_kv_heads * (group + 2)} heads of Q/K/V (needs a multiple of {t.heads})"
    return None


def qkv_rope_reference(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array):
    """The jnp twin: the projection in float32, the model's RoPE (``apply_rope``) on the query and
    key heads, one rounding to ``x.dtype``."""
    m = x.shape[0]
    _, G, g2, hd = w.shape
    g = g2 - 2
    y = jnp.einsum("md,dgth->mgth", x, w, preferred_element_type=jnp.float32)
    q = apply_rope(y[:, :, :g].reshape(m, G * g, hd), cos, sin).astype(x.dtype)
    k = apply_rope(y[:, :, g], cos, sin)
    return q, jnp.stack([k, y[:, :, g + 1]], axis=2).astype(x.dtype)


# SMs of an H100 / H200: the persistent grid's size where the default device reports none (a CPU
# machine cross-lowering the kernel for CUDA, as the tests do)
DEFAULT_SMS = 132


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or DEFAULT_SMS


def _transforms(cols: int, dtype):
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _body(x_gmem, w_gmem, cos_gmem, sin_gmem, q_gmem, kv_gmem, *, t: Tuning, group: int):
    m, k = x_gmem.shape
    dtype = x_gmem.dtype
    num_heads = w_gmem.shape[1] // HEAD_DIM  # Q, K and V heads: G * (g + 2)
    per_kv = group + 2
    m_tiles, n_tiles, k_steps = m // t.block_m, num_heads // t.heads, k // t.block_k
    in_transforms = _transforms(t.block_k, dtype)
    x_spec = plgpu.BlockSpec(
        (t.block_m, t.block_k), lambda s: (0, s), transforms=in_transforms, memory_space=plgpu.SMEM
    )
    w_spec = plgpu.BlockSpec(
        (t.block_k, t.heads * HEAD_DIM), lambda s: (s, 0), transforms=in_transforms, memory_space=plgpu.SMEM
    )

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[x_spec, w_spec],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=t.stages,
            compute_context=context,
        )

    def nothing(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        slots=pipeline(nothing, nothing).get_allocations(x_gmem, w_gmem),
        staged=plgpu.SMEM((COMPUTE_WGS, 2, EPILOGUE_ROWS, HALF), dtype, transforms=_transforms(HALF, dtype)),
        collective_axes="wg",
    )
    def _scoped(slots, staged):
        wg = lax.axis_index("wg")
        minor = 1 if t.minor_n else 0
        if t.heads == 1:
            own_rows = pl.ds(pl.multiple_of(wg * t.wg_rows, t.wg_rows), t.wg_rows)
            own_cols = slice(None)
        else:
            own_rows = slice(None)
            own_cols = pl.ds(pl.multiple_of(wg * HEAD_DIM, HEAD_DIM), HEAD_DIM)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            (flat,) = info.index
            mi, ni = plgpu.planar_snake(flat, (m_tiles, n_tiles), minor, t.snake_width)
            row0 = pl.multiple_of(mi * t.block_m, t.block_m)
            head0 = ni * t.heads  # the tile's first head among the G * (g + 2)
            my_row0 = row0 + (wg * t.wg_rows if t.heads == 1 else 0)
            head = head0 + (0 if t.heads == 1 else wg)
            kv_head, kind = head // per_kv, head % per_kv  # kind < g: a query head; g: the key; g + 1: the value

            def store(r, lo, hi):
                """Rows ``r * 64 ...`` of this warpgroup's head: both halves staged, then stored."""
                rows = pl.ds(my_row0 + r * EPILOGUE_ROWS, EPILOGUE_ROWS)
                for half, val in ((0, lo), (1, hi)):
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    staged[wg, half] = val.astype(dtype)
                    plgpu.commit_smem()

                    @pl.when(kind < group)
                    def _():
                        col = pl.multiple_of((kv_head * group + kind) * HEAD_DIM + half * HALF, HALF)
                        plgpu.copy_smem_to_gmem(staged.at[wg, half], q_gmem.at[rows, pl.ds(col, HALF)])

                    @pl.when(kind >= group)
                    def _():
                        col = pl.multiple_of((kv_head * 2 + kind - group) * HEAD_DIM + half * HALF, HALF)
                        plgpu.copy_smem_to_gmem(staged.at[wg, half], kv_gmem.at[rows, pl.ds(col, HALF)])

            def context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.wg_rows, HEAD_DIM), jnp.float32))
                def _accumulate(acc):
                    run(acc)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read their slots
                    for r in range(t.wg_rows // EPILOGUE_ROWS):
                        part = acc[pl.ds(r * EPILOGUE_ROWS, EPILOGUE_ROWS), :]
                        x1, x2 = part[:, :HALF], part[:, HALF:]

                        @pl.when(kind <= group)
                        def _():
                            rows = pl.ds(my_row0 + r * EPILOGUE_ROWS, EPILOGUE_ROWS)
                            first = pl.ds(0, HALF)  # == the second half (module docstring)
                            c = plgpu.load(cos_gmem.at[rows, first], layout=plgpu.Layout.WGMMA, optimized=False)
                            s = plgpu.load(sin_gmem.at[rows, first], layout=plgpu.Layout.WGMMA, optimized=False)
                            store(r, x1 * c - x2 * s, x2 * c + x1 * s)

                        @pl.when(kind > group)
                        def _():
                            store(r, x1, x2)

            def mma(_, x_smem, w_smem, acc):
                plgpu.wgmma(acc, x_smem.at[own_rows], w_smem.at[:, own_cols])
                plgpu.wgmma_wait(0)
                return acc

            pipeline(mma, context)(
                x_gmem.at[pl.ds(row0, t.block_m), :],
                w_gmem.at[:, pl.ds(head0 * HEAD_DIM, t.heads * HEAD_DIM)],
                allocations=slots,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store done before the kernel exits


def qkv_rope(x: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, tuning: Tuning | None = None):
    """``(q [M, G * g, hd], kv [M, G, 2, hd])``: the projection ``x @ w`` with the query and key
    heads rotated (see the module docstring); ``cos``/``sin``: ``rope_cos_sin``'s ``[M, hd]``."""
    t = Tuning() if tuning is None else tuning
    m, d = x.shape
    if w.ndim != 4 or w.shape[0] != d:
        raise ValueError(f"w must be [D={d}, G, g + 2, hd], got {w.shape}")
    if w.dtype != x.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    _, G, g2, hd = w.shape
    g = g2 - 2
    if g < 1:
        raise ValueError(f"w's third axis holds g >= 1 query heads, then K and V; got {g2}")
    if cos.shape != (m, hd) or sin.shape != (m, hd):
        raise ValueError(f"cos/sin must be [M, hd] = {(m, hd)}, got {cos.shape} / {sin.shape}")
    why = supported(m, d, G, g, hd, x.dtype, t)
    if why is not None:
        raise ValueError(f"qkv_rope cannot serve {why}")
    kernel = plgpu.kernel(
        functools.partial(_body, t=t, group=g),
        out_type=(
            jax.ShapeDtypeStruct((m, G * g * hd), x.dtype),
            jax.ShapeDtypeStruct((m, G * 2 * hd), x.dtype),
        ),
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    q, kv = kernel(x, w.reshape(d, G * g2 * hd), cos.astype(jnp.float32), sin.astype(jnp.float32))
    return q.reshape(m, G * g, hd), kv.reshape(m, G, 2, hd)
