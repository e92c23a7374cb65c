"""The kernel rule (pallas_kernels/dispatch.py) against the committed H200 sweep: on every prefill
shape where both Pallas kernels were timed, the kernel that serves the shape is the faster one
(within 5%: timings repeat to a few percent).

Each shape is checked twice: as swept (``S`` = its segments: one kernel per bucket) and as the
engine would hold the same rows (``S = R`` segment slots, where the rule may pick ``"hybrid"``
and the segments' own lengths decide, per segment, which kernel serves them). The sweep timed
Triton with the tuning of the swept bucket; in an ``S = R`` bucket Triton runs its decode-style
tuning, which the sweep did not time, so the second check takes the swept timings as the best
measurement there is."""

import json
import os

import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch

SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "attention_sweep.json")


def _records():
    assert os.path.exists(SWEEP), "benchmarks/results/attention_sweep.json is committed"
    with open(SWEEP) as f:
        sweep = json.load(f)
    return [r for r in sweep["records"] if r.get("triton_ms") and r.get("mgpu_ms")]


def _serving_kernel(pick: str, n_seg: int, q_len: int) -> str:
    """The kernel that runs the shape's segments: for ``"hybrid"``, the per-segment split's."""
    if pick != "hybrid":
        return pick
    triton_q_len, mgpu_q_len = dispatch.split_segments(jnp.full((n_seg,), q_len, jnp.int32))
    on_mgpu = np.asarray(mgpu_q_len) > 0
    assert on_mgpu.all() or not on_mgpu.any(), "segments of one length go to one kernel"
    np.testing.assert_array_equal(np.asarray(triton_q_len) > 0, ~on_mgpu)
    return "mgpu" if on_mgpu.all() else "triton"


def test_rule_picks_the_faster_kernel_on_the_h200_sweep(monkeypatch):
    monkeypatch.delenv("OURO_JAX_ATTENTION_KERNEL", raising=False)
    monkeypatch.setattr(dispatch, "MGPU_DECODE_MAX_ROWS", 0)  # the prefill sweep times Triton vs mgpu only
    recs = _records()
    assert len(recs) >= 6, "the sweep should time both kernels on its prefill shapes"
    picks = set()
    for r in recs:
        s = r["shape"]
        rows = s["n_seg"] * s["q_len"]
        best = min(("triton", "mgpu"), key=lambda k: r[f"{k}_ms"])
        for num_segments in (s["n_seg"], rows):  # as swept, then as an engine bucket
            pick = dispatch.select_kernel(
                rows, num_segments, jnp.bfloat16, s["head_dim"], s["block_size"], num_heads=s["heads"], hopper=True
            )
            picks.add(pick)
            got = _serving_kernel(pick, s["n_seg"], s["q_len"])
            assert r[f"{got}_ms"] <= 1.05 * r[f"{best}_ms"], (s, num_segments, pick, r["triton_ms"], r["mgpu_ms"])
    assert picks == {"triton", "mgpu", "hybrid"}, picks  # every branch of the rule is exercised


def test_small_buckets_go_to_the_mosaic_decode_kernel_when_enabled(monkeypatch):
    """``MGPU_DECODE_MAX_ROWS`` on: buckets of at most that many rows, on Hopper in bf16/f16 with
    shapes the split-K kernel accepts, get ``mgpu_decode`` under ``pallas``; everything else keeps
    the rule's answer. Off (the committed 0): no bucket does."""
    monkeypatch.delenv("OURO_JAX_ATTENTION_KERNEL", raising=False)
    sel = dispatch.select_kernel
    ouro = dict(num_heads=16, num_kv_heads=16, hopper=True)
    monkeypatch.setattr(dispatch, "MGPU_DECODE_MAX_ROWS", 0)
    assert {sel(r, r, jnp.bfloat16, 128, 16, **ouro) for r in (1, 8, 16)} == {"triton"}
    monkeypatch.setattr(dispatch, "MGPU_DECODE_MAX_ROWS", 16)
    for r in (1, 8, 16):
        assert sel(r, r, jnp.bfloat16, 128, 16, **ouro) == "mgpu_decode"
        assert sel(r, r, jnp.float16, 128, 16, **ouro) == "mgpu_decode"
    assert sel(32, 32, jnp.bfloat16, 128, 16, **ouro) == "triton"  # above the constant
    for g in (2, 4, 8):
        assert sel(8, 8, jnp.bfloat16, 64, 16, num_heads=8 * g, num_kv_heads=8, hopper=True) == "mgpu_decode"
    # fallbacks: the rule's answer where the kernel cannot serve the bucket
    assert sel(8, 8, jnp.float32, 128, 16, **ouro) == "triton"  # dtype
    assert sel(8, 8, jnp.bfloat16, 128, 16, num_heads=32, num_kv_heads=2, hopper=True) == "triton"  # g = 16
    assert sel(16, 16, jnp.bfloat16, 128, 16, num_heads=16, num_kv_heads=1, hopper=True) == "triton"  # g = 16
    assert sel(8, 8, jnp.bfloat16, 128, 16, num_heads=16, num_kv_heads=16, hopper=False) == "triton"  # not Hopper
    assert sel(8, 8, jnp.bfloat16, 96, 16, **ouro) == "triton"  # head_dim
    assert sel(8, 8, jnp.bfloat16, 128, 12, **ouro) == "triton"  # page size
    kw = dict(num_rows=8, num_segments=8, num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)
    on_hopper = dispatch.hopper_available()
    assert dispatch.choose_attention("pallas", dtype=jnp.bfloat16, **kw).name == (
        "mgpu_decode" if on_hopper else "triton"
    )
    assert dispatch.choose_attention("pallas", dtype=jnp.float32, **kw).name == "triton"
    assert dispatch.choose_attention("triton", dtype=jnp.bfloat16, **kw).name == "triton"  # forced stays forced
    # the variable still forces its kernel over the constant
    monkeypatch.setenv("OURO_JAX_ATTENTION_KERNEL", "triton")
    assert sel(8, 8, jnp.bfloat16, 128, 16, **ouro) == "triton"


def test_every_cli_offers_the_attention_choices_of_dispatch():
    import argparse
    import subprocess
    import sys

    from benchmarks import profile_step, run
    from ouro_jax.server.cli_commands import add_engine_args

    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    for p in (engine, run.parser(), profile_step.parser()):
        (action,) = [a for a in p._actions if "--attention" in a.option_strings]
        assert tuple(action.choices) == dispatch.ATTENTION
    # the CLIs list them without importing jax (``ouro-jax --help`` stays fast)
    code = (
        "import sys, ouro_jax.cli, ouro_jax.server.cli_commands, benchmarks.profile_step; "
        "bad = [m for m in ('jax', 'flax') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
