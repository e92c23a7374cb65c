"""The collectives in a compiled one-loop step at each tensor-parallel size, with their shapes, so
that a resharding of the KV pool or the ring (or a collective a change adds) shows up. Runs on the
CPU with host devices standing in for GPUs; the HLO's collectives are the ones the GPU program has.

    python -m benchmarks.tp_collectives                        # `tiny`, TP = 1 and 2, a 16-row bucket
    python -m benchmarks.tp_collectives --preset ouro-small --tp 2 4 --rows 64

Expected with the current sharding (`tiny`, 2 layers, TP=2): 5 all-reduces of ``[rows, hidden]``
(two a layer and one for the vocabulary-split embedding) and one all-gather of ``[rows, vocab]``
logits; nothing on the pool or the ring.
"""

from __future__ import annotations

import argparse
import collections
import os
import re

COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(")

__all__ = ["collectives", "main"]


def collectives(preset: str, tp: int, rows: int) -> collections.Counter:
    """``(op, shape) -> count`` in the optimized HLO of the ``rows``-row one-loop step."""
    from ouro_jax import LLM
    from scheduler.buckets import BucketKey

    llm = LLM(
        preset,
        tensor_parallel_size=tp,
        max_num_seqs=rows,
        max_num_batched_tokens=max(64, rows),
        max_model_len=128,
        warmup=False,
        progress=False,
        fused_decode_max_rows=0,
        executable_store=False,
        attention="reference",
    )
    key = BucketKey(R=rows, S=rows, C=rows, F=0, MB=llm.scheduler.bucket_spec.max_blocks_per_seq)
    text = llm.runner.lower(key).compile().as_text()
    return collections.Counter((m.group(2), m.group(1)) for m in COLLECTIVE.finditer(text))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    ap.add_argument("--rows", type=int, default=16, help="the bucket's rows (a multiple of 8)")
    a = ap.parse_args(argv)
    if a.rows < 8 or a.rows % 8:
        ap.error("--rows must be a positive multiple of 8")
    # host devices must be declared before jax starts; the CPU is asked for explicitly
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(a.tp)}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    out = {}
    for tp in a.tp:
        found = collectives(a.preset, tp, a.rows)
        out[tp] = found
        print(f"tp {tp}: {sum(found.values())} collectives")
        for (op, shape), n in sorted(found.items()):
            print(f"    {n} x {op} {shape}")
    return out


if __name__ == "__main__":
    main()
