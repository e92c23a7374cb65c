"""``benchmarks/sm_partition.py`` off the GPU: splits parse or are refused, the side-by-side program
cross-lowers for CUDA with both kernels on their capped grids, and without a Hopper GPU the
benchmark says so and writes nothing."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import sm_partition as sp


def test_parse_split():
    assert sp.parse_split("108:24") == (108, 24)
    for bad in ("108", "108:", "0:24", "a:b", "108:-1"):
        with pytest.raises(ValueError, match="'G:k'"):
            sp.parse_split(bad)


def test_program_cross_lowers_with_both_kernels():
    sd = jax.ShapeDtypeStruct
    args = sd((384, 128), jnp.bfloat16), sd((128, 2, 128), jnp.bfloat16), sd((256, 640), jnp.bfloat16)
    texts = {
        p: sp.program(p, 3, 2).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        for p in ("gemm", "stream", "both")
    }
    calls = {p: t.count("stablehlo.custom_call @mosaic_gpu") for p, t in texts.items()}
    assert calls == {"gemm": 1, "stream": 1, "both": 2}
    with pytest.raises(ValueError, match="parts must be"):
        sp.program("all", 3, 2)


def test_off_hopper_writes_nothing(tmp_path, capsys):
    assert sp.main(["--out", str(tmp_path), "--splits", "108:24"]) is None
    assert "needs a Hopper GPU" in capsys.readouterr().out and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="'G:k'"):
        sp.main(["--out", str(tmp_path), "--splits", "108"])
    with pytest.raises(ValueError, match="--scale"):
        sp.main(["--out", str(tmp_path), "--scale", "0"])
    with pytest.raises(ValueError, match="--seg-rows"):
        sp.main(["--out", str(tmp_path), "--seg-rows", "100"])


def test_attention_read_cross_lowers_beside_the_gemm():
    sd = jax.ShapeDtypeStruct
    i32 = jnp.int32
    n_seg, ctx, page = 2, 256, 16
    pages = sd((1, 16, n_seg * ctx // page + 1, page, 128), jnp.bfloat16)
    args = (
        sd((384, 128), jnp.bfloat16),
        sd((128, 2, 128), jnp.bfloat16),
        sd((n_seg * 64, 16, 128), jnp.bfloat16),
        pages,
        pages,
        sd((n_seg,), i32),
        sd((n_seg,), i32),
        sd((n_seg,), i32),
        sd((n_seg, ctx // page), i32),
    )
    texts = {
        p: sp.program(p, 3, 1, "attention").trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        for p in ("gemm", "stream", "both")
    }
    calls = {p: t.count("stablehlo.custom_call @mosaic_gpu") for p, t in texts.items()}
    assert calls == {"gemm": 1, "stream": 1, "both": 2}
    with pytest.raises(ValueError, match="read must be"):
        sp.program("both", 3, 1, "dense")


def test_read_bytes_counts_the_pages_the_tables_name():
    mat = jnp.zeros((4, 8), jnp.bfloat16)
    assert sp.read_bytes((mat,)) == 64
    kp = jnp.zeros((1, 2, 5, 16, 8), jnp.bfloat16)
    tables = jnp.zeros((2, 2), jnp.int32)
    # 4 pages named, K and V, each page 2 heads x 16 tokens x 8 dims x 2 bytes
    assert sp.read_bytes((None, kp, kp, None, None, None, tables)) == 2 * 4 * 2 * 16 * 8 * 2


def test_interleaved_rounds_time_every_program_in_order(monkeypatch):
    calls = []

    def fake_median_s(fn, args, reps):
        calls.append(fn)
        return len(calls) * 1e-6

    monkeypatch.setattr(sp, "median_s", fake_median_s)
    out = sp.interleaved_us({"a": "A", ("g", 1): "B"}, (), reps=5, rounds=3)
    assert calls == ["A", "B"] * 3
    assert out == {"a": pytest.approx([1.0, 3.0, 5.0]), ("g", 1): pytest.approx([2.0, 4.0, 6.0])}
    with pytest.raises(ValueError, match="--rounds"):
        sp.main(["--rounds", "0"])


def test_a_record_takes_its_split_programs_and_each_rounds_ratio():
    rounds = {
        "serial": [100.0, 200.0, 100.0],
        "gemm": [50.0] * 3,
        "stream": [60.0, 61.0, 62.0],
        (8, 1, "gemm"): [70.0] * 3,
        (8, 1, "both_concurrent"): [80.0, 150.0, 90.0],
        (8, 1, "both_lhs"): [110.0] * 3,
    }
    rec = dict(G=8, k=1)
    sp.fill_record(rec, rounds)
    # the read has no program of the split's own (attention): the every-SM one stands in
    assert rec["gemm_us"] == 70.0 and rec["stream_us"] == 61.0 and rec["both_lhs_us"] == 110.0
    assert rec["vs_serial_rounds"] == pytest.approx([0.8, 0.75, 0.9])
    assert rec["vs_serial"] == pytest.approx(0.8)  # per round, not 90 / 100 of the medians
    failed = dict(G=8, k=1, error="refused")
    sp.fill_record(failed, rounds)
    assert failed == dict(G=8, k=1, error="refused")
