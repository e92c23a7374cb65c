"""The executable store (``ouro_jax/executable_store.py``): a second start loads every executable
(and every random-weight drawer) from it without tracing, a corrupt entry falls back to compiling,
and the key changes with anything that changes the program."""

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.executable_store import MAGIC, ExecutableStore

CFG = get_preset("tiny")
PROMPTS = [[3, 5, 7], [11, 2, 9, 4, 8]]


def _kw(cache_dir, **kw):
    args = dict(
        max_num_seqs=2,
        max_num_batched_tokens=8,
        prefill_chunk_size=8,
        block_size=4,
        max_model_len=32,
        buckets=[8],
        compile_cache_dir=str(cache_dir),
        progress=False,
    )
    return args | kw


def _llm(cache_dir, config=CFG, **kw):
    return LLM(config, **_kw(cache_dir, **kw))


def _run(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    return [(o.token_ids, o.exit_depths) for o in outs]


class _Traces:
    """Counts JAX's tracing spans (``/jax/core/compile/jaxpr_trace_duration``) while active."""

    def __init__(self):
        self.n, self.on = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._seen)

    def _seen(self, name, secs, **kw):
        if self.on and name.endswith("jaxpr_trace_duration"):
            self.n += 1


TRACES = _Traces()


@pytest.fixture
def no_jax_cache():
    """JAX's persistent cache off for the test: the store saves only what XLA compiled (an
    executable JAX's cache answered is not saved again), so a first start must really compile.
    JAX's in-memory caches are cleared too: an executable an earlier test loaded from the
    persistent cache would otherwise come back from memory, uncounted, and a CPU executable
    serialized a second time fails at run time (executable_store's module docstring)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    prev = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    jax.clear_caches()
    yield
    jax.config.update("jax_enable_compilation_cache", prev)
    cc.reset_cache()


def _entries(cache_dir):
    d = os.path.join(cache_dir, "ouro_executables")
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".exe"))


def test_second_start_loads_everything_from_the_store(tmp_path, no_jax_cache):
    first = _llm(tmp_path)
    n = len(first.executable_keys())
    assert first.runner.store_loads == 0 and first.runner.compilations == n
    store = first.executable_store
    assert store.hits == 0 and store.saved == store.misses > n  # every step and every drawer compiled, saved
    want = _run(first)
    assert len(_entries(tmp_path)) == store.saved

    TRACES.on, TRACES.n = True, 0
    try:
        second = _llm(tmp_path)
    finally:
        TRACES.on = False
    r = second.runner
    assert r.compilations == r.store_loads == n  # every executable from the store, none compiled
    assert second.executable_store.misses == 0 and second.executable_store.hits == store.saved  # drawers too
    assert TRACES.n == 0  # nothing traced: no step, no drawer
    assert second.stats()["store_loads"] == n
    assert _run(second) == want
    assert r.compilations == n  # and the run compiled nothing
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), first.params, second.params))


@pytest.mark.parametrize(
    "damage", ["flip", *(pytest.param(d, marks=pytest.mark.slow) for d in ("truncate", "garbage"))]
)
def test_a_corrupt_entry_falls_back_to_compiling(tmp_path, damage, no_jax_cache):
    want = _run(_llm(tmp_path))
    entries = _entries(tmp_path)
    victim = max(entries, key=os.path.getsize)  # a step executable (the drawers are small)
    blob = open(victim, "rb").read()
    bad = {
        "flip": blob[:-100] + bytes(b ^ 0xFF for b in blob[-100:]),
        "truncate": blob[: len(blob) // 2],
        "garbage": b"not an executable",
    }[damage]
    open(victim, "wb").write(bad)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = _llm(tmp_path)
    msgs = [str(w.message) for w in caught if "executable store" in str(w.message)]
    assert len(msgs) == 1 and "compiling instead" in msgs[0]
    n = len(llm.executable_keys())
    assert llm.runner.compilations == n and llm.runner.store_loads == n - 1
    assert llm.executable_store.failures == 1
    assert _run(llm) == want
    # the compile that followed wrote a good entry: the next start loads everything again
    assert llm.executable_store.saved == 1 and open(victim, "rb").read()[: len(MAGIC)] == MAGIC
    again = _llm(tmp_path)
    assert again.runner.store_loads == n and again.executable_store.failures == 0


def test_store_key_changes_with_the_program(tmp_path):
    base = _llm(tmp_path, warmup=False)
    key = base.executable_keys()[0]
    k0 = base.runner.store_key(key)
    assert _llm(tmp_path, warmup=False).runner.store_key(key) == k0  # same engine, same key
    other_cfg = _llm(tmp_path, dataclasses.replace(CFG, rope_theta=CFG.rope_theta * 2), warmup=False)
    assert other_cfg.runner.store_key(key) != k0
    assert _llm(tmp_path, warmup=False, dtype="bfloat16").runner.store_key(key) != k0
    assert base.runner.store_key(base.executable_keys()[1]) != k0  # another executable (the fused step)


def test_store_key_covers_the_environment(tmp_path, monkeypatch):
    k0 = ExecutableStore(tmp_path).key("program", 1)
    assert ExecutableStore(tmp_path).key("program", 1) == k0
    assert ExecutableStore(tmp_path).key("program", 2) != k0
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/nonexistent")
    assert ExecutableStore(tmp_path).key("program", 1) != k0
    monkeypatch.undo()
    with jax.default_matmul_precision("bfloat16"):
        assert ExecutableStore(tmp_path).key("program", 1) != k0


def test_store_roundtrip_and_options(tmp_path):
    f = jax.jit(lambda x, y: (x * 2, y + 1), donate_argnums=(1,))
    x = jnp.arange(4.0)
    exe = f.lower(x, x).compile()
    store = ExecutableStore(tmp_path / "s")
    assert store.load("k", jax.devices()[:1]) is None and store.misses == 1
    assert store.save("k", exe)
    got = store.load("k", jax.devices()[:1])
    assert got is not None and store.hits == 1
    a, b = got(x, jnp.arange(4.0))
    assert jnp.array_equal(a, x * 2) and jnp.array_equal(b, x + 1)
    # an executable JAX's persistent cache answered is not saved (the CPU's fails after a second round trip)
    assert not store.save("k2", exe, from_jax_cache=True) and store.not_saved == 1

    def answered_by_jax_cache():
        jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return exe

    got, loaded = store.load_or_compile("k3", jax.devices()[:1], answered_by_jax_cache)
    assert got is exe and not loaded and store.not_saved == 2 and not (tmp_path / "s" / "k3.exe").exists()

    # no request to JAX's cache at all: JAX's in-memory cache may have handed back an executable an
    # earlier compile deserialized from disk (a full test run saved one, which then failed at run
    # time with "Function ... not found"), so the CPU does not save it either
    got, loaded = store.load_or_compile("k4", jax.devices()[:1], lambda: exe)
    assert not loaded and store.not_saved == 3 and not (tmp_path / "s" / "k4.exe").exists()

    def missed_jax_cache():  # a request that missed: XLA really compiled it
        jax.monitoring.record_event("/jax/compilation_cache/compile_requests_use_cache")
        return exe

    got, loaded = store.load_or_compile("k5", jax.devices()[:1], missed_jax_cache)
    assert not loaded and (tmp_path / "s" / "k5.exe").exists()
    # a store that cannot be written warns and carries on
    (tmp_path / "file").write_text("")
    bad = ExecutableStore(tmp_path / "file" / "sub")
    with pytest.warns(RuntimeWarning, match="cannot save"):
        assert not bad.save("k", exe)
    for bad_value in ("yes", 1, None):
        with pytest.raises(ValueError, match="executable_store"):
            _llm(tmp_path, executable_store=bad_value)
    for bad_value in (0, -1, 1.5, "4"):
        with pytest.raises(ValueError, match="compile_threads"):
            _llm(tmp_path, compile_threads=bad_value)
    off = _llm(tmp_path / "off", executable_store=False, warmup=False)
    assert off.executable_store is None and off.runner.store is None
    assert not os.path.exists(tmp_path / "off" / "ouro_executables")


@pytest.mark.slow
def test_startup_bench_times_every_executable_including_fused_steps(tmp_path):
    """``benchmarks.startup --compare-parallel`` times each executable on a synthetic input built for
    its own packed layout (a fused step's includes the exit words): a layout change breaks it here,
    not on the GPU."""
    from benchmarks.startup import time_executables

    llm = _llm(tmp_path, fused_decode_max_rows=2, executable_store=False)
    keys = llm.executable_keys()
    assert any(isinstance(k, tuple) and not hasattr(k, "R") for k in keys)  # a fused (key, n) step
    out = time_executables(llm, keys, reps=1, context=12)
    assert set(out) == {str(k) for k in keys} and all(0 < t < 60 for t in out.values())
