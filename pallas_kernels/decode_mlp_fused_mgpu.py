"""The SwiGLU MLP of a few decode rows on Hopper in one launch (Pallas, Mosaic GPU): issue 36.

``decode_mlp_mgpu`` runs the MLP as two launches; each pays a ramp (the first weight tiles in
flight) and a tail (the last CTAs draining), and the down projection's ring starts empty. Here
both phases are one grid of ``max(I / gate_up_block_n, D / down_block_n x down_splits)`` CTAs,
one an SM (Ouro-1.4B: 128), with a grid-wide barrier between them:

1. Every CTA first puts its down item's first ``down_stages`` weight tiles in flight: they do not
   depend on ``h``.
2. gate/up: CTA ``c < I / gate_up_block_n`` streams its gate and up columns over all of K and
   writes ``h[:, c-th block] = silu(x W_g) * (x W_u)`` (model dtype) to a global scratch ``h``
   (TMA store, waited for). The other CTAs have no gate/up work and wait with a full ring.
3. The barrier: each CTA adds 1 to a global semaphore (a release at GPU scope) and polls it until
   all have arrived (then an acquire). At the end every CTA adds 1 to a second semaphore, and CTA
   0 waits for all of those and takes both back to zero for the next launch: the poll never
   contends on an atomic, and nothing is reset while a CTA may still be polling.
4. down: CTA ``c`` = (column block, K split) reads ``h``'s slices (L2-resident) into the slots
   whose weight tiles are already there, and writes its f32 partial ``[R, down_block_n]``; the
   caller sums the splits (XLA fuses the sum into the consumer).

Every CTA must be resident at once for the barrier: the grid is at most the GPU's SM count (each
CTA's shared memory keeps it to one an SM), else ``supported`` says why not. The semaphores are
the kernel's own globals, so two launches of it must not run at the same time: in a layer stack
each MLP depends on the one before, and XLA runs dependent launches in order.

The jnp twin is ``decode_mlp_reference`` (the same ``h`` rounding and the same down partials, with
the tuning's ``block_k`` and splits). The interpreter cannot run the global semaphores: the CPU
tests cross-lower the kernel for CUDA; the GPU tests compare kernel and twin.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_gemm_mgpu import (
    A_ROWS,
    BLOCK_N,
    MAX_STAGES,
    NUM_SMS,
    SMEM_LIMIT,
    GemmTuning,
    cdiv,
    check_knobs,
    default_block_k,
    gemm_tuning,
    pad_rows,
    stage_bytes,
    swizzled,
    zero_pad_rows,
)
from pallas_kernels.decode_mlp_mgpu import _check, gate_up_sources

__all__ = ["FusedMlpTuning", "decode_mlp_fused_mgpu", "fused_mlp_tuning", "resident_ctas", "supported"]


def resident_ctas() -> int:
    """CTAs that can be resident at once at one an SM: the default device's SM count on a GPU,
    else an H200's (cross-lowering on a CPU)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or NUM_SMS) if dev.platform == "gpu" else NUM_SMS


@dataclasses.dataclass(frozen=True)
class FusedMlpTuning:
    """Static knobs of the launch (``fused_mlp_tuning`` checks and normalises them)."""

    block_k: int  # K per pipeline step of both phases (a multiple of 64)
    gate_up_stages: int  # gate/up ring slots: a gate tile, an up tile and x's slice each
    gate_up_block_n: int  # I columns per gate/up CTA
    down: GemmTuning  # the down phase: column blocks x splits, its ring (a weight tile and h's slice)
    ctas: int  # the grid: enough CTAs for both phases' items

    def smem_bytes(self, itemsize: int = 2) -> int:
        """Shared memory of a CTA: both rings (the down ring fills during gate/up) and the two
        output stagings."""
        bn, d = self.gate_up_block_n, self.down
        ring_a = self.gate_up_stages * stage_bytes(self.block_k, bn, 2, itemsize)
        ring_b = d.stages * stage_bytes(self.block_k, d.block_n, 1, itemsize)
        return ring_a + ring_b + A_ROWS * bn * itemsize + A_ROWS * d.block_n * 4


def fused_mlp_tuning(
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
) -> FusedMlpTuning:
    """Defaults for a ``D = d``, ``I = inter`` MLP; a knob given overrides its default (checked:
    ``ValueError``). The down items are ``gemm_tuning(I, D)``'s (Ouro-1.4B: 32 column blocks x 4
    splits); the rings split a CTA's shared memory evenly unless their slots are given."""
    block_k = default_block_k(itemsize) if block_k is None else block_k
    check_knobs(block_k, gate_up_block_n=(gate_up_block_n, inter))
    down = gemm_tuning(
        inter, d, itemsize, block_k=block_k, splits=down_splits, stages=1, block_n=down_block_n, knob_prefix="down_"
    )
    per_a = stage_bytes(block_k, gate_up_block_n, 2, itemsize)
    per_b = stage_bytes(block_k, down.block_n, 1, itemsize)
    staging = A_ROWS * gate_up_block_n * itemsize + A_ROWS * down.block_n * 4
    rings = SMEM_LIMIT - staging
    steps_a = cdiv(d, block_k)
    if gate_up_stages is None:
        budget = rings // 2 if down_stages is None else rings - down_stages * per_b
        gate_up_stages = max(1, min(MAX_STAGES, steps_a, budget // per_a))
    if down_stages is None:
        down_stages = max(1, min(MAX_STAGES, down.steps_per_split, (rings - gate_up_stages * per_a) // per_b))
    for name, s in (("gate_up_stages", gate_up_stages), ("down_stages", down_stages)):
        if s < 1:
            raise ValueError(f"{name}={s} must be >= 1")
    gate_up_stages = min(gate_up_stages, steps_a)
    down = dataclasses.replace(down, stages=min(down_stages, down.steps_per_split))
    ctas = max(inter // gate_up_block_n, (d // down.block_n) * down.splits)
    t = FusedMlpTuning(int(block_k), int(gate_up_stages), int(gate_up_block_n), down, int(ctas))
    if t.smem_bytes(itemsize) > SMEM_LIMIT:
        raise ValueError(
            f"gate_up_stages={gate_up_stages} and down_stages={down.stages} need {t.smem_bytes(itemsize)} B of "
            f"shared memory > {SMEM_LIMIT}"
        )
    return t


def supported(dtype, m: int, d: int, inter: int, **knobs) -> str | None:
    """Why the launch cannot serve ``m`` rows of a ``D = d``, ``I = inter`` MLP in ``dtype`` with
    these knobs (``None`` when it can): ``decode_mlp_mgpu``'s limits, and a grid that fits the
    GPU's SMs at once (the barrier waits for every CTA)."""
    from pallas_kernels.decode_mlp_mgpu import supported as two_launch_supported

    why = two_launch_supported(dtype, m, d, inter)
    if why is not None:
        return why
    ctas, sms = fused_mlp_tuning(d, inter, jnp.dtype(dtype).itemsize, **knobs).ctas, resident_ctas()
    if ctas > sms:
        return f"a grid of {ctas} CTAs (the barrier needs them all resident: {sms} SMs)"
    return None


@plgpu.inline_mgpu()
def _proxy_fence(ctx):
    """Orders this thread's global memory accesses of the generic proxy (the semaphores) with those
    of the async proxy (TMA): after h's store, before the signal; after the poll, before h's loads."""
    del ctx
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)


def _kernel(x_ref, wg_ref, wu_ref, wd_ref, o_ref, h_ref, *scratch, t: FusedMlpTuning, up_col: int):
    xa, ga, ua, ha, hb, wb, ob, ready_a, ready_b = scratch
    d, inter = x_ref.shape[1], h_ref.shape[1]
    rows = x_ref.shape[0]  # a whole number of row groups (pad_rows)
    bk, sa, bna = t.block_k, t.gate_up_stages, t.gate_up_block_n
    dn = t.down
    sb, bnb, sps = dn.stages, dn.block_n, dn.steps_per_split
    c = lax.axis_index("c")
    n_a = inter // bna
    n_b = (d // bnb) * dn.splits
    has_b = c < n_b
    n0b = lax.rem(c, d // bnb) * bnb  # neighbouring CTAs: one split, adjacent columns
    sp = lax.div(c, d // bnb)
    step0 = sp * sps
    nsteps_b = jnp.minimum(sps, cdiv(inter, bk) - step0)  # >= 1 for a real item (no split is empty)
    zero_pad_rows(xa, sa)
    zero_pad_rows(hb, sb)

    def issue_w(i, slot):
        k0 = (step0 + i) * bk
        plgpu.copy_gmem_to_smem(wd_ref.at[pl.ds(k0, bk), pl.ds(n0b, bnb)], wb.at[slot], ready_b.at[slot])

    def issue_h(i, slot):
        k0 = (step0 + i) * bk
        plgpu.copy_gmem_to_smem(h_ref.at[:, pl.ds(k0, bk)], hb.at[slot, pl.ds(0, rows)], ready_b.at[slot])

    # 1. The down phase's first weight tiles: in flight through the whole gate/up phase.
    for i in range(sb):

        @pl.when(has_b & (i < nsteps_b))
        def _():
            issue_w(jnp.int32(i), i)

    # 2. gate/up with SiLU x up: h's columns of this CTA, stored and waited for.
    @pl.when(c < n_a)
    def _():
        n0a = c * bna
        steps = cdiv(d, bk)

        def issue(i, slot):
            k0 = i * bk
            plgpu.copy_gmem_to_smem(wg_ref.at[pl.ds(k0, bk), pl.ds(n0a, bna)], ga.at[slot], ready_a.at[slot])
            plgpu.copy_gmem_to_smem(wu_ref.at[pl.ds(k0, bk), pl.ds(up_col + n0a, bna)], ua.at[slot], ready_a.at[slot])
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], xa.at[slot, pl.ds(0, rows)], ready_a.at[slot])

        for i in range(sa):  # sa <= steps (fused_mlp_tuning)
            issue(jnp.int32(i), i)

        def acc_scope(acc_g, acc_u):
            @pl.loop(0, steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(sa))
                plgpu.barrier_wait(ready_a.at[slot])
                plgpu.wgmma(acc_g, xa.at[slot], ga.at[slot])
                plgpu.wgmma(acc_u, xa.at[slot], ua.at[slot])
                plgpu.wgmma_wait(0)  # the slot is read: refill it

                @pl.when(i + sa < steps)
                def _():
                    issue(i + sa, slot)

            return acc_g[...], acc_u[...]

        acc = plgpu.ACC((A_ROWS, bna), jnp.float32)
        g, u = pl.run_scoped(acc_scope, acc, acc)
        ha[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(ha.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ha.at[pl.ds(0, rows)], h_ref.at[:, pl.ds(n0a, bna)])
        plgpu.wait_smem_to_gmem(0)  # h's writes done before this CTA arrives at the barrier
        _proxy_fence()

    # 3. Every CTA's h written: arrive, then poll until all have.
    sems = pl.get_global(plgpu.SemaphoreType.REGULAR((2,)))
    arrived, passed = sems.at[0], sems.at[1]
    plgpu.semaphore_signal(arrived, 1, memory_scope="gpu")
    plgpu.semaphore_wait(arrived, t.ctas, decrement=False, memory_scope="gpu")
    _proxy_fence()

    # 4. down: h's slices join the weight tiles already in the slots.
    @pl.when(has_b)
    def _():
        for i in range(sb):

            @pl.when(i < nsteps_b)
            def _():
                issue_h(jnp.int32(i), i)

        def acc_scope(acc_ref):
            @pl.loop(0, nsteps_b)
            def _(i):
                slot = lax.rem(i, jnp.int32(sb))
                plgpu.barrier_wait(ready_b.at[slot])
                plgpu.wgmma(acc_ref, hb.at[slot], wb.at[slot])
                plgpu.wgmma_wait(0)

                @pl.when(i + sb < nsteps_b)
                def _():
                    issue_w(i + sb, slot)
                    issue_h(i + sb, slot)

            return acc_ref[...]

        ob[...] = pl.run_scoped(acc_scope, plgpu.ACC((A_ROWS, bnb), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ob.at[pl.ds(0, rows)], o_ref.at[sp, :, pl.ds(n0b, bnb)])
        plgpu.wait_smem_to_gmem(0)

    # 5. Back to zero for the next launch: CTA 0 takes both semaphores down once every CTA has
    # passed the poll (each says so on the second one).
    plgpu.semaphore_signal(passed, 1, memory_scope="gpu")

    @pl.when(c == 0)
    def _():
        plgpu.semaphore_wait(passed, t.ctas, memory_scope="gpu")
        plgpu.semaphore_wait(arrived, t.ctas, memory_scope="gpu")


def _call(x, w_gate_up, w_down, t: FusedMlpTuning):
    """The launch: ``x [R, D]`` -> the f32 down partials ``[splits, R, D]`` (``R``: ``pad_rows``')."""
    gate, up, up_col, inter = gate_up_sources(w_gate_up)
    d = gate.shape[0]
    dt, size = x.dtype, x.dtype.itemsize
    bna, dn = t.gate_up_block_n, t.down
    tiles_a, tiles_b = swizzled(bna, size), swizzled(dn.block_n, size)

    def entry(x_ref, wg_ref, wu_ref, wd_ref, o_ref, h_ref):
        pl.run_scoped(
            functools.partial(_kernel, x_ref, wg_ref, wu_ref, wd_ref, o_ref, h_ref, t=t, up_col=up_col),
            plgpu.SMEM((t.gate_up_stages, A_ROWS, t.block_k), dt, transforms=tiles_a),
            plgpu.SMEM((t.gate_up_stages, t.block_k, bna), dt, transforms=tiles_a),
            plgpu.SMEM((t.gate_up_stages, t.block_k, bna), dt, transforms=tiles_a),
            plgpu.SMEM((A_ROWS, bna), dt, transforms=tiles_a),
            plgpu.SMEM((dn.stages, A_ROWS, t.block_k), dt, transforms=tiles_b),
            plgpu.SMEM((dn.stages, t.block_k, dn.block_n), dt, transforms=tiles_b),
            plgpu.SMEM((A_ROWS, dn.block_n), jnp.float32, transforms=swizzled(dn.block_n, 4)),
            plgpu.Barrier(num_arrivals=3, num_barriers=t.gate_up_stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=dn.stages),
        )

    part, _ = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((dn.splits, x.shape[0], d), jnp.float32),
            jax.ShapeDtypeStruct((x.shape[0], inter), dt),  # h: scratch between the phases
        ),
        grid=(t.ctas,),
        grid_names=("c",),
    )(x, gate, up, w_down)
    return part


_KNOBS = ("block_k", "gate_up_stages", "down_splits", "down_stages", "gate_up_block_n", "down_block_n")


@functools.partial(jax.jit, static_argnames=(*_KNOBS, "reduce"))
def decode_mlp_fused_mgpu(x, w_gate_up, w_down, *, reduce: bool = True, **knobs):
    """``down(silu(x W_g) * (x W_u))`` of ``x [M, D]`` in one launch (module docstring): the
    arguments and outputs of ``decode_mlp_mgpu`` (whose twin, ``decode_mlp_reference``, serves this
    one with the same knobs). ``knobs``: :func:`fused_mlp_tuning`'s."""
    m, d, inter = _check(x, w_gate_up, w_down, kernel=True)
    why = supported(x.dtype, m, d, inter, **knobs)
    if why is not None:
        raise ValueError(f"decode_mlp_fused_mgpu cannot serve {why}")
    t = fused_mlp_tuning(d, inter, x.dtype.itemsize, **knobs)
    part = _call(pad_rows(x), w_gate_up, w_down, t)[:, :m]
    return jnp.sum(part, axis=0) if reduce else part
