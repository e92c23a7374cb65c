"""Session 12: decode attention knobs of the 8-row bucket, timed as the engine runs them (the
captured fused step replayed back to back, its descriptor on the device) at c=1 and c=8.
TUNE env: ';'-separated variants of 'block_q,block_k,min_split_tokens,target_programs[,old_combine]' (0 = default)."""

import importlib.util
import os
import sys
import time

import jax
import numpy as np

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax.model import init_params
from pallas_kernels import dispatch
from pallas_kernels import ragged_paged_attention as rpa

_spec = importlib.util.spec_from_file_location("rpa_old", os.path.join(os.path.dirname(__file__), "rpa_old.py"))
rpa_old = importlib.util.module_from_spec(_spec)
sys.modules["rpa_old"] = rpa_old
_spec.loader.exec_module(rpa_old)
NEW_COMBINE = rpa._combine_kernel

cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
P = int(os.environ.get("P", 1024))
VARIANTS = [tuple(int(x) for x in v.split(",")) for v in os.environ.get("TUNE", "0,0,0,0").split(";")]
_orig = dispatch.default_tuning
CURRENT = {}


def patched(num_rows, num_segments, *a, **kw):
    if num_rows == 8:
        for k, v in CURRENT.items():
            if v:
                kw[k] = v
    return _orig(num_rows, num_segments, *a, **kw)


dispatch.default_tuning = patched
llm = LLM(
    cfg,
    params=init_params(cfg, 0, "bfloat16"),
    dtype="bfloat16",
    max_num_seqs=8,
    max_num_batched_tokens=1024,
    buckets=[8, 1024],
    max_model_len=P + 512,
    kv_cache_bytes=8 << 30,
    progress=False,
    executable_store=False,
)
r = llm.runner
seen = []
orig = r.step


def rec(desc):
    seen.append(desc)
    return orig(desc)


r.step = rec
rng = np.random.default_rng(0)
results = {}
for c in (1, 8):
    for i in range(c):
        ids = list(map(int, rng.integers(1, cfg.vocab_size, P)))
        llm.add_request(ids, SamplingParams(max_tokens=400, ignore_eos=True), request_id=f"c{c}-{i}")
    desc = None
    for _ in range(400):
        llm.step()
        d = seen[-1]
        if hasattr(d, "steps") and len(llm.scheduler.running) == c:
            desc = d
            break
    r.synchronize()
    key = r.executable_key(desc)
    packed = r.upload(desc)
    original = r.executable(key)
    for v in VARIANTS:
        CURRENT.clear()
        CURRENT.update(zip(("block_q", "block_k", "min_split_tokens", "target_programs"), v[:4]))
        rpa._combine_kernel = rpa_old._combine_kernel if len(v) > 4 and v[4] else NEW_COMBINE
        if any(v):
            r._exe.pop(key)
            jax.clear_caches()  # the jit trace cache would keep the first tuning's jaxpr
            r._compile(key, try_store=False)
        jax.block_until_ready(r.launch(key, packed))
        best = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(20):
                out = r.launch(key, packed)
            jax.block_until_ready(out)
            best.append((time.perf_counter() - t) / 20 * 1e3)
        results[(c, v)] = min(best)
        print(f"c={c} tuning {v}: replay {min(best):.3f} ms a token (runs {['%.3f' % b for b in best]})", flush=True)
        r._exe[key] = original
    for i in range(c):
        llm.abort(f"c{c}-{i}")
    while llm.has_unfinished():
        llm.step()
print("done", flush=True)
