"""Session 14: the kernel sequence of one decode layer and of one prefill:1024 layer, with the
optimized HLO of both executables, so that every small kernel can be named.

For c in CS: c streams of P-token prompts decode on the engine's fused steps; 3 engine steps are
traced and their kernel events written in start order (name, duration, hlo_op) to
``$OUT/seq_c{c}.json``, the fused executable's HLO to ``$OUT/fused_R{R}.hlo.txt.gz``. Also the
return time of ``launch`` with the same uploaded descriptor and with a fresh upload each time.
Then a synthetic prefill:1024 descriptor (8 segments of 128 rows at 4K context) is traced (3
invocations) and its HLO written."""

import gzip
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.profile_step import _invoke, hlo_op_names, trace_kernels
from benchmarks.sweep_buckets import synthetic_descriptor
from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.model import init_params

OUT = os.environ.get("OUT", "/tmp")
cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
P = int(os.environ.get("P", 1024))
t0 = time.perf_counter()
llm = LLM(
    cfg,
    params=init_params(cfg, 0, "bfloat16"),
    dtype="bfloat16",
    max_num_seqs=16,
    max_num_batched_tokens=1024,
    buckets=[8, 16, 1024],
    max_model_len=int(os.environ.get("MAXLEN", 4096 + 256)),
    kv_cache_bytes=int(os.environ.get("KV_GB", 24)) << 30,
    fused_decode_max_rows=16,
    progress=False,
    executable_store=False,
)
print(f"engine {time.perf_counter() - t0:.1f} s", flush=True)
r = llm.runner
seen = []
orig = r.step


def rec(desc):
    seen.append(desc)
    return orig(desc)


r.step = rec


def dump_events(name, events, hlo):
    events = sorted(events, key=lambda e: e["start_ns"])
    rows = []
    for e in events:
        st = e.get("stats") or {}
        op = st.get("hlo_op")
        rows.append(
            dict(
                name=e["name"],
                start_us=e["start_ns"] / 1e3,
                dur_us=e["duration_ns"] / 1e3,
                hlo_op=op,
                op_name=hlo.get(op) if (hlo and op) else None,
                details=st.get("kernel_details"),
            )
        )
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(rows, f)
    print(f"{name}: {len(rows)} kernels", flush=True)


def save_hlo(name, exe):
    text = exe.as_text()
    with gzip.open(os.path.join(OUT, name + ".hlo.txt.gz"), "wt") as f:
        f.write(text)
    return hlo_op_names(text)


rng = np.random.default_rng(0)
for c in [int(x) for x in os.environ.get("CS", "1,8").split(",")]:
    for i in range(c):
        ids = list(map(int, rng.integers(1, cfg.vocab_size, P)))
        llm.add_request(ids, SamplingParams(max_tokens=80, ignore_eos=True), request_id=f"c{c}-{i}")
    desc = None
    for _ in range(400):
        llm.step()
        d = seen[-1]
        if hasattr(d, "steps"):
            desc = d
            break
    if desc is None:
        print(f"c={c}: no fused step seen", flush=True)
        continue
    for _ in range(4):
        llm.step()
    r.synchronize()
    key = r.executable_key(desc)
    hlo = save_hlo(f"fused_c{c}", r.executable(key))

    def window():
        for _ in range(3):
            llm.step()
        r.synchronize()

    _, plane, events, info, _ = trace_kernels(window)
    dump_events(f"seq_c{c}", events, hlo)
    # launch return time: same uploaded descriptor vs a fresh upload each time; replayed
    # device time a token
    packed = r.upload(desc)
    jax.block_until_ready(packed)
    for label in ("same", "fresh"):
        rets = []
        for trial in range(8):
            r.synchronize()
            p = packed if label == "same" else r.upload(desc)
            ta = time.perf_counter()
            r.launch(key, p)
            rets.append(time.perf_counter() - ta)
        r.synchronize()
        print(f"c={c} launch returns ({label} descriptor): {np.median(rets) * 1e3:.3f} ms", flush=True)
    r.synchronize()
    ta = time.perf_counter()
    for _ in range(20):
        r.launch(key, packed)
    r.synchronize()
    print(f"c={c} replayed fused step: {(time.perf_counter() - ta) / 20 * 1e3:.3f} ms a launch", flush=True)
    for i in range(c):
        llm.abort(f"c{c}-{i}")
    while llm.has_unfinished():
        llm.step()

# prefill:1024, 8 segments of 128 rows at 4K context
spec = llm.scheduler.bucket_spec
desc = synthetic_descriptor(spec, 1024, "prefill", int(os.environ.get("PCTX", 4096)), 128, r.num_blocks)
key = desc.key
hlo = save_hlo("prefill_R1024", r.executable(key))
packed = jnp.asarray(desc.pack())
_invoke(r, key, packed, 3)
_, plane, events, info, _ = trace_kernels(lambda: _invoke(r, key, packed, 3))
dump_events("seq_prefill1024", events, hlo)
t = time.perf_counter()
_invoke(r, key, packed, 10)
print(f"prefill:1024 {(time.perf_counter() - t) / 10 * 1e3:.3f} ms an invocation", flush=True)
print("done", flush=True)
