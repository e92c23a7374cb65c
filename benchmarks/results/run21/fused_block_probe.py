"""Session 12: why does a 128-row fused decode launch block for the whole step (run 20 call 7)?
For fused steps of 8 / 32 / 128 rows: (1) the optimized HLO: is the depth while loop inside a
command buffer, which custom calls are there; (2) how long launch() takes to return, alone and
right after another launch; (3) the same executable compiled without CONDITIONAL,WHILE."""

import gzip
import os
import re
import time

import jax
import numpy as np

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax import runner as rmod
from ouro_jax.model import init_params

OUT = os.environ.get("OUT", "/tmp")
cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
P = int(os.environ.get("P", 512))
t0 = time.perf_counter()
llm = LLM(
    cfg,
    params=init_params(cfg, 0, "bfloat16"),
    dtype="bfloat16",
    max_num_seqs=128,
    max_num_batched_tokens=1024,
    buckets=[8, 32, 128, 1024],
    max_model_len=P + 256,
    kv_cache_bytes=int(os.environ.get("KV_GB", 16)) << 30,
    fused_decode_max_rows=128,
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


def hlo_summary(name, text):
    with gzip.open(os.path.join(OUT, name + ".hlo.txt.gz"), "wt") as f:
        f.write(text)
    whiles, current = [], ""
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = line.split("(")[0].strip()[:60]
        elif " while(" in line:
            whiles.append(current)
    cc = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    print(
        f"{name}: chars {len(text)} command_buffer {text.count('command_buffer')} whiles in {whiles} "
        f"conditional {text.count('conditional(')} custom calls {cc}",
        flush=True,
    )


rng = np.random.default_rng(0)
for c in [int(x) for x in os.environ.get("CS", "8,32,128").split(",")]:
    for i in range(c):
        ids = list(map(int, rng.integers(1, cfg.vocab_size, P)))
        llm.add_request(ids, SamplingParams(max_tokens=60, ignore_eos=True), request_id=f"c{c}-{i}")
    desc = None
    for _ in range(400):
        llm.step()
        d = seen[-1]
        if hasattr(d, "steps") and d.key.R == c:
            desc = d
            break
    if desc is None:
        print(f"c={c}: no fused step of {c} rows seen", flush=True)
        continue
    for _ in range(6):
        llm.step()
    r.synchronize()
    n0, d0 = r.invocations, r.dispatch_time
    tt = time.perf_counter()
    for _ in range(10):
        llm.step()
    r.synchronize()
    print(
        f"c={c}: LLM.step {(time.perf_counter() - tt) / 10 * 1e3:.2f} ms a step, dispatch "
        f"{(r.dispatch_time - d0) / max(1, r.invocations - n0) * 1e3:.2f} ms per invocation",
        flush=True,
    )
    key = r.executable_key(desc)
    hlo_summary(f"fused_R{c}", r.executable(key).as_text())
    packed = r.upload(desc)
    jax.block_until_ready(packed)
    original = r.executable(key)
    for label, exe in (("graphs", original), ("no_cond", None)):
        if exe is None:
            opts = dict(rmod._compiler_options(False))
            exe = r._lower(key).compile(opts)
            hlo_summary(f"fused_R{c}_nocond", exe.as_text())
            r._exe[key] = exe
        rets = []
        for trial in range(4):
            r.synchronize()
            ta = time.perf_counter()
            r.launch(key, packed)
            tb = time.perf_counter()
            r.launch(key, packed)
            tc = time.perf_counter()
            r.synchronize()
            td = time.perf_counter()
            rets.append((tb - ta, tc - tb, td - ta))
        rets = np.array(rets[1:]) * 1e3
        print(
            f"c={c} {label}: 1st launch returns {rets[:, 0].mean():.2f} ms, 2nd {rets[:, 1].mean():.2f} ms, "
            f"both done {rets[:, 2].mean():.2f} ms",
            flush=True,
        )
    r._exe[key] = original
    for i in range(c):
        llm.abort(f"c{c}-{i}")
    while llm.has_unfinished():
        llm.step()
print("done", flush=True)
