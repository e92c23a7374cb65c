"""Every bad input to the jax side is a clear ``ValueError`` raised before any work: engine options,
model paths and configs, prompts, the static ``generate()``'s inputs, broken checkpoints, tokenizers.
None of these tests compiles a model step."""

from __future__ import annotations

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import LLM, SamplingParams, generate, get_preset
from ouro_jax.engine_config import dtype_option
from weights import CheckpointError, load_checkpoint, save_random
from weights.config import OuroConfig

TINY = get_preset("tiny")
SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8, block_size=4, max_model_len=32)


def small_llm(model="tiny", **kw):
    return LLM(model, **{**SMALL, "warmup": False, "progress": False, **kw})


@pytest.fixture(scope="module")
def llm():
    return small_llm()


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    return save_random(tmp_path_factory.mktemp("hf") / "ck", "tiny", seed=0)


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(max_num_seqs="8"), "max_num_seqs must be a positive integer"),
        (dict(max_model_len=0), "max_model_len must be a positive integer"),
        (dict(max_model_len=10.5), "max_model_len must be a positive integer"),
        (dict(max_model_len=4096), "exceeds the model's max_position_embeddings"),
        (dict(num_blocks=1), "num_blocks must be an integer >= 2"),
        (dict(num_blocks=3), "cannot hold one request"),
        (dict(kv_layout="paged"), "kv_layout must be one of"),
        (dict(prefill_mode="chunked"), "prefill_mode must be one of"),
        (dict(policy="lifo"), "policy must be one of"),
        (dict(attention="cuda"), "attention must be one of"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(dtype=np.int32), "dtype must be one of"),
        (dict(seed="0"), "seed must be a non-negative integer"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
        (dict(kv_cache_bytes=-1), "kv_cache_bytes must be a positive integer"),
        (dict(num_ring_rows=1), "num_ring_rows=1 is too small"),
        (dict(fused_decode_max_rows=3), "fused_decode_max_rows"),
        (dict(fused_decode_tokens=0), "fused_decode_tokens"),
        (dict(buckets=[16, 8]), "buckets"),
    ],
)
def test_every_option_is_checked_before_the_weights_are_built(monkeypatch, kw, match):
    import weights
    import weights.random_init

    def no_weights(*a, **k):
        raise AssertionError("weights were built before the options were checked")

    monkeypatch.setattr(weights.random_init, "random_params", no_weights)
    monkeypatch.setattr(weights, "load_checkpoint", no_weights)
    with pytest.raises(ValueError, match=match):
        small_llm(**kw)


def test_enum_options_accept_any_case():
    llm = small_llm(
        kv_layout="SHARED",
        prefill_mode="Split",
        policy="FCFS",
        attention="Reference",
        dtype="Float32",
    )
    sc = llm.scheduler_config
    assert (sc.kv_layout, sc.prefill_mode, sc.policy) == ("shared", "split", "fcfs")
    assert llm.runner.attention == "reference"
    assert jnp.asarray(llm.params["embed_tokens"]["embedding"]).dtype == jnp.float32
    assert [dtype_option("dtype", d) for d in ("BFLOAT16", jnp.bfloat16, np.float16, None)] == [
        "bfloat16",
        "bfloat16",
        "float16",
        None,
    ]


def test_numpy_integers_count_as_integer_options():
    llm = small_llm(block_size=np.int64(4), num_blocks=np.int32(40), max_num_seqs=np.int16(2), seed=np.uint8(1))
    sc = llm.scheduler_config
    assert (sc.block_size, sc.num_blocks, sc.max_num_seqs) == (4, 40, 2) and type(sc.num_blocks) is int


# ------------------------------------------------------------------------ model paths
def test_missing_model_path_says_so(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(ValueError, match=f"nor an existing path: no checkpoint folder {missing}"):
        small_llm(str(missing))
    with pytest.raises(ValueError, match="'ouro-tiny' is neither a preset"):
        small_llm("ouro-tiny")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        small_llm(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="no config.json"):
        small_llm(str(tmp_path))
    with pytest.raises(ValueError, match="must be a preset"):
        small_llm(3)


def test_config_json_missing_a_size_field_is_refused(tmp_path):
    TINY.to_json(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert OuroConfig.from_json(tmp_path) == TINY
    for field in OuroConfig.REQUIRED_FIELDS:
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in d.items() if k != field}))
        with pytest.raises(ValueError, match=f"config.json has no {field} \\(required\\)"):
            OuroConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**d, "rope_theta": "big"}))
    with pytest.raises(ValueError, match="wrong type"):
        OuroConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        OuroConfig.from_json(tmp_path)


def test_checkpoint_with_a_bad_config_fails_before_its_weights_are_read(hf_tiny, tmp_path, monkeypatch):
    import weights

    folder = tmp_path / "ck"
    folder.mkdir()
    with open(os.path.join(hf_tiny, "config.json")) as f:
        d = json.load(f)
    del d["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(d))
    monkeypatch.setattr(weights, "load_checkpoint", lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        small_llm(str(folder))
    with pytest.raises(ValueError, match="block_size"):
        small_llm(hf_tiny, block_size=0)


# ------------------------------------------------------------------------------ prompts
@pytest.mark.parametrize(
    "prompt, match",
    [
        ([1.0, 2.0], "token ids must be integers, got float 1.0, float 2.0"),
        ([1, 2.5], "token ids must be integers, got float 2.5"),
        (["1", "2"], "token ids must be integers, got str '1'"),
        ([True, False], "token ids must be integers, got bool True"),
        ([3, True], "token ids must be integers, got bool True"),  # numpy would read it as id 1
        ([[1, 2], 3], r"token ids must be integers, got list \[1, 2\]"),
        (np.array([1.0, 2.0], np.float32), "token ids must be integers, got an array of float32"),
        (np.array([True]), "token ids must be integers, got an array of bool"),
        ([-5, 3], r"token ids \[-5\] are outside the vocabulary \[0, 128\)"),
        ([60000], r"token ids \[60000\] are outside the vocabulary"),
        (jnp.asarray([1, 128]), r"token ids \[128\] are outside the vocabulary"),
        (np.zeros((2, 2, 2), np.int32), r"got an array of shape \(2, 2, 2\)"),
        ([2**70], r"must lie in \[0, 128\)"),
        ([], "the prompt is empty"),
    ],
)
def test_bad_prompts_are_refused_before_queueing(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.add_request(prompt)
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2], prompt], use_tqdm=False)
    assert not llm.has_unfinished()


def test_text_prompts_need_a_tokenizer():
    llm = small_llm("tiny-gqa")  # too small a vocabulary for the preset tokenizer (weights/tokenizer.py)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.add_request("hello")
    assert not llm.has_unfinished()


@pytest.mark.parametrize(
    "prompts, sampling_params, error, match",
    [
        (None, None, TypeError, "prompts must be a string or a flat sequence .* got NoneType"),
        (5, None, TypeError, "got int"),
        ({"prompt": [1, 2]}, None, TypeError, "got dict"),
        ([], None, ValueError, "prompts is empty"),
        ([[1, 2], [3, [4]]], None, ValueError, r"prompts\[1\]: token ids must be integers, got list \[4\]"),
        (np.array([[1, 2], [3]], dtype=object), None, ValueError, "got an array of object"),
        ([1, 2], {"max_tokens": 4}, TypeError, r"got dict \(build one with SamplingParams\(\*\*fields\)\)"),
        ([[1], [2]], [SamplingParams(), {"max_tokens": 4}], TypeError, r"sampling_params\[1\] must be a Sampl"),
        ([[1], [2]], [SamplingParams()], ValueError, "1 sampling params for 2 prompts"),
        ([1, 2], SamplingParams(stop_token_ids=[7, 128]), ValueError, r"128 is outside the vocabulary \[0, 128\)"),
        ([1, 2], SamplingParams(exit_mode="fixed", exit_threshold=0.5), ValueError, "read only by exit_mode"),
    ],
)
def test_bad_generate_calls_are_refused_naming_the_problem(llm, prompts, sampling_params, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, sampling_params, use_tqdm=False)
    with pytest.raises(error, match=match):
        llm.stream(prompts, sampling_params)  # refused at the call, before any iteration
    assert not llm.has_unfinished() and not llm.scheduler.num_unfinished


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(priority="high"), ValueError, "priority must be an integer"),
        (dict(priority=True), ValueError, "priority must be an integer"),
        (dict(priority=1), ValueError, "read only by policy='priority'"),
        (dict(request_id=["a"]), TypeError, "request_id must be hashable"),
        (dict(sampling_params={"max_tokens": 2}), TypeError, "must be a SamplingParams"),
    ],
)
def test_bad_add_request_leaves_no_request_behind(llm, kw, error, match):
    with pytest.raises(error, match=match):
        llm.add_request([1, 2, 3], **kw)
    assert not llm.has_unfinished() and not llm.scheduler.num_unfinished and len(llm.scheduler.waiting) == 0
    assert llm.abort(["a"]) is False  # an unhashable id names no request


def test_prompts_as_jax_and_numpy_arrays_and_numpy_sampling_params(llm):
    sp = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(2), seed=np.uint32(1))
    rid = llm.add_request(jnp.asarray([1, 2, 3], jnp.int32), sp)
    rid2 = llm.add_request(np.array([4, 5], np.int64), sp)
    reqs = llm._live
    assert list(reqs[rid].prompt_token_ids) == [1, 2, 3] and list(reqs[rid2].prompt_token_ids) == [4, 5]
    assert reqs[rid].sampling_params == SamplingParams(max_tokens=3, temperature=0.5, top_k=2, seed=1)
    # a 2-D array is a batch of prompts, a 1-D one a single prompt
    add = llm._add_checked
    ids = add(llm._check_all(jnp.asarray([[1, 2], [3, 4]]), sp)) + add(llm._check_all(jnp.asarray([7, 8, 9]), None))
    assert len(ids) == 3
    for r in [rid, rid2, *ids]:
        assert llm.abort(r)
    assert {o.finish_reason for o in llm.step()} == {"abort"}  # aborted outputs come with the next step
    assert not llm.has_unfinished()


# -------------------------------------------------------------------- static generate()
@pytest.mark.parametrize(
    "ids, lengths, match",
    [
        ([[1, -5]], [2], r"token ids \[-5\] are outside the vocabulary \[0, 128\)"),
        ([[60000, 1]], [2], r"token ids \[60000\]"),
        ([[1.5, 2.0]], [2], "prompt_ids must be integers, got dtype float"),
        ([[True, False]], [2], "prompt_ids must be integers, got dtype bool"),
        ([[1, 2]], [2.0], "prompt_lengths must be integers"),
        ([[1, 2]], [3], r"prompt_lengths must lie in \[1, 2\]"),
        ([[1, 2]], [0], r"prompt_lengths must lie in \[1, 2\]"),
        ([1, 2], [2], r"prompt_ids must be \[batch, prompt_len>0\]"),
        ([[1, 2]], [2, 2], r"prompt_lengths must have shape \(1,\)"),
    ],
)
def test_generate_checks_concrete_inputs_on_the_host(ids, lengths, match, monkeypatch):
    import ouro_jax.static_generate as sg

    monkeypatch.setattr(
        sg, "_jitted", lambda options: lambda *a, **k: pytest.fail("traced before the inputs were checked")
    )
    with pytest.raises(ValueError, match=match):
        generate({"w": jnp.zeros(1)}, TINY, np.asarray(ids), np.asarray(lengths), 2)


def test_generate_ignores_ids_in_the_right_padding(monkeypatch):
    import ouro_jax.static_generate as sg

    called = []
    monkeypatch.setattr(sg, "_jitted", lambda options: lambda *a, **k: called.append(a[1]))
    generate({"w": jnp.zeros(1)}, TINY, np.array([[1, 2, -1], [3, 4, 5]]), np.array([2, 3]), 2)
    assert len(called) == 1 and called[0].dtype == jnp.int32


def test_generate_refuses_a_batch_whose_kv_pools_cannot_fit(monkeypatch):
    """The serve1k batch-128 case: Ouro-1.4B, 128 x (1024 + 128) positions, 4 loops = 108 GiB of
    bf16 K/V pools, refused before anything is traced on a 139 GiB device that holds weights and
    an engine's pool; the same call at batch 1 passes the check."""
    import ouro_jax.static_generate as sg

    cfg = get_preset("ouro-1.4b")
    need = sg.kv_pool_bytes(cfg, 128, 1152, jnp.bfloat16)
    assert need == 2 * 24 * 4 * 128 * 1152 * 16 * 128 * 2
    gib = 1 << 30
    monkeypatch.setattr(sg, "device_memory", lambda device=None: (139 * gib, 40 * gib))
    monkeypatch.setattr(
        sg, "_jitted", lambda options: lambda *a, **k: pytest.fail("traced before the pools were checked")
    )
    params = {"w": jnp.zeros(1, jnp.bfloat16)}
    ids = np.ones((128, 1024), np.int32)
    with pytest.raises(ValueError, match=r"KV pools need 108\.0 GiB .* 99\.0 GiB free"):
        generate(params, cfg, ids, np.full(128, 1024), 128)
    called = []
    monkeypatch.setattr(sg, "_jitted", lambda options: lambda *a, **k: called.append(1))
    generate(params, cfg, ids[:1], np.full(1, 1024), 128)
    assert called == [1]
    monkeypatch.setattr(sg, "device_memory", lambda device=None: None)
    sg.check_cache_fits(cfg, 128, 1152, jnp.bfloat16)  # no memory stats (the CPU): no check


# ------------------------------------------------------------------------- checkpoints
def test_broken_orbax_checkpoint_is_one_line(tmp_path, caplog, capfd):
    folder = save_random(tmp_path / "orbax", "tiny", layout="orbax")
    data = os.path.join(folder, "params", "ocdbt.process_0", "d")
    biggest = max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)
    with open(biggest, "rb") as f:
        blob = f.read()
    with open(biggest, "wb") as f:
        f.write(blob[: len(blob) // 2])
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG), pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    msg = str(e.value)
    assert msg.startswith(f"cannot restore orbax checkpoint {folder}/params: array ") and "\n" not in msg
    assert len(msg) < 400 and "TensorStore" not in msg
    out, err = capfd.readouterr()
    assert "asyncio" not in out + err and not [r for r in caplog.records if r.name in ("asyncio", "absl")]
    assert not logging.getLogger("asyncio").disabled  # the loggers are back on afterwards


def _tokenizer(path, n):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w1")).save(str(path))


def test_tokenizer_larger_than_the_vocabulary_warns(hf_tiny, tmp_path, recwarn):
    import shutil

    folder = shutil.copytree(hf_tiny, tmp_path / "ck")
    _tokenizer(folder / "tokenizer.json", TINY.vocab_size)
    small_llm(str(folder))
    assert not [w for w in recwarn if "tokenizer" in str(w.message)]
    _tokenizer(folder / "tokenizer.json", TINY.vocab_size + 10)
    with pytest.warns(UserWarning, match=r"has 138 tokens but the model's vocab_size is 128"):
        small_llm(str(folder))
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot read the tokenizer"):
        small_llm(str(folder))


def test_tokenizers_is_a_main_dependency():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("tokenizers") for d in deps)


def test_default_row_budget_follows_the_backend():
    """No ``max_num_batched_tokens``: 2048 rows on a GPU (the measured pick), 256 on a CPU, and never
    fewer than ``max_num_seqs`` (which the scheduler would refuse)."""
    from ouro_jax.llm import default_max_num_batched_tokens

    assert default_max_num_batched_tokens("gpu", 32) == 2048
    assert default_max_num_batched_tokens("cpu", 32) == 256
    assert default_max_num_batched_tokens("cpu", 512) == 512
    assert default_max_num_batched_tokens("gpu", 4096) == 4096
    llm = LLM("tiny", max_num_seqs=300, max_model_len=64, warmup=False, progress=False)
    assert llm.scheduler.config.max_num_batched_tokens == 300
    # the default row budget does not skip the other checks (it once shadowed this one)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM("tiny", max_model_len=10**6, warmup=False, progress=False)


def test_default_fused_rows_follow_the_backend():
    """No ``fused_decode_max_rows``: every bucket up to 128 rows on a GPU (measured), the 8-row
    bucket elsewhere, never more than ``max_num_seqs``; the CPU engine gets the CPU default."""
    from ouro_jax.llm import default_fused_decode_max_rows

    assert default_fused_decode_max_rows("gpu", 256) == 128
    assert default_fused_decode_max_rows("gpu", 32) == 32
    assert default_fused_decode_max_rows("cpu", 32) == 8
    assert default_fused_decode_max_rows("cpu", 4) == 4
    llm = LLM("tiny", max_num_seqs=16, max_model_len=64, warmup=False, progress=False)
    assert llm.scheduler.config.fused_decode_max_rows == 8
