"""Run 20 (session 11): env STATIC=1 (the depth loop as a static 4-loop fori_loop), KV_GB, TOKENS.

Is the engine's c=1 decode loss inside the fused executable or around it? (session 10, for the next
device call). Times, on one engine: (1) LLM.step() per token; (2) the captured fused step replayed
back to back with its descriptor already on the device; (3) the same with a fresh upload per call."""

import os
import time

import jax
import numpy as np

from ouro_jax import LLM, SamplingParams, get_preset

if os.environ.get("STATIC"):  # the fused step's depth loop with a static trip count (fixed depth: same work)
    _while = jax.lax.while_loop

    def _static_while(cond, body, init):
        if isinstance(init, tuple) and len(init) == 9:  # the fused step's depth loop
            return jax.lax.fori_loop(0, 4, lambda i, c: body(c), init)
        return _while(cond, body, init)

    jax.lax.while_loop = _static_while
from ouro_jax.model import init_params

cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
P = int(os.environ.get("P", 1024))
params = init_params(cfg, 0, "bfloat16")
llm = LLM(
    cfg,
    params=params,
    dtype="bfloat16",
    max_num_seqs=8,
    max_num_batched_tokens=128,
    buckets=[8, 128],
    max_model_len=P + 256,
    kv_cache_bytes=(int(os.environ.get("KV_GB", 4)) << 30) or None,
    fused_decode_tokens=int(os.environ.get("TOKENS", 1)),
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
ids = list(map(int, np.random.default_rng(0).integers(1, cfg.vocab_size, P)))
llm.add_request(ids, SamplingParams(max_tokens=200, ignore_eos=True), request_id="x")
while not any(not hasattr(r.executable_key(d), "R") for d in seen[-1:]):  # until a fused step ran
    llm.step()
for _ in range(5):
    llm.step()
r.synchronize()
n = 30
t = time.perf_counter()
for _ in range(n):
    llm.step()
r.synchronize()
per_step = (time.perf_counter() - t) / n
desc = seen[-1]
key = r.executable_key(desc)
packed = r.upload(desc)
jax.block_until_ready(r.launch(key, packed))
t = time.perf_counter()
for _ in range(n):
    out = r.launch(key, packed)
jax.block_until_ready(out)
replay = (time.perf_counter() - t) / n
t = time.perf_counter()
for _ in range(n):
    out = r.launch(key, r.upload(desc))
jax.block_until_ready(out)
replay_upload = (time.perf_counter() - t) / n
t = time.perf_counter()
for _ in range(n):
    g, tok = r.launch(key, packed)
    np.asarray(tok)
replay_read = (time.perf_counter() - t) / n
from benchmarks.profile_step import aggregate, trace_kernels  # noqa: E402


def replay_n():
    for _ in range(8):
        o = r.launch(key, packed)
    jax.block_until_ready(o)


_, _, ev, _, _ = trace_kernels(replay_n)
agg = aggregate(ev, 8 * cfg.num_loops, top=8)
print(
    f"replay traced: {agg['kernels_per_inv']:.0f} kernels a loop, busy {agg['busy_ms_per_inv']:.3f} ms a loop, "
    f"span {agg['span_ms_per_inv']:.3f} ms a loop; gap sites {agg['gap_sites'][:4]}"
)
env = {k: os.environ.get(k) for k in ("STATIC", "KV_GB", "TOKENS", "XLA_FLAGS")}
print(f"{env} pool {llm.stats()['kv_cache_bytes'] / 1e9:.1f} GB")
print(
    f"fused key {key}: LLM.step {per_step * 1e3:.3f} ms | replay {replay * 1e3:.3f} ms | replay+upload "
    f"{replay_upload * 1e3:.3f} ms | replay+read {replay_read * 1e3:.3f} ms (per token, {cfg.num_loops} loops)"
)
