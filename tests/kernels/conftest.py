"""Shared by the kernel tests: ragged paged batches (``make_batch``, padded to fixed shapes by
``pad_batch``), a float64 numpy dense-softmax
oracle, a runner that pads and calls a kernel (``run``), the tolerance rule, and the Mosaic GPU
interpreter with a stand-in for wgmma (``mosaic_interpret``; ``mosaic_attention_interpret`` for
the attention kernel, whose accumulators live in registers), the mark that skips a test off a
Hopper GPU (``skip_no_hopper``), and the tiny engine run with and without a fused layer kernel
(``engine_with_and_without``)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch

ON_HOPPER = dispatch.hopper_available()
skip_no_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper (sm90+) GPU")


def make_batch(
    rng,
    *,
    num_heads,
    kv_heads,
    head_dim,
    block_size,
    seg_specs,
    extra_rows,
    num_layers=None,
    dtype=np.float32,
    gap_prob=0.3,
    share_prob=0.2,
    tail_poison=np.nan,
):
    """seg_specs: list of (q_len, ctx_len); q_len 0 = padding segment. Returns a dict of arrays.

    Unread pages are NaN; the unread tail of a partially read page is ``tail_poison`` (NaN by
    default; the Mosaic GPU kernel's contract needs it finite, see its module docstring)."""
    s = len(seg_specs)
    max_ctx = max([c for _, c in seg_specs] + [1])
    mb = max(1, math.ceil(max_ctx / block_size)) + int(rng.integers(0, 2))  # sometimes a spare col
    # rows: segments in a random order, random gaps of padding rows between them
    order = rng.permutation(s)
    q_start = np.zeros(s, np.int32)
    row = 0
    for idx in order:
        if rng.random() < gap_prob:
            row += int(rng.integers(1, 3))
        q_start[idx] = row
        row += seg_specs[idx][0]
    num_rows = row + extra_rows
    num_rows = max(num_rows, 1)
    # pages: every real segment gets its own pages (a plane's block table); some share a table
    pages_needed = sum(math.ceil(c / block_size) for q, c in seg_specs if q > 0)
    num_blocks = pages_needed + 2 + int(rng.integers(0, 3))
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((s, mb), np.int32)  # tails point at the (NaN) trash page 0
    prev = None
    for i, (q, c) in enumerate(seg_specs):
        n = math.ceil(c / block_size)
        if q == 0:  # padding segment: junk start/ctx/table (must never be read)
            q_start[i] = int(rng.integers(0, num_rows + 3))
            tables[i] = rng.integers(0, num_blocks, size=mb)
            continue
        if prev is not None and rng.random() < share_prob and prev[1] >= n:
            tables[i] = prev[0]  # same request's plane read twice (e.g. two chunks at one depth)
        else:
            tables[i, :n] = [free.pop() for _ in range(n)]
            prev = (tables[i].copy(), n)
    q_len = np.array([q for q, _ in seg_specs], np.int32)
    ctx_len = np.array([c if q > 0 else int(rng.integers(0, 50)) for q, c in seg_specs], np.int32)

    shape = (kv_heads, num_blocks, block_size, head_dim)
    if num_layers is not None:
        shape = (num_layers,) + shape
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    layer = None if num_layers is None else int(rng.integers(0, num_layers))
    # poison every slot no segment may read: whole unread pages (trash page 0 included) and the
    # tail of partially read pages
    fill = np.zeros(num_blocks, np.int64)
    for i, (ql, c) in enumerate(seg_specs):
        if ql > 0:
            for p in range(math.ceil(c / block_size)):
                fill[tables[i, p]] = max(fill[tables[i, p]], min(block_size, c - p * block_size))
    for page in range(num_blocks):
        poison = np.nan if fill[page] == 0 else tail_poison
        k[..., page, fill[page] :, :] = poison
        v[..., page, fill[page] :, :] = poison
    q = rng.standard_normal((num_rows, num_heads, head_dim)).astype(np.float32)
    covered = np.zeros(num_rows, bool)
    for i, (ql, _) in enumerate(seg_specs):
        if ql > 0:
            covered[q_start[i] : q_start[i] + ql] = True
    q[~covered] = np.nan
    cast = lambda x: np.asarray(jnp.asarray(x, dtype))  # noqa: E731
    return dict(
        q=cast(q),
        k=cast(k),
        v=cast(v),
        q_start=q_start,
        q_len=q_len,
        ctx_len=ctx_len,
        tables=tables,
        layer=layer,
        covered=covered,
    )


def pad_batch(b, rows: int, table_cols: int, pages: int):
    """``b`` with rows, block-table columns and pool pages padded to fixed sizes (NaN rows and
    pages no segment reads), so that examples share one compilation."""
    r0, mb0, nb0 = b["q"].shape[0], b["tables"].shape[1], b["k"].shape[-3]
    assert r0 <= rows and mb0 <= table_cols and nb0 <= pages, (r0, mb0, nb0)
    b = dict(b)
    b["q"] = np.concatenate([b["q"], np.full((rows - r0,) + b["q"].shape[1:], np.nan, b["q"].dtype)])
    b["covered"] = np.concatenate([b["covered"], np.zeros(rows - r0, bool)])
    b["tables"] = np.pad(b["tables"], ((0, 0), (0, table_cols - mb0)))
    widths = [(0, 0)] * b["k"].ndim
    widths[-3] = (0, pages - nb0)
    b["k"] = np.pad(b["k"], widths, constant_values=np.nan)
    b["v"] = np.pad(b["v"], widths, constant_values=np.nan)
    return b


def oracle(b, sm_scale):
    """float64 dense softmax, segment by segment, row by row."""
    q = np.asarray(b["q"], np.float64)
    k = np.asarray(b["k"], np.float64)
    v = np.asarray(b["v"], np.float64)
    if b["layer"] is not None:
        k, v = k[b["layer"]], v[b["layer"]]
    num_rows, num_heads, _ = q.shape
    kvh, _, bs, _ = k.shape
    g = num_heads // kvh
    out = np.zeros_like(q)
    for s in range(len(b["q_len"])):
        ql, cl = int(b["q_len"][s]), int(b["ctx_len"][s])
        if ql == 0:
            continue
        toks = np.arange(cl)
        pages, offs = b["tables"][s][toks // bs], toks % bs
        kd, vd = k[:, pages, offs], v[:, pages, offs]  # [KVH, cl, hd]
        for i in range(ql):
            r, p = int(b["q_start"][s]) + i, cl - ql + i
            for h in range(num_heads):
                sc = kd[h // g, : p + 1] @ q[r, h] * sm_scale
                w = np.exp(sc - sc.max())
                out[r, h] = (w / w.sum()) @ vd[h // g, : p + 1]
    return out


def run(fn, b, sm_scale, **kw):
    layer = None if b["layer"] is None else jnp.int32(b["layer"])
    return np.asarray(
        fn(
            jnp.asarray(b["q"]),
            jnp.asarray(b["k"]),
            jnp.asarray(b["v"]),
            jnp.asarray(b["q_start"]),
            jnp.asarray(b["q_len"]),
            jnp.asarray(b["ctx_len"]),
            jnp.asarray(b["tables"]),
            layer=layer,
            sm_scale=sm_scale,
            **kw,
        ),
        np.float32,
    )


def tol(dtype):
    return 2e-5 if dtype == np.float32 else 3e-2


def assert_close(got, want, b, dtype, what):
    assert not np.isnan(got).any(), f"{what}: NaN in output"
    np.testing.assert_array_equal(got[~b["covered"]], 0.0, err_msg=f"{what}: padding rows")
    err = np.abs(got - want).max()
    scale = max(1.0, np.abs(want).max())
    assert err <= tol(dtype) * scale, f"{what}: max abs err {err}"


def pool_copies(hlo_text, shape):
    """The lines of compiled HLO text that copy an array of ``shape`` (a donated pool copied)."""
    dims = ",".join(map(str, shape))
    return [
        ln for ln in hlo_text.splitlines() if " copy(" in ln and f"[{dims}]" in ln.split("=", 1)[-1].split("copy(")[0]
    ]


def first_by_default(cases):
    """Parametrize cases: the first in the default suite, the rest in the slow one (CPU time)."""
    return [cases[0], *(pytest.param(*c, marks=pytest.mark.slow) for c in cases[1:])]


@pytest.fixture
def mosaic_interpret(monkeypatch):
    """Mosaic GPU kernels run on the CPU in Pallas' GPU interpreter (TMA copies, barriers, rings,
    out-of-bounds fills and stores), with wgmma, which it does not model, replaced by an f32
    product accumulated in a shared-memory ref (zeroed, as a wgmma accumulator starts). What this
    cannot check is wgmma itself and the hardware's layouts: the GPU tests do. Call
    ``mosaic_interpret(jitted_fn)``: the function unjitted, so that no trace of the real kernel is
    reused. (The interpreter's race detector stays off: it flags the TMA refill of a
    ring slot after the wgmma that read it, a pattern the skinny GEMM of c47db58 ran correctly on
    the H200.)"""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def wgmma(acc, a, b):
        acc[...] += jnp.dot(a[...].astype(jnp.float32), b[...].astype(jnp.float32), precision="highest")

    params = plgpu.InterpretGPUParams(uninitialized_memory="zero")
    monkeypatch.setattr(plgpu, "wgmma", wgmma)
    monkeypatch.setattr(plgpu, "wgmma_wait", lambda n: None)
    monkeypatch.setattr(plgpu, "ACC", lambda shape, dtype=jnp.float32: plgpu.SMEM(shape, dtype))
    monkeypatch.setattr(plgpu, "kernel", functools.partial(plgpu.kernel, interpret=params))

    return lambda fn: fn.__wrapped__


class _RegisterAcc:
    """Stand-in for a wgmma register accumulator (``plgpu.ACC``) in the interpreter: an f32 value
    held in Python, for scopes without control flow around its updates (``pl.run_scoped`` of a
    Q.K^T, ``pl.run_state`` of a P.V)."""

    def __init__(self, shape=None, dtype=jnp.float32, value=None):
        self.value = jnp.zeros(shape, dtype) if value is None else value

    def __getitem__(self, idx):
        return self.value

    @staticmethod
    def init(value):
        return _RegisterAcc(value=value)


def _interpret_attention(monkeypatch, module):
    """``module``'s ``pl`` and ``plgpu`` replaced for Pallas' GPU interpreter (CPU): TMA loads and
    stores, barriers, rings, warp specialisation and in-place stores run as written; wgmma (A from
    shared memory or registers) is an f32 product into a register-accumulator stand-in."""
    import types

    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def wgmma(acc, a, b):
        a = a if isinstance(a, jax.Array) else a[...]
        acc.value = acc.value + jnp.dot(a.astype(jnp.float32), b[...].astype(jnp.float32), precision="highest")

    def run_scoped(f, *args, **kw):
        if args and all(isinstance(x, _RegisterAcc) for x in args):
            return f(*args)
        return pl.run_scoped(f, *args, **kw)

    def run_state(f):
        def run(acc):
            f(acc)
            return acc.value

        return run

    fake_pl = types.SimpleNamespace(**{k: getattr(pl, k) for k in dir(pl) if not k.startswith("__")})
    fake_pl.run_scoped, fake_pl.run_state = run_scoped, run_state
    fake_gpu = types.SimpleNamespace(**{k: getattr(plgpu, k) for k in dir(plgpu) if not k.startswith("__")})
    fake_gpu.wgmma, fake_gpu.ACC = wgmma, _RegisterAcc
    params = plgpu.InterpretGPUParams(uninitialized_memory="zero")
    fake_gpu.kernel = functools.partial(plgpu.kernel, interpret=params)
    monkeypatch.setattr(module, "pl", fake_pl)
    monkeypatch.setattr(module, "plgpu", fake_gpu)


@pytest.fixture
def mosaic_attention_interpret(monkeypatch):
    """The Mosaic GPU attention kernel (``ragged_paged_attention_mgpu``) on the CPU in Pallas' GPU
    interpreter (``_interpret_attention``). Not checked: wgmma, layouts and timing on the hardware
    (the GPU tests). Returns the kernel function, unjitted."""
    from pallas_kernels import ragged_paged_attention_mgpu as mgpu

    _interpret_attention(monkeypatch, mgpu)
    return mgpu.ragged_paged_attention_mgpu.__wrapped__


@pytest.fixture
def mosaic_decode_interpret(monkeypatch):
    """The Mosaic GPU decode attention (``decode_attention_mgpu``) on the CPU: its first launch in
    Pallas' GPU interpreter (``_interpret_attention``), the Triton combine in Pallas' interpret
    mode. Returns the kernel function, unjitted."""
    from pallas_kernels import decode_attention_mgpu as dec

    _interpret_attention(monkeypatch, dec)
    return functools.partial(dec.decode_attention_mgpu.__wrapped__, combine_interpret=True)


def engine_with_and_without(monkeypatch, flag: str, spied_module, spied_name: str):
    """The ``tiny-gqa`` engine with its Pallas kernels interpreted (Triton attention, prefill chunks
    across buckets 8 and 32, fused decode steps, the model's exit rule, float32), twice:
    ``step_program.<flag>`` patched to refuse the kernel, then as built. Returns ``(without,
    with, calls)``: each run's ``(token_ids, exit_depths)`` per prompt, and the shape of the first
    argument of every (traced) call of ``spied_module.<spied_name>``."""
    import jax

    from ouro_jax import LLM, SamplingParams, get_preset, step_program
    from ouro_jax import runner as runner_mod
    from weights.random_init import random_params

    real_init = runner_mod.ModelRunner.__init__

    def interpreted(self, *a, **k):
        real_init(self, *a, **{**k, "interpret": True})

    monkeypatch.setattr(runner_mod.ModelRunner, "__init__", interpreted)
    calls = []
    real = getattr(spied_module, spied_name)

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(spied_module, spied_name, spy)
    cfg = get_preset("tiny-gqa")
    params = jax.tree.map(jnp.asarray, random_params(cfg, 0))
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (3, 21, 9)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.5)

    def run():
        llm = LLM(
            cfg,
            params=params,
            attention="triton",
            kv_cache_bytes=1 << 22,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            prefill_chunk_size=8,
            block_size=4,
            max_model_len=64,
            buckets=[8, 32],
            fused_decode_max_rows=4,
            progress=False,
            executable_store=False,
        )
        return [(o.token_ids, o.exit_depths) for o in llm.generate(prompts, sampling, use_tqdm=False)]

    with monkeypatch.context() as m:
        m.setattr(step_program, flag, lambda kernel: False)
        without = run()
    assert not calls, "the patched-off run called the kernel"
    return without, run(), calls
