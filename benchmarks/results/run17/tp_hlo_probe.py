"""Collectives in the compiled one-loop step at TP=1 and TP=2 (CPU, 2 host devices, `tiny`).

Probe behind docs/multi-gpu.md ("Nor are the collectives' breaks..."): counts the collective ops of
a 16-row bucket's executable, with their shapes, so that a resharding of the KV pool or the ring
would show. Run from the repo root: `PYTHONPATH=$PWD python benchmarks/results/run17/tp_hlo_probe.py`.
"""

import collections
import os
import re

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

from ouro_jax import LLM  # noqa: E402 (after the device count is set)
from scheduler.buckets import BucketKey  # noqa: E402

COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")

for tp in (1, 2):
    llm = LLM(
        "tiny",
        tensor_parallel_size=tp,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=128,
        warmup=False,
        progress=False,
        fused_decode_max_rows=0,
        executable_store=False,
        attention="reference",
    )
    key = BucketKey(R=16, S=16, C=16, F=0, MB=llm.scheduler.bucket_spec.max_blocks_per_seq)
    text = llm.runner._lower(key).compile().as_text()
    found = collections.Counter((m.group(2), m.group(1)) for m in COLLECTIVE.finditer(text))
    print(f"tp {tp}, {llm.config.num_hidden_layers} layers: {sum(found.values())} collectives")
    for (op, shape), n in sorted(found.items()):
        print(f"    {n} x {op} {shape}")
