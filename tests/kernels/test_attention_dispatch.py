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


def test_rule_picks_the_faster_kernel_on_the_h200_sweep():
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


def test_small_buckets_go_to_triton():
    """Decode buckets go to Triton under ``pallas`` (on Hopper too); a forced kernel stays forced."""
    sel = dispatch.select_kernel
    for r in (1, 8, 16):
        assert sel(r, r, jnp.bfloat16, 128, 16, num_heads=16, hopper=True) == "triton"
    kw = dict(num_rows=8, num_segments=8, num_heads=16, num_kv_heads=16, head_dim=128, block_size=16)
    assert dispatch.choose_attention("pallas", dtype=jnp.bfloat16, **kw).name == "triton"
    assert dispatch.choose_attention("pallas", dtype=jnp.float32, **kw).name == "triton"
    assert dispatch.choose_attention("triton", dtype=jnp.bfloat16, **kw).name == "triton"
    assert dispatch.choose_attention("Hybrid", dtype=jnp.bfloat16, **kw).name == "hybrid"


def test_every_cli_offers_the_attention_choices_of_dispatch():
    import argparse
    import subprocess
    import sys

    from benchmarks import profile_step, run
    from ouro_jax.engine_config import add_arguments
    from ouro_jax.server.cli_commands import ENGINE_SECTIONS

    engine = argparse.ArgumentParser()
    add_arguments(engine, ENGINE_SECTIONS)
    for p in (engine, run.parser(), profile_step.parser()):
        (action,) = [a for a in p._actions if "--attention" in a.option_strings]
        assert tuple(action.choices) == dispatch.ATTENTION
    # the CLIs list them without importing jax (``ouro-jax --help`` stays fast)
    code = (
        "import sys, ouro_jax.cli, ouro_jax.server.cli_commands, benchmarks.profile_step; "
        "from ouro_jax.engine_config import EngineConfig; EngineConfig(fused_xla_options='xla_a=1'); "
        "bad = [m for m in ('jax', 'flax') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
