"""Session 12 call 3: the 128-row fused step's launch blocks for the whole step. Its HLO (call 2) has
cuBLASLt GEMMs in the depth loop and a CUB sort in the sampling conditional, which the 8/32-row
steps do not. Variants of the fused step's XLA options: launch return time, replay, LLM.step."""

import os
import re
import time

import numpy as np

from ouro_jax import LLM, SamplingParams, get_preset
from ouro_jax import runner as rmod
from ouro_jax.model import init_params

cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
P = int(os.environ.get("P", 256))
C = int(os.environ.get("C", 128))
VARIANTS = {
    "default": {},
    "no_cub_sort": {"xla_gpu_enable_cub_radix_sort": False},
    "no_cublaslt": {"xla_gpu_enable_cublaslt": False},
    "neither": {"xla_gpu_enable_cub_radix_sort": False, "xla_gpu_enable_cublaslt": False},
    "triton_only": {"xla_gpu_enable_cub_radix_sort": False, "xla_gpu_cublas_fallback": False},
}
only = os.environ.get("VARIANTS")
if only:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in only.split(",")}
_orig_opts = rmod._compiler_options
EXTRA = {}


def opts(fused=False):
    o = dict(_orig_opts(fused))
    if fused:
        o.update(EXTRA)
    return o


rmod._compiler_options = opts
llm = LLM(
    cfg,
    params=init_params(cfg, 0, "bfloat16"),
    dtype="bfloat16",
    max_num_seqs=C,
    max_num_batched_tokens=1024,
    buckets=sorted({8, 32, C, 1024}),
    max_model_len=P + 512,
    kv_cache_bytes=int(os.environ.get("KV_GB", 64)) << 30,
    fused_decode_max_rows=C,
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
for i in range(C):
    ids = list(map(int, rng.integers(1, cfg.vocab_size, P)))
    llm.add_request(ids, SamplingParams(max_tokens=400, ignore_eos=True), request_id=f"r{i}")
desc = None
for _ in range(600):
    llm.step()
    if hasattr(seen[-1], "steps") and seen[-1].key.R == C:
        desc = seen[-1]
        break
assert desc is not None, "no fused step"
key = r.executable_key(desc)
packed = r.upload(desc)
for name, extra in VARIANTS.items():
    EXTRA.clear()
    EXTRA.update(extra)
    t = time.perf_counter()
    r._exe.pop(key, None)
    exe = r._compile(key, try_store=False)
    ct = time.perf_counter() - t
    text = exe.as_text()
    cc = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    r.synchronize()
    for _ in range(3):
        llm.step()
    r.synchronize()
    n0, d0 = r.invocations, r.dispatch_time
    t = time.perf_counter()
    for _ in range(10):
        llm.step()
    r.synchronize()
    step_ms = (time.perf_counter() - t) / 10 * 1e3
    disp = (r.dispatch_time - d0) / max(1, r.invocations - n0) * 1e3
    rets = []
    for _ in range(3):
        r.synchronize()
        ta = time.perf_counter()
        r.launch(key, packed)
        tb = time.perf_counter()
        r.launch(key, packed)
        tc = time.perf_counter()
        r.synchronize()
        rets.append((tb - ta, tc - tb, (time.perf_counter() - ta) / 2))
    rets = np.array(rets) * 1e3
    t = time.perf_counter()
    for _ in range(10):
        r.launch(key, packed)
    r.synchronize()
    replay = (time.perf_counter() - t) / 10 * 1e3
    print(
        f"{name:12s} compile {ct:5.1f} s | LLM.step {step_ms:6.2f} ms (dispatch {disp:5.2f}) | launch returns "
        f"{rets[1:, 0].mean():6.2f} / {rets[1:, 1].mean():6.2f} ms, per step {rets[1:, 2].mean():6.2f} | replay "
        f"{replay:6.2f} ms a token | {cc}",
        flush=True,
    )
print("done", flush=True)
