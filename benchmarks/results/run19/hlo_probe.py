"""Optimized HLO of the engine's fused decode step (8 rows, 1 token) and of generate() b=1, to see
how XLA schedules each while body (command buffers) on the GPU (session 10 probe)."""

import gzip
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax import LLM, get_preset
from ouro_jax import static_generate as sg
from ouro_jax.model import init_params

out = os.environ.get("OUT", "/tmp")
cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
params = init_params(cfg, 0, "bfloat16")
t = time.perf_counter()
llm = LLM(
    cfg,
    params=params,
    dtype="bfloat16",
    max_num_seqs=8,
    max_num_batched_tokens=128,
    buckets=[8, 128],
    max_model_len=2048,
    kv_cache_bytes=4 << 30,
    progress=False,
)
print("engine built", time.perf_counter() - t)
keys = [k for k in llm.runner.executables() if isinstance(k, tuple) and len(k) == 2 and hasattr(k[0], "R")]
print("fused keys", keys)


def summary(name, text):
    with gzip.open(os.path.join(out, name + ".hlo.txt.gz"), "wt") as f:
        f.write(text)
    print(
        name,
        "chars",
        len(text),
        "command_buffer",
        text.count("command_buffer"),
        "while(",
        len(re.findall(r"= .*\bwhile\(", text)),
        "custom-call",
        text.count("custom-call("),
        "conditional",
        text.count("conditional("),
        "copy-start",
        text.count("copy-start"),
    )


for k in keys[:1]:
    summary("engine_fused", llm.runner._lower(k).compile().as_text())
bkey = [k for k in llm.runner.executables() if hasattr(k, "R") and k.R == 8][:1]
for k in bkey:
    summary("engine_loop8", llm.runner._lower(k).compile().as_text())
ids = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (1, 64)), jnp.int32)
lens = jnp.asarray([64], jnp.int32)
kw = dict(config=cfg, dtype_name="bfloat16", max_new_tokens=8, min_loops=1, max_loops=cfg.num_loops, top_k=0)
kw["kernel"] = sg.decode_kernel("auto", cfg, 1, "bfloat16")
lowered = sg._generate.lower(
    params, ids, lens, jnp.float32(1.0), jnp.float32(0.0), jnp.float32(1.0), jax.random.PRNGKey(0), **kw
)
summary("generate", lowered.compile().as_text())
