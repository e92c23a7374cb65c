"""A quick look at the engine on the GPU: prefill and decode rates for a static batch, per layer-loop
form (``scan`` over stacked layers vs ``unrolled``), with compile times and host/device split.

    python -m benchmarks.engine_probe --preset ouro-1.4b --batch 8 64 --prompt 1024 --new 32

Decode rate = tokens generated after every request's first token, over the time since then; floors
from ``benchmarks/floors.py`` with the ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from benchmarks import ceilings
from benchmarks.floors import decode_step_floor, prefill_floor
from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.model import init_params


def probe(cfg, params, layer_loop, batch, prompt, new, mode, chunk, ceil, buckets):
    llm = LLM(
        cfg,
        params=params,
        max_num_seqs=max(batch, 8),
        max_num_batched_tokens=1024,
        prefill_chunk_size=chunk,
        max_model_len=prompt + new + 16,
        prefill_mode=mode,
        layer_loop=layer_loop,
        kv_cache_bytes=int(batch * (prompt + new + 32) * cfg.kv_bytes_per_token_plane() * cfg.num_loops * 1.1),
        buckets=buckets,
        progress=False,
    )
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, cfg.vocab_size, prompt))) for _ in range(batch)]
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        llm.add_request(p, sp)
    first_all = None
    n_first = 0
    inv_at_first = 0
    while llm.has_unfinished():
        for o in llm.step():
            if len(o.token_ids) == 1 and o.token_ids:
                n_first += 1
        if first_all is None and n_first == batch:
            first_all, inv_at_first = time.perf_counter(), llm.stats()["invocations"]
    t_end = time.perf_counter()
    st = llm.stats()
    pre_s, dec_s = first_all - t0, t_end - first_all
    dec_inv = st["invocations"] - inv_at_first
    pf = prefill_floor(cfg, batch, prompt, chunk, 1024, ceil["bandwidth"], ceil["peak_flops"])
    df = decode_step_floor(cfg, batch, prompt + new / 2, cfg.num_loops, ceil["bandwidth"], ceil["peak_flops"])
    rec = dict(
        layer_loop=layer_loop,
        mode=mode,
        chunk=chunk,
        batch=batch,
        prompt=prompt,
        new=new,
        compile_s=st["compile_time_s"],
        executables=st["compilations"],
        prefill_s=pre_s,
        prefill_tok_s=batch * prompt / pre_s,
        prefill_floor_tok_s=batch * prompt / pf["floor_s"],
        decode_tok_s=batch * (new - 1) / dec_s,
        decode_floor_tok_s=batch / df["floor_s"],
        decode_ms_per_invocation=1e3 * dec_s / max(1, dec_inv),
        host_ms_per_invocation=1e3 * st["host_time_per_invocation_s"],
        rows_per_invocation=st["rows_per_invocation"],
        invocations=st["invocations"],
    )
    rec["prefill_fraction_of_floor"] = rec["prefill_tok_s"] / rec["prefill_floor_tok_s"]
    rec["decode_fraction_of_floor"] = rec["decode_tok_s"] / rec["decode_floor_tok_s"]
    print(
        f"{layer_loop:8s} {mode:9s} chunk {chunk:4d} batch {batch:4d}: compile {rec['compile_s']:6.1f} s "
        f"({rec['executables']} exe) "
        f"| prefill {rec['prefill_tok_s']:9.0f} tok/s (floor {rec['prefill_floor_tok_s']:9.0f}) "
        f"| decode {rec['decode_tok_s']:8.1f} tok/s (floor {rec['decode_floor_tok_s']:8.1f}, "
        f"{100 * rec['decode_fraction_of_floor']:4.1f}%) {rec['decode_ms_per_invocation']:6.2f} ms/inv, "
        f"host {rec['host_ms_per_invocation']:5.2f} ms/inv",
        flush=True,
    )
    del llm
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--layer-loop", nargs="+", default=["scan", "unrolled"])
    ap.add_argument("--mode", default="split")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--buckets", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    cfg = get_preset(a.preset)
    ceil = ceilings.measure(quick=True)
    params = init_params(cfg, 0, "bfloat16")
    recs = []
    os.makedirs(a.out, exist_ok=True)
    for ll in a.layer_loop:
        for b in a.batch:
            recs.append(probe(cfg, params, ll, b, a.prompt, a.new, a.mode, a.chunk, ceil, a.buckets))
            with open(os.path.join(a.out, "engine_probe.json"), "w") as f:
                json.dump(
                    dict(
                        device=ceil["device"], jax_version=jax.__version__, preset=a.preset, ceilings=ceil, records=recs
                    ),
                    f,
                    indent=2,
                )


if __name__ == "__main__":
    main()
