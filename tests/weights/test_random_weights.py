"""One source of random weights: ``LLM(preset, seed=)`` holds exactly what ``ouro-jax random-checkpoint
--seed`` writes; the command shows progress and ``demo`` names the weights it ran."""

import numpy as np
import pytest

import weights
from ouro_jax import LLM
from ouro_jax.cli import _demo_weights, main
from weights.hf_names import iter_paths


def _leaves(tree) -> dict:
    return {p: np.asarray(x) for p, x in iter_paths(tree)}


def _engine_params(preset, seed, dtype):
    llm = LLM(preset, seed=seed, dtype=dtype, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, warmup=False)
    return _leaves(llm.params)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_llm_seed_equals_random_checkpoint_seed(tmp_path, capsys, dtype):
    dst = str(tmp_path / "ckpt")
    assert main(["random-checkpoint", dst, "--preset", "tiny-gqa", "--seed", "7", "--dtype", dtype]) == 0
    assert "random + write" in capsys.readouterr().err  # the tqdm bar
    _, loaded = weights.load_checkpoint(dst)
    disk = _leaves(loaded)
    engine = _engine_params("tiny-gqa", 7, dtype)
    assert disk.keys() == engine.keys()
    for path in disk:
        assert disk[path].dtype == engine[path].dtype, path
        np.testing.assert_array_equal(disk[path], engine[path], err_msg=str(path))
    other = _engine_params("tiny-gqa", 8, dtype)
    assert any(not np.array_equal(disk[p], other[p]) for p in disk), "another seed must give other weights"


def test_progress_bars_and_no_progress(tmp_path, capsys):
    src, dst = str(tmp_path / "hf"), str(tmp_path / "orbax")
    assert main(["random-checkpoint", src, "--preset", "tiny", "--no-progress"]) == 0
    assert "tensor" not in capsys.readouterr().err
    assert main(["convert", src, dst]) == 0
    err = capsys.readouterr().err
    assert "convert" in err and "save" in err  # reading tensors, then orbax's bytes written
    assert main(["random-checkpoint", str(tmp_path / "r"), "--preset", "tiny", "--layout", "orbax"]) == 0
    err = capsys.readouterr().err
    assert "random" in err and "save" in err


def test_demo_names_its_weights(tmp_path):
    assert _demo_weights("tiny", 3) == (
        "random, preset tiny seed 3 (the same as `ouro-jax random-checkpoint --preset tiny --seed 3`)"
    )
    assert _demo_weights(str(tmp_path), 3) == f"checkpoint {tmp_path}"
