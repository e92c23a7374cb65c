"""EngineConfig: one home for every option (ouro_jax/engine_config.py), the environment in one
module (ouro_jax/envs.py), flags generated from the fields, and the executable store's key from
the config's hash."""

import ast
import dataclasses
import os
import pathlib

import pytest

from ouro_jax import LLM, envs
from ouro_jax.engine_config import (
    FIELD_NAMES,
    SECTIONS,
    EngineConfig,
    add_arguments,
    from_arguments,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = dict(
    max_num_seqs=4,
    max_num_batched_tokens=8,
    max_model_len=64,
    num_blocks=64,
    buckets=(8,),
    prefill_chunk_size=8,
    warmup=False,
)

# one value each field refuses, and the words its error must hold
BAD = {
    "dtype": ("int8", "dtype must be one of"),
    "seed": (-1, "seed must be a non-negative integer"),
    "block_size": (0, "block_size must be a positive integer"),
    "max_model_len": (0, "max_model_len"),
    "kv_layout": ("planes", "kv_layout must be one of"),
    "num_blocks": (1, "num_blocks"),
    "kv_cache_bytes": (-1, "kv_cache_bytes"),
    "gpu_memory_utilization": (1.5, "gpu_memory_utilization"),
    "kv_allocation": ("lazy", "kv_allocation"),
    "enable_prefix_caching": ("yes", "enable_prefix_caching"),
    "watermark": (1.0, "watermark"),
    "max_num_seqs": (0, "max_num_seqs"),
    "max_num_batched_tokens": (2.5, "max_num_batched_tokens"),
    "prefill_chunk_size": (True, "prefill_chunk_size"),
    "prefill_mode": ("chunked", "prefill_mode"),
    "policy": ("lifo", "policy"),
    "buckets": ([8, 0], "buckets"),
    "fused_decode_max_rows": (-1, "fused_decode_max_rows"),
    "fused_decode_tokens": (0, "fused_decode_tokens"),
    "async_scheduling": (1, "async_scheduling"),
    "target_tpot_ms": (0.0, "target_tpot_ms"),
    "speculative_config": ({"method": "ngram"}, "speculative_config"),
    "compile_cache_dir": (3, "compile_cache_dir"),
    "executable_store": ("on", "executable_store"),
    "compile_threads": (0, "compile_threads"),
    "num_ring_rows": (0, "num_ring_rows"),
    "warmup": (None, "warmup"),
    "progress": ("no", "progress"),
    "fused_xla_options": ("gpu_x=1", "fused_xla_options"),
    "step_xla_options": ("xla_x", "step_xla_options"),
    "attention": ("cudnn", "attention"),
    "tensor_parallel_size": (0, "tensor_parallel_size"),
    "devices": ("gpu:0", "devices"),
    "host": (None, "host"),
    "port": (70000, "port"),
    "served_model_name": (1, "served_model_name"),
    "max_queue": (-1, "max_queue"),
    "data_parallel_size": (0, "data_parallel_size"),
    "replica_mode": ("fork", "replica_mode"),
    "drain_timeout_s": (0, "drain_timeout_s"),
    "max_n": (0, "max_n"),
    "reasoning_parser": ("deepseek", "reasoning_parser"),
}

# another legal value for each field that shapes compiled code
OTHER = {
    "dtype": "float32",
    "block_size": 8,
    "max_model_len": 128,
    "kv_layout": "shared",
    "num_blocks": 99,
    "kv_cache_bytes": 1 << 20,
    "gpu_memory_utilization": 0.5,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "prefill_chunk_size": 32,
    "prefill_mode": "mixed",
    "buckets": (8, 64),
    "fused_decode_max_rows": 4,
    "fused_decode_tokens": 2,
    "num_ring_rows": 1000,
    "fused_xla_options": "xla_gpu_autotune_level=2",
    "step_xla_options": "xla_gpu_enable_triton_gemm=false",
    "attention": "triton",
    "tensor_parallel_size": 2,
}


def test_every_field_is_declared_with_a_section_and_help():
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata["section"] in SECTIONS, f.name
        assert len(f.metadata["help"]) > 10, f.name
    assert {f.metadata["section"] for f in dataclasses.fields(EngineConfig)} == set(SECTIONS)


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_every_field_is_checked_at_construction_naming_it(name):
    assert set(BAD) == set(FIELD_NAMES), "a field was added: give it a bad value here"
    value, words = BAD[name]
    with pytest.raises(ValueError, match=words):
        EngineConfig(**{name: value})


def test_config_is_frozen_and_normalised():
    cfg = EngineConfig(prefill_mode="WAVEFRONT", buckets=[8, 32], dtype="BFLOAT16")
    assert (cfg.prefill_mode, cfg.buckets, cfg.dtype) == ("wavefront", (8, 32), "bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 3
    assert cfg.replace(max_num_seqs=3).max_num_seqs == 3
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        cfg.replace(max_num_seq=3)
    with pytest.raises(ValueError, match="kv_layout='last_exited'"):
        EngineConfig(prefill_mode="wavefront", kv_layout="shared")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_compile_hash_follows_every_field_that_shapes_compiled_code():
    """Each field either changes the hash or is declared compile-free in the config itself."""
    base = EngineConfig(max_num_seqs=8)
    free = set(FIELD_NAMES) - set(EngineConfig.compile_fields())
    assert set(OTHER) | {"devices"} == set(EngineConfig.compile_fields()), "give the new field another value here"
    for name, value in OTHER.items():
        changed = base.replace(**{name: value})
        assert changed.compile_hash() != base.compile_hash(), name
    for name in free:  # compile-free: host-side options, never a different program
        value = BAD[name][0]
        other = {
            "seed": 7,
            "kv_allocation": "reserve",
            "enable_prefix_caching": True,
            "watermark": 0.2,
            "policy": "priority",
            "async_scheduling": False,
            "target_tpot_ms": 5.0,
            "speculative_config": {"draft_loops": 2},
            "compile_cache_dir": "off",
            "executable_store": False,
            "compile_threads": 2,
            "warmup": False,
            "progress": False,
            "host": "0.0.0.0",
            "port": 9000,
            "served_model_name": "m",
            "max_queue": 3,
            "data_parallel_size": 2,
            "replica_mode": "thread",
            "drain_timeout_s": 5.0,
            "reasoning_parser": "think",
            "max_n": 4,
        }.get(name, value)
        assert base.replace(**{name: other}).compile_hash() == base.compile_hash(), name


def test_llm_config_is_the_resolved_frozen_config(tmp_path):
    llm = LLM("tiny", **TINY, compile_cache_dir=str(tmp_path))
    cfg = llm.config
    assert isinstance(cfg, EngineConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 1
    # None defaults made concrete for the model and the device
    assert cfg.max_model_len == 64 and cfg.fused_decode_max_rows == 4
    assert cfg.attention == "reference" and cfg.enable_prefix_caching is False
    assert cfg.num_ring_rows == llm.scheduler_config.num_ring_rows
    assert llm.model_config.num_loops == llm.scheduler_config.num_loops
    # the same config again is the same engine
    again = LLM("tiny", config=cfg)
    assert again.config == cfg
    assert again.runner.store_key(again.executable_keys()[0]) == llm.runner.store_key(llm.executable_keys()[0])
    # overrides on top of a config
    assert LLM("tiny", config=cfg, policy="priority").config.policy == "priority"


def test_llm_refuses_a_misspelt_option_before_any_work(monkeypatch):
    import weights.random_init

    monkeypatch.setattr(weights.random_init, "random_params", lambda *a, **k: pytest.fail("weights were built"))
    with pytest.raises(ValueError, match="'max_num_seq'.*did you mean 'max_num_seqs'"):
        LLM("tiny", max_num_seq=4)
    with pytest.raises(ValueError, match="config must be an EngineConfig"):
        LLM("tiny", config={"max_num_seqs": 4})
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM("tiny", data_parallel_size=2)


def test_store_key_changes_with_a_compile_field_and_not_with_a_compile_free_one(tmp_path):
    base = LLM("tiny", **TINY, compile_cache_dir=str(tmp_path))
    key = base.executable_keys()[0]
    k0 = base.runner.store_key(key)
    other = LLM("tiny", config=base.config.replace(step_xla_options="xla_gpu_autotune_level=2"))
    assert other.runner.store_key(key) != k0
    free = LLM("tiny", config=base.config.replace(policy="priority", target_tpot_ms=9.0, seed=3))
    assert free.runner.store_key(key) == k0


# ------------------------------------------------------------------------------ environment
def test_only_envs_reads_the_environment_for_engine_options():
    """No engine module but ouro_jax/envs.py names an OURO_JAX_ variable or reads os.environ for one."""
    named = []
    for pkg in ("ouro_jax", "pallas_kernels", "scheduler", "weights"):
        for path in (ROOT / pkg).rglob("*.py"):
            if "OURO_JAX_" in path.read_text():
                named.append(str(path.relative_to(ROOT)))
    assert named == ["ouro_jax/envs.py"]


def test_every_variable_the_docs_name_is_declared():
    names = set()
    # the decision record names retired switches on purpose
    docs = [p for p in (ROOT / "docs").glob("*.md") if p.name != "decisions.md"]
    for path in [ROOT / "README.md", *docs, *(ROOT / "benchmarks").glob("*.py")]:
        text = path.read_text()
        names |= {w.strip("`$=\"'(),.:;*") for w in text.split() if "OURO_JAX_" in w}
    names = {n[n.index("OURO_JAX_") :].split("=")[0].split("`")[0] for n in names} - {"OURO_JAX_"}
    assert names <= set(v.name for v in envs.VARIABLES.values()), names - {v.name for v in envs.VARIABLES.values()}


def test_variables_are_the_defaults_of_their_fields(monkeypatch, tmp_path):
    monkeypatch.setenv("OURO_JAX_COMPILE_CACHE", str(tmp_path))
    assert EngineConfig().compile_cache_dir == str(tmp_path)
    monkeypatch.delenv("OURO_JAX_COMPILE_CACHE")
    assert EngineConfig().compile_cache_dir is None
    assert envs.unknown_variables({"OURO_JAX_ROPE_WRITE": "xla", "OURO_JAX_COMPILE_CACHE": "off"}) == [
        "OURO_JAX_ROPE_WRITE"
    ]
    assert "OURO_JAX_DISTRIBUTED" in envs.describe()


def test_an_unknown_variable_is_warned_of(monkeypatch, tmp_path):
    monkeypatch.setenv("OURO_JAX_ROPE_WRITE", "xla")  # a retired switch
    with pytest.warns(UserWarning, match="OURO_JAX_ROPE_WRITE: not an ouro-jax variable"):
        LLM("tiny", **TINY, compile_cache_dir=str(tmp_path))


# ------------------------------------------------------------------------------------ flags
def _parser(sections):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p, sections)
    return p


def test_flags_are_the_fields():
    p = _parser(SECTIONS)
    flags = {a.dest.removeprefix("cfg_") for a in p._actions if a.dest.startswith("cfg_")}
    assert flags == {f.name for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]}
    assert from_arguments(p.parse_args([])) == {}  # no flag: every default is the config's
    args = p.parse_args(
        ["--max-num-seqs", "4", "--buckets", "8,16", "--no-async-scheduling", "--prefill-mode", "Wavefront"]
    )
    got = from_arguments(args)
    assert got == dict(max_num_seqs=4, buckets=(8, 16), async_scheduling=False, prefill_mode="wavefront")
    assert EngineConfig(**got).buckets == (8, 16)
    help_text = p.format_help()
    assert "--max-num-seqs" in help_text and "(default: 32)" in help_text


def test_commands_share_the_engine_flags_and_their_defaults():
    """demo, serve and generate take the same engine flags with the config's defaults; a command
    adds only its own (the demo: room for its batch)."""
    from ouro_jax.cli import build_parser

    parser, _ = build_parser()
    demo = parser.parse_args(["demo"])
    serve = parser.parse_args(["serve", "tiny"])
    gen = parser.parse_args(["generate", "tiny", "1 2 3"])
    assert from_arguments(serve) == {} and from_arguments(gen) == {} and from_arguments(demo) == {}
    engine_flags = lambda ns: {k for k in vars(ns) if k.startswith("cfg_")}  # noqa: E731
    assert engine_flags(demo) == engine_flags(gen)
    assert engine_flags(serve) - engine_flags(gen) == {
        f"cfg_{f.name}" for f in dataclasses.fields(EngineConfig) if f.metadata["section"] == "server"
    }


def test_benchmarks_and_the_server_read_no_environment_option():
    """Benchmarks and the server take options as config fields, never from os.environ directly."""
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "ouro_jax" / "server").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith("OURO_JAX_"), f"{path.name} names {node.value}"
    assert os.environ.get("OURO_JAX_COMPILE_CACHE")  # conftest's: the tests share one cache
