"""weights/: HF and converted checkpoints, random checkpoints, error messages, the CLI."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import weights
from ouro_jax.cli import main
from weights import CheckpointError
from weights.config import get_preset
from weights.hf_names import get_path, hf_name_to_path, iter_paths, param_shapes
from weights.random_init import random_hf_tensors


def bits(x):
    """Raw bits of an array, so comparisons are exact (NaN-safe, -0 vs 0 distinguished)."""
    a = np.asarray(x)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def assert_trees_identical(p1, p2):
    l1, l2 = dict(iter_paths(p1)), dict(iter_paths(p2))
    assert l1.keys() == l2.keys()
    for path in l1:
        assert l1[path].dtype == l2[path].dtype, path
        assert l1[path].shape == l2[path].shape, path
        np.testing.assert_array_equal(bits(l1[path]), bits(l2[path]), err_msg=str(path))


def assert_equals_random(params, config, seed, dtype):
    """params == random_hf_tensors(config, seed) (float32, then cast to ``dtype``), transposed into
    the Flax layout, bit for bit."""
    assert {p: tuple(v.shape) for p, v in iter_paths(params)} == param_shapes(config)
    for name, arr in random_hf_tensors(config, seed=seed, dtype=np.float32):
        path, transpose = hf_name_to_path(name)
        want = (arr.T if transpose else arr).astype(dtype)
        got = get_path(params, path)
        assert isinstance(got, jax.Array), name
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=name)


# ------------------------------------------------------------------------- happy paths
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_hf_single_file_roundtrip(tmp_path, preset):
    cfg = get_preset(preset)
    weights.save_random(tmp_path / "hf", cfg, seed=3)
    # with the preset tokenizer and chat template where the vocabulary holds one (tiny-gqa's 96 does not)
    tok = ["tokenizer.json", "tokenizer_config.json"] if preset == "tiny" else []
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(["config.json", "model.safetensors", *tok])
    # The file is standard safetensors (readable by the reference library).
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == set(weights.hf.hf_tensor_shapes(cfg))
    config, params = weights.load_checkpoint(tmp_path / "hf")
    assert config == cfg
    assert_equals_random(params, cfg, 3, np.float32)


@pytest.mark.parametrize(
    "preset,dtype,np_dtype", [("tiny-gqa", "bfloat16", ml_dtypes.bfloat16), ("tiny", "float32", np.float32)]
)
def test_hf_sharded_roundtrip(tmp_path, preset, dtype, np_dtype):
    cfg = get_preset(preset)
    weights.save_random(tmp_path / "hf", cfg, seed=5, dtype=dtype, max_shard_bytes=30_000)
    files = os.listdir(tmp_path / "hf")
    shards = sorted(f for f in files if f.startswith("model-"))
    assert len(shards) > 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == set(shards)
    config, params = weights.load_checkpoint(tmp_path / "hf")
    assert config == cfg.replace(torch_dtype=dtype)
    assert_equals_random(params, cfg, 5, np_dtype)


def test_load_casts(tmp_path):
    cfg = get_preset("tiny")
    weights.save_random(tmp_path / "hf", cfg, seed=0)
    _, params = weights.load_checkpoint(tmp_path / "hf", dtype=jnp.bfloat16)
    assert_equals_random(params, cfg, 0, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="unsupported dtype"):
        weights.load_checkpoint(tmp_path / "hf", dtype=jnp.int32)


@pytest.mark.parametrize(
    "preset,src_dtype,conv_dtype",
    [("tiny", "float32", None), ("tiny-gqa", "bfloat16", None), ("tiny-gqa", "float32", "bfloat16")],
)
def test_convert_matches_hf_load(tmp_path, preset, src_dtype, conv_dtype):
    cfg = get_preset(preset)
    weights.save_random(tmp_path / "hf", cfg, seed=7, dtype=src_dtype, max_shard_bytes=40_000)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    dst = weights.convert(tmp_path / "hf", tmp_path / "conv", dtype=conv_dtype, progress=False)
    assert os.path.isabs(dst)
    marker = json.load(open(tmp_path / "conv" / "ouro_jax_checkpoint.json"))
    assert marker["format_version"] == 1 and marker["dtype"] == (conv_dtype or src_dtype)
    assert (tmp_path / "conv" / "tokenizer.json").exists()
    assert weights.detect_format(tmp_path / "conv") == "orbax"
    assert weights.detect_format(tmp_path / "hf") == "hf"

    hf_cfg, hf_params = weights.load_checkpoint(tmp_path / "hf", dtype=conv_dtype)
    cv_cfg, cv_params = weights.load_checkpoint(tmp_path / "conv")
    assert cv_cfg == hf_cfg.replace(torch_dtype=conv_dtype or src_dtype)
    assert_trees_identical(hf_params, cv_params)
    # Casting at load time from the converted folder agrees with casting from the HF folder.
    _, hf32 = weights.load_checkpoint(tmp_path / "hf", dtype="float32")
    _, cv32 = weights.load_checkpoint(tmp_path / "conv", dtype="float32")
    if conv_dtype is None:
        assert_trees_identical(hf32, cv32)


def test_random_orbax_layout_equals_hf_layout(tmp_path):
    cfg = get_preset("tiny-gqa")
    weights.save_random(tmp_path / "hf", cfg, seed=11, dtype="bfloat16")
    weights.save_random(tmp_path / "ob", cfg, seed=11, dtype="bfloat16", layout="orbax")
    assert weights.detect_format(tmp_path / "ob") == "orbax"
    c1, p1 = weights.load_checkpoint(tmp_path / "hf")
    c2, p2 = weights.load_checkpoint(tmp_path / "ob")
    assert c1 == c2
    assert_trees_identical(p1, p2)


def test_convert_refuses_nonempty_dst(tmp_path):
    weights.save_random(tmp_path / "hf", "tiny", seed=0)
    (tmp_path / "conv").mkdir()
    (tmp_path / "conv" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        weights.convert(tmp_path / "hf", tmp_path / "conv", progress=False)
    weights.convert(tmp_path / "hf", tmp_path / "conv", progress=False, overwrite=True)
    # Converting again over a converted folder replaces it; unrelated files survive.
    weights.convert(tmp_path / "hf", tmp_path / "conv", dtype="bfloat16", progress=False, overwrite=True)
    assert (tmp_path / "conv" / "keep.txt").exists()
    _, params = weights.load_checkpoint(tmp_path / "conv")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


# ------------------------------------------------------------------------ bad checkpoints
@pytest.fixture(scope="module")
def good_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    weights.save_random(root / "single", "tiny", seed=0)
    weights.save_random(root / "sharded", "tiny", seed=0, max_shard_bytes=30_000)
    return root


def _copy(good_hf, tmp_path, which="single"):
    dst = tmp_path / which
    shutil.copytree(good_hf / which, dst)
    return dst


def _rewrite(folder, fn):
    p = folder / "model.safetensors"
    tensors = load_file(p)
    fn(tensors)
    save_file(tensors, p, metadata={"format": "pt"})


def _edit_config(folder, **kw):
    p = folder / "config.json"
    d = json.load(open(p))
    d.update(kw)
    json.dump(d, open(p, "w"))


def test_missing_tensor(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        weights.load_checkpoint(d)


def test_extra_tensor(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"extra.*model\.layers\.2\.mlp\.up_proj\.weight.*num_hidden_layers=2"):
        weights.load_checkpoint(d)


def test_shape_mismatch_names_config_field(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    _edit_config(d, num_key_value_heads=2)  # the checkpoint holds 4 KV heads
    with pytest.raises(CheckpointError) as e:
        weights.load_checkpoint(d)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "model.safetensors" in msg
    assert "num_key_value_heads*head_dim = 2*16 = 32" in msg and "other tensor" in msg

    d2 = _copy(good_hf, tmp_path / "b")
    _rewrite(d2, lambda t: t.update({"lm_head.weight": np.zeros((100, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*vocab_size = 128"):
        weights.load_checkpoint(d2)


def test_unsupported_dtype(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    _rewrite(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*unsupported dtype F64"):
        weights.load_checkpoint(d)


def test_index_names_missing_shard(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path, "sharded")
    index = json.load(open(d / "model.safetensors.index.json"))
    shard = index["weight_map"]["lm_head.weight"]
    os.remove(d / shard)
    with pytest.raises(CheckpointError, match=rf"lm_head\.weight in shard {shard}, which does not exist"):
        weights.load_checkpoint(d)


def test_index_tensor_missing_from_shard(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path, "sharded")
    p = d / "model.safetensors.index.json"
    index = json.load(open(p))
    wm = index["weight_map"]
    other = next(s for s in sorted(set(wm.values())) if s != wm["model.norm.weight"])
    wm["model.norm.weight"] = other
    json.dump(index, open(p, "w"))
    with pytest.raises(CheckpointError, match=rf"model\.norm\.weight.*{other}.*does not contain"):
        weights.load_checkpoint(d)


def test_no_config(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    os.remove(d / "config.json")
    with pytest.raises(CheckpointError, match="no config.json"):
        weights.load_checkpoint(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        weights.load_checkpoint(tmp_path / "nowhere")


def test_invalid_config(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    _edit_config(d, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"config\.json.*hidden_act"):
        weights.load_checkpoint(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json"):
        weights.load_checkpoint(d)


def test_corrupt_safetensors(good_hf, tmp_path):
    d = _copy(good_hf, tmp_path)
    p = d / "model.safetensors"
    raw = p.read_bytes()
    p.write_bytes(raw[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"corrupt safetensors file .*model\.safetensors"):
        weights.load_checkpoint(d)
    p.write_bytes(b"\xff" * 64)  # header length nonsense
    with pytest.raises(CheckpointError, match=r"corrupt safetensors file .*model\.safetensors"):
        weights.load_checkpoint(d)


def test_converted_checkpoint_checked_against_config(good_hf, tmp_path):
    weights.convert(good_hf / "single", tmp_path / "conv", progress=False)
    _edit_config(tmp_path / "conv", num_hidden_layers=3)
    with pytest.raises(
        CheckpointError, match=r"missing.*model\.layers\.2\.self_attn\.q_proj\.weight.*num_hidden_layers=3"
    ):
        weights.load_checkpoint(tmp_path / "conv")
    _edit_config(tmp_path / "conv", num_hidden_layers=2)
    os.remove(tmp_path / "conv" / "params" / "_METADATA")
    with pytest.raises(CheckpointError, match=r"corrupt orbax checkpoint .*params"):
        weights.load_checkpoint(tmp_path / "conv")


# ------------------------------------------------------------------------------------ CLI
def test_cli_random_checkpoint_and_convert(tmp_path, capsys):
    src, dst = str(tmp_path / "hf"), str(tmp_path / "conv")
    assert main(["random-checkpoint", src, "--preset", "tiny-gqa", "--seed", "2", "--max-shard-bytes", "50000"]) == 0
    assert main(["convert", src, dst, "--dtype", "bfloat16", "--no-progress"]) == 0
    assert "converted" in capsys.readouterr().out
    config, params = weights.load_checkpoint(dst)
    assert config.torch_dtype == "bfloat16"
    assert_equals_random(params, get_preset("tiny-gqa"), 2, ml_dtypes.bfloat16)
    # Errors are reported, not raised.
    assert main(["convert", src, dst]) == 1
    assert "not empty" in capsys.readouterr().err
    assert main(["convert", src, dst, "--overwrite", "--no-progress"]) == 0
    with pytest.raises(SystemExit):
        main(["random-checkpoint", str(tmp_path / "x"), "--preset", "no-such-preset"])
