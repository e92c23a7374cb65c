"""The per-bucket kernel rule (pallas_kernels/dispatch.py) against the committed H200 sweep: on
every prefill shape where both Pallas kernels were timed, the rule picks the faster one (within
5%: timings repeat to a few percent)."""
import json
import os

import jax.numpy as jnp
from pallas_kernels import dispatch

SWEEP = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "attention_sweep.json")


def _records():
    assert os.path.exists(SWEEP), "benchmarks/results/attention_sweep.json is committed"
    with open(SWEEP) as f:
        sweep = json.load(f)
    return [r for r in sweep["records"] if r.get("triton_ms") and r.get("mgpu_ms")]


def test_rule_picks_the_faster_kernel_on_the_h200_sweep(monkeypatch):
    monkeypatch.delenv("OURO_JAX_ATTENTION_KERNEL", raising=False)
    recs = _records()
    assert len(recs) >= 6, "the sweep should time both kernels on its prefill shapes"
    for r in recs:
        s = r["shape"]
        pick = dispatch.select_kernel(s["n_seg"] * s["q_len"], s["n_seg"], jnp.bfloat16,
                                      s["head_dim"], s["block_size"], num_heads=s["heads"],
                                      hopper=True)
        best = min(("triton", "mgpu"), key=lambda k: r[f"{k}_ms"])
        assert r[f"{pick}_ms"] <= 1.05 * r[f"{best}_ms"], (s, pick, r["triton_ms"], r["mgpu_ms"])
