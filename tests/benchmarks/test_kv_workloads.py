"""The benchmark workloads of issue 16 at a tiny scale on the CPU: eos512 (KV reserved at admission
against allocated on demand) and shared_prefix (prefix cache off / on). Speed is not asserted, only
that the records carry the KV figures and that the mechanisms show in them."""

import pytest

from benchmarks import run
from benchmarks.workloads import make

SMALL = [
    "--preset",
    "tiny",
    "--scale",
    "0.05",
    "--count-scale",
    "0.05",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "64",
    "--buckets",
    "32",
    "64",
    "--no-progress",
    "--no-plot",
    "--quick-ceilings",
    "--mode",
    "split",
    "--chunk",
    "16",
]


def test_workload_shapes():
    e = make("eos512", 1000)
    assert [w.variant for w in e] == ["reserve", "on_demand"] and len(e[0].requests) == 512
    assert all(64 <= r.params.max_tokens <= 256 and r.reserve_tokens == 1024 for r in e[0].requests)
    assert all(r.num_prompt_tokens == 1024 and r.params.ignore_eos for r in e[0].requests)
    p = make("shared_prefix", 1000)
    assert [w.engine_kw for w in p] == [dict(enable_prefix_caching=False), dict(enable_prefix_caching=True)]
    reqs = p[0].requests
    assert len(reqs) == 64 and all(r.num_prompt_tokens == 2048 + 64 for r in reqs)
    assert (reqs[0].prompt[:2048] == reqs[1].prompt[:2048]).all() and (
        reqs[0].prompt[2048:] != reqs[1].prompt[2048:]
    ).any()
    assert (p[0].warm_prompts[0][:2048] == reqs[0].prompt[:2048]).all()


@pytest.mark.slow  # compiles the tiny model's buckets
def test_eos512_and_shared_prefix_smoke(tmp_path):
    # 80 blocks of 16 tokens (tiny: 2 layers x K/V x 64 x float32): the reserve variant's requests
    # (51-token prompts reserved for 51 more tokens: 7 blocks x 4 planes) fit two at a time
    block_bytes = 2 * 2 * 64 * 16 * 4
    args = SMALL + ["--out", str(tmp_path), "--max-model-len", "128", "--kv-cache-gb", str(80.5 * block_bytes / 1e9)]
    res = run.main(["--workload", "eos512", "shared_prefix", *args])
    assert set(res) >= {"eos512", "shared_prefix"}
    eos = {r["variant"]: r for r in res["eos512"]["records"]}
    assert set(eos) == {"reserve", "on_demand"}
    for r in eos.values():
        assert "error" not in r, r.get("error")
        assert r["requests_finished"] == r["requests"] and r["stop_rule"].startswith("per-request max_tokens")
    assert eos["reserve"]["preemptions"] == 0
    assert eos["on_demand"]["max_running"] > eos["reserve"]["max_running"]
    assert eos["on_demand"]["output_tokens"] == eos["reserve"]["output_tokens"]
    sp = {r["variant"]: r for r in res["shared_prefix"]["records"]}
    assert "error" not in sp["cache on"], sp["cache on"].get("error")
    assert sp["cache off"]["prefix_cache_hit_tokens"] == 0
    on = sp["cache on"]
    assert on["prefix_cache_hit_tokens"] > 0 and 0 < on["prompt_work_skipped_share"] < 1
    # the cache cuts prompt rows by exactly the hit positions' loops
    T = 4
    assert sp["cache off"]["prefill_rows"] - on["prefill_rows"] == on["prefix_cache_hit_tokens"] * T
