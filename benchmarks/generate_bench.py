"""Static-batch ``ouro_jax.generate`` throughput next to its floor.

    python -m benchmarks.generate_bench --preset ouro-1.4b --batch 1 64 --prompt 1024 --new 128

Random weights (throughput does not depend on their values at fixed depth). Each batch size is
compiled once, then timed ``--reps`` times; the figure is output tokens per second over the whole
call (prefill included) and its fraction of the floor of the same schedule (one-shot prefill +
``new-1`` decode steps at full depth), with the ceilings measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import ceilings
from benchmarks.floors import generate_floor
from ouro_jax import generate, get_preset
from ouro_jax.model import init_params


def run(
    preset: str, batches, prompt: int, new: int, reps: int, dtype: str, quick_ceilings: bool, on_record=None
) -> dict:
    cfg = get_preset(preset)
    ceil = ceilings.measure(quick_ceilings)
    params = init_params(cfg, 0, dtype)
    records = []
    for b in batches:
        ids = jax.random.randint(jax.random.PRNGKey(b), (b, prompt), 0, cfg.vocab_size)
        lengths = jnp.full((b,), prompt, jnp.int32)
        t = time.perf_counter()
        out = generate(params, cfg, ids, lengths, new)
        out.tokens.block_until_ready()
        compile_s = time.perf_counter() - t
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            out = generate(params, cfg, ids, lengths, new)
            out.tokens.block_until_ready()
            times.append(time.perf_counter() - t)
        best = float(np.median(times))
        fl = generate_floor(cfg, b, prompt, new, ceil["bandwidth"], ceil["peak_flops"])
        rec = dict(
            batch=b,
            prompt=prompt,
            new_tokens=new,
            seconds=best,
            seconds_all=times,
            first_call_s=compile_s,
            output_tok_s=b * new / best,
            floor_s=fl["floor_s"],
            floor_output_tok_s=b * new / fl["floor_s"],
            fraction_of_floor=fl["floor_s"] / best,
            prefill_floor_s=fl["prefill_floor_s"],
            decode_floor_s=fl["decode_floor_s"],
            mean_exit_depth=float(np.mean(np.asarray(out.exit_depths))),
        )
        records.append(rec)
        if on_record:
            on_record(
                dict(
                    benchmark="generate",
                    device=ceil["device"],
                    jax_version=jax.__version__,
                    preset=preset,
                    dtype=dtype,
                    ceilings=ceil,
                    records=records,
                )
            )
        print(
            f"batch {b:4d}: {rec['output_tok_s']:9.1f} out tok/s  ({best * 1e3:8.1f} ms; floor "
            f"{fl['floor_s'] * 1e3:8.1f} ms = {rec['floor_output_tok_s']:9.1f} tok/s; "
            f"{100 * rec['fraction_of_floor']:5.1f}% of floor; first call {compile_s:6.1f} s)",
            flush=True,
        )
    return dict(
        benchmark="generate",
        device=ceil["device"],
        jax_version=jax.__version__,
        preset=preset,
        dtype=dtype,
        ceilings=ceil,
        records=records,
    )


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    x = np.arange(len(recs))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, [r["output_tok_s"] for r in recs], 0.4, label="generate()")
    ax.bar(x + 0.2, [r["floor_output_tok_s"] for r in recs], 0.4, label="floor", alpha=0.6)
    ax.set_xticks(x, [f"batch {r['batch']}" for r in recs])
    ax.set_yscale("log")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"{result['preset']} generate, {recs[0]['prompt']}+{recs[0]['new_tokens']} ({result['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick-ceilings", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)

    def save(res):  # after every record, so a run cut short still leaves its figures
        with open(os.path.join(a.out, "generate.json"), "w") as f:
            json.dump(res, f, indent=2)

    result = run(a.preset, a.batch, a.prompt, a.new, a.reps, a.dtype, a.quick_ceilings, save)
    try:
        plot(result, os.path.join(a.out, "generate.png"))
    except ImportError:
        print("matplotlib missing: no plot")
    return result


if __name__ == "__main__":
    main()
