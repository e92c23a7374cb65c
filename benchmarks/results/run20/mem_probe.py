"""Temp memory of fused decode steps by rows against what the device has left with the engine's pools."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
import jax  # noqa: E402

from ouro_jax import LLM, get_preset  # noqa: E402
from ouro_jax.model import init_params  # noqa: E402

cfg = get_preset(os.environ.get("PRESET", "ouro-1.4b"))
llm = LLM(
    cfg,
    params=init_params(cfg, 0, "bfloat16"),
    dtype="bfloat16",
    max_num_seqs=128,
    max_num_batched_tokens=1024,
    buckets=[8, 32, 64, 128, 1024],
    max_model_len=int(os.environ.get("MAXLEN", 1280)),
    gpu_memory_utilization=0.9,
    fused_decode_max_rows=128,
    warmup=False,
    progress=False,
    executable_store=False,
)
st = jax.devices()[0].memory_stats() or {}
free = st.get("bytes_limit", 0) - st.get("bytes_in_use", 0)
limit, used = st.get("bytes_limit", 0) / 1e9, st.get("bytes_in_use", 0) / 1e9
pool = llm.stats()["kv_cache_bytes"] / 1e9
print(f"pool {pool:.1f} GB; device limit {limit:.1f} GB, in use {used:.1f} GB, free {free / 1e9:.2f} GB")
r = llm.runner
for key in llm.executable_keys():
    if hasattr(key, "C") and not hasattr(key, "R"):
        continue  # samplers
    rows = key.R if hasattr(key, "R") else key[0].R
    if rows not in (32, 128):
        continue
    m = r._compile(key).memory_analysis()
    temp, out, alias = m.temp_size_in_bytes / 1e6, m.output_size_in_bytes / 1e6, m.alias_size_in_bytes / 1e9
    print(f"{str(key)[:60]:<60} temp {temp:9.1f} MB  output {out:9.1f} MB  alias {alias:7.1f} GB")
