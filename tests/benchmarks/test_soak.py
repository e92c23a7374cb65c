"""``benchmarks/soak.py`` on the CPU: ~20 s of mixed load (chat included: the checkpoint has a chat
template) against an ``ouro-jax serve`` subprocess, then its drain. Nothing may be left running or
holding KV blocks, no request may fail unexpectedly, and the drain must answer 503 and exit 0."""

import json

import pytest

pytest.importorskip("fastapi")

from benchmarks import report, soak  # noqa: E402
from tests.server.conftest import write_checkpoint  # noqa: E402

ENGINE = [
    "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--prefill-chunk-size", "8", "--block-size", "4",
    "--max-model-len", "128", "--buckets", "16", "--fused-decode-max-rows", "0", "--max-queue", "16",
]  # fmt: skip


@pytest.mark.slow
def test_soak_on_cpu_leaves_nothing_behind_and_drains(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "results"
    argv = [
        "--model", folder, "--duration-s", "20", "--concurrency", "8", "--max-prompt-len", "24", "--max-tokens", "16",
        "--burst-every-s", "5", "--drain-streams", "3", "--drain-max-tokens", "100", "--label", "cpu tiny",
        "--out", str(out), *ENGINE,
    ]  # fmt: skip
    rec = soak.main(argv)
    assert rec["unexpected"] == 0, rec["error_examples"]
    assert rec["leftovers"] == dict(running=0.0, waiting=0.0, kv_usage=0.0)
    d = rec["drain"]
    assert d["exit_code"] == 0 and d["saw_503"] and d["health_503"] and d["retry_after"] == "1"
    assert d["finished"] == d["streams"] == 3
    # every kind of request ran, chats too; bursts past the queue met 429s, counted, not errors
    assert rec["chat"] and set(rec["requests"]) == set(soak.ACTIONS) | {"burst"}
    assert rec["outcomes"]["burst"].get("429", 0) > 0 and rec["outcomes"]["bad"].get("400", 0) > 0
    assert rec["latency"]["ttft"]["n"] > 0 and rec["rss"]["samples"] >= 5 and rec["threads"]["start"] > 0
    saved = json.loads((out / "soak.json").read_text())
    assert saved["benchmark"] == "soak" and [r["label"] for r in saved["records"]] == ["cpu tiny"]
    assert "| cpu tiny |" in report.soak_section(saved)


def test_engine_gauges_sum_over_replicas_and_flatness():
    text = (
        'ouro_num_requests_running{model_name="m",replica="0"} 1.0\n'
        'ouro_num_requests_running{model_name="m",replica="1"} 2.0\n'
        'ouro_num_requests_waiting{model_name="m",replica="0"} 0.0\n'
        'ouro_kv_cache_usage_ratio{model_name="m",replica="0"} 0.25\n'
    )
    assert soak.engine_gauges(text) == dict(running=3.0, waiting=0.0, kv_usage=0.25)
    samples = [(0.0, 100.0, 10), (5.0, 110.0, 12), (10.0, 111.0, 12), (15.0, 112.0, 13)]
    assert soak.flatness(samples, 5.0, 15.0, 1) == 2.0 and soak.flatness(samples, 5.0, 15.0, 2) == 1
    assert soak.flatness(samples, 14.0, 15.0, 1) is None  # one sample: no growth to speak of
