"""Tensor parallelism (ouro_jax/parallel.py) and multi-process initialisation (ouro_jax/distributed.py).

The main test process has already initialised JAX with one CPU device, so everything that needs
several devices runs in a subprocess with ``--xla_force_host_platform_device_count`` set before
JAX is imported (bounded in time). TP=2 must give the token ids and exit depths of one device
(float32, highest matmul precision), every prefill mode, fixed depth and early exit.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ouro_jax import LLM, get_preset
from ouro_jax.distributed import distributed_config
from ouro_jax.model import fuse_layer_params
from ouro_jax.parallel import check_tensor_parallel, param_specs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
import json
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
"""


def run_script(body: str, devices: int = 4, timeout: int = 600, env: dict | None = None) -> dict:
    """Run ``body`` in a fresh interpreter with ``devices`` host devices; it prints one JSON line last."""
    code = PRELUDE.format(devices=devices) + textwrap.dedent(body)
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    full_env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ validation
def test_fused_decode_with_tensor_parallel_is_refused_on_the_gpu(monkeypatch):
    """XLA segfaults compiling the fused step under shard_map on the GPU: an explicit request is refused
    before any weight is read (the GPU default turns fused steps off; the CPU keeps them)."""
    import ouro_jax.llm as llm_mod

    monkeypatch.setattr(llm_mod, "check_tensor_parallel", lambda c, n: n)  # 2 "devices" in a 1-device test
    monkeypatch.setattr(llm_mod.jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="fused_decode_max_rows must be 0 with tensor_parallel_size"):
        LLM("tiny-gqa", tensor_parallel_size=2, fused_decode_max_rows=8)


def test_tensor_parallel_size_is_validated():
    cfg = get_preset("tiny-gqa")  # H=4, KVH=2, F=80, V=96
    assert check_tensor_parallel(cfg, 1) == 1
    assert check_tensor_parallel(cfg, 2, num_devices=2) == 2
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="positive integer"):
            check_tensor_parallel(cfg, bad)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tensor_parallel(cfg, 4, num_devices=4)  # 4 q heads, but only 2 KV heads
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel(cfg.replace(intermediate_size=81), 2, num_devices=2)
    with pytest.raises(ValueError, match="vocab_size"):
        check_tensor_parallel(cfg.replace(vocab_size=97), 2, num_devices=2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_tensor_parallel(cfg.replace(num_attention_heads=3, num_key_value_heads=1), 2, num_devices=2)
    with pytest.raises(ValueError, match="needs 2 devices"):
        check_tensor_parallel(cfg, 2, num_devices=1)


def test_llm_rejects_tensor_parallel_before_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("weights were loaded before the check")

    monkeypatch.setattr(LLM, "_load", staticmethod(boom))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LLM("tiny-gqa", tensor_parallel_size=4, progress=False)
    with pytest.raises(ValueError, match="devices"):  # this process has one device
        LLM("tiny", tensor_parallel_size=2, progress=False)


def test_param_specs_follow_megatron_layout():
    d, f, v = 8, 12, 16
    layer = {
        "self_attn": {k: {"kernel": np.zeros((d, d))} for k in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "mlp": {"gate_proj": {"kernel": np.zeros((d, f))}, "up_proj": {"kernel": np.zeros((d, f))}},
        "input_layernorm": {"scale": np.zeros(d)},
    }
    layer["mlp"]["down_proj"] = {"kernel": np.zeros((f, d))}
    tree = {
        "top": {
            "embed_tokens": {"embedding": np.zeros((v, d))},
            "lm_head": {"kernel": np.zeros((d, v))},
            "norm": {"scale": np.zeros(d)},
            "early_exit_gate": {"kernel": np.zeros((d, 1)), "bias": np.zeros(1)},
        },
        "layers": {"layers_0": layer},
    }
    s = param_specs(tree)
    t = ("tp",)
    assert tuple(s["top"]["embed_tokens"]["embedding"]) == (*t, None)
    assert tuple(s["top"]["lm_head"]["kernel"]) == (None, *t)
    assert tuple(s["top"]["norm"]["scale"]) == ()
    assert tuple(s["top"]["early_exit_gate"]["kernel"]) == ()
    for name in ("q_proj", "k_proj", "v_proj"):
        assert tuple(s["layers"]["layers_0"]["self_attn"][name]["kernel"]) == (None, *t)
    assert tuple(s["layers"]["layers_0"]["self_attn"]["o_proj"]["kernel"]) == (*t, None)
    assert tuple(s["layers"]["layers_0"]["mlp"]["gate_proj"]["kernel"]) == (None, *t)
    assert tuple(s["layers"]["layers_0"]["mlp"]["down_proj"]["kernel"]) == (*t, None)
    assert tuple(s["layers"]["layers_0"]["input_layernorm"]["scale"]) == ()
    # the runner's fused kernels: Q/K/V [D, G, g + 2, hd] by KV-head group, gate/up [D, 2, F] by F
    cfg = dataclasses.replace(
        get_preset("tiny"), hidden_size=d, num_attention_heads=2, num_key_value_heads=2, head_dim=4
    )
    fused = fuse_layer_params(layer, cfg, np.concatenate)
    fs = param_specs({"layers": {"layers_0": fused}})
    assert tuple(fs["layers"]["layers_0"]["self_attn"]["qkv_proj"]["kernel"]) == (None, *t, None, None)
    assert tuple(fs["layers"]["layers_0"]["mlp"]["gate_up_proj"]["kernel"]) == (None, None, *t)
    assert "q_proj" not in fs["layers"]["layers_0"]["self_attn"] and "up_proj" not in fs["layers"]["layers_0"]["mlp"]


# ----------------------------------------------------------------------- shards (subprocess)
@pytest.mark.slow  # ~15 s: a fresh interpreter with 4 devices, weights drawn and placed twice
def test_shards_hold_their_slice():
    out = run_script(
        """
        from weights.config import get_preset
        from ouro_jax.engine_config import EngineConfig
        from ouro_jax.runner import ModelRunner
        from weights.random_init import random_params
        cfg = get_preset("tiny")
        p = random_params(cfg, 0)
        tp2 = EngineConfig(tensor_parallel_size=2)
        r = ModelRunner(cfg, p, num_blocks=8, block_size=4, num_ring_rows=16, engine=tp2)
        shapes = lambda x: sorted({tuple(s.data.shape) for s in x.addressable_shards})
        devs = lambda x: sorted(d.id for d in x.sharding.device_set)
        layer = r.params["layers"]["layers_0"]
        res = dict(
            kv=shapes(r.k_pool), kv_devices=devs(r.k_pool), v=shapes(r.v_pool), ring=shapes(r.ring),
            qkv=shapes(layer["self_attn"]["qkv_proj"]["kernel"]), o=shapes(layer["self_attn"]["o_proj"]["kernel"]),
            gate_up=shapes(layer["mlp"]["gate_up_proj"]["kernel"]),
            down=shapes(layer["mlp"]["down_proj"]["kernel"]),
            norm=shapes(layer["input_layernorm"]["scale"]),
            embed=shapes(r.params["top"]["embed_tokens"]["embedding"]),
            head=shapes(r.params["top"]["lm_head"]["kernel"]),
            gate=shapes(r.params["top"]["early_exit_gate"]["kernel"]),
        )
        print(json.dumps(res))
        """,
        timeout=120,
    )
    c = get_preset("tiny")  # L=2, H=KVH=4, hd=16, D=64, F=96, V=128
    L, D, F, V, hd = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    r = {k: [tuple(s) for s in v] if k != "kv_devices" else v for k, v in out.items()}
    assert r["kv"] == r["v"] == [(L, c.num_key_value_heads // 2, 8, 4, hd)]  # half the KV heads each
    assert r["kv_devices"] == [0, 1]  # the first N devices of 4
    assert r["ring"] == [(16, D)]  # replicated
    # the runner's fused Q/K/V kernel [D, G, g + 2, hd] splits by KV-head group, gate/up [D, 2, F] by F
    G, g = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
    assert r["qkv"] == [(D, G // 2, g + 2, hd)]
    assert r["o"] == [(c.q_size // 2, D)]
    assert r["gate_up"] == [(D, 2, F // 2)]
    assert r["down"] == [(F // 2, D)]
    assert r["norm"] == [(D,)]
    assert r["embed"] == [(V // 2, D)]
    assert r["head"] == [(D, V // 2)]
    assert r["gate"] == [(D, 1)]


# -------------------------------------------------------------------- equivalence (subprocess)
EQUIVALENCE = """
from ouro_jax import LLM, SamplingParams, get_preset
from weights.random_init import random_params

cfg = get_preset("{preset}")
params = random_params(cfg, 0)
rng = np.random.default_rng(0)
prompts = [list(map(int, rng.integers(1, cfg.vocab_size, n))) for n in (1, 5, 13, 30)]
base = dict(params=params, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8, block_size=4,
            max_model_len=64, buckets=[16], progress=False, **{extra})
sps = dict(
    fixed=SamplingParams(max_tokens=5, ignore_eos=True),
    early=SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.6),
    sampled=SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.6, temperature=0.8, top_p=0.9, seed=3),
)
res, diverged = {{}}, []
for mode in {modes}:
    for tp in (1, 2):
        llm = LLM(cfg, prefill_mode=mode, tensor_parallel_size=tp, **base)
        if tp == 2:  # every shard's copy of the replicated results must agree (one decision, not N)
            launch = llm.runner.launch

            def checked(key, packed, sample=False, mask=None, adjust=None, launch=launch):
                gates, tokens, records = launch(key, packed, sample, mask, adjust)
                for arr in (gates, tokens, llm.runner.ring):
                    shards = [np.asarray(s.data) for s in arr.addressable_shards]
                    if any(not np.array_equal(shards[0], s) for s in shards[1:]):
                        diverged.append(str(key))
                return gates, tokens, records

            llm.runner.launch = checked
        for name, sp in sps.items():
            outs = llm.generate(prompts, sp, use_tqdm=False)
            res[f"{{mode}}/{{name}}/{{tp}}"] = [[o.token_ids, o.exit_depths] for o in outs]
print(json.dumps(dict(res=res, diverged=diverged)))
"""


def _check_equivalence(out):
    res = out["res"]
    assert not out["diverged"], f"shards disagreed on {out['diverged'][:3]}"
    pairs = sorted({k.rsplit("/", 1)[0] for k in res})
    assert pairs
    for k in pairs:
        one, two = res[k + "/1"], res[k + "/2"]
        assert one == two, k
    # the early-exit runs really exit early somewhere, so exit depths are being compared
    depths = [d for k in pairs if "/early/" in k + "/" for _, ds in res[k + "/1"] for d in ds]
    assert min(depths) < max(depths)


@pytest.mark.slow  # ~50 s on a shared 2-core CPU: two engines compiled in a fresh interpreter
def test_tp2_matches_one_device_gqa():
    """GQA preset (KVH=2: one KV head per shard), split prefill."""
    body = EQUIVALENCE.format(preset="tiny-gqa", modes=["split"], extra={})
    _check_equivalence(run_script(body, timeout=300))


@pytest.mark.slow
def test_tp2_matches_one_device_every_prefill_mode():
    body = EQUIVALENCE.format(preset="tiny", modes=["split", "mixed", "wavefront"], extra={})
    _check_equivalence(run_script(body, timeout=900))


@pytest.mark.slow
def test_tp2_matches_one_device_fused_two_tokens():
    """Fused decode steps of two tokens (``fused_step.lockstep``: the previous token's samples fed
    to the next token's prelude on the device), under shard_map on CPU devices."""
    extra = dict(fused_decode_max_rows=4, fused_decode_tokens=2)
    body = EQUIVALENCE.format(preset="tiny-gqa", modes=["split"], extra=extra)
    out = run_script(body, timeout=300)
    _check_equivalence(out)


# ------------------------------------------------------------------------------ multi-process
def test_distributed_config_parses_env():
    assert distributed_config({}) is None
    assert distributed_config({"OURO_JAX_DISTRIBUTED": "0"}) is None
    env = {
        "OURO_JAX_DISTRIBUTED": "1",
        "OURO_JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "OURO_JAX_NUM_PROCESSES": "2",
        "OURO_JAX_PROCESS_ID": "1",
    }
    assert distributed_config(env) == dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    # JAX's own names are accepted; unset values are left to JAX's cluster detection
    assert distributed_config({"OURO_JAX_DISTRIBUTED": "true", "JAX_COORDINATOR_ADDRESS": "h:1"}) == dict(
        coordinator_address="h:1"
    )
    for bad, match in (
        ({"OURO_JAX_DISTRIBUTED": "maybe"}, "OURO_JAX_DISTRIBUTED"),
        ({**env, "OURO_JAX_COORDINATOR_ADDRESS": "nohostport"}, "host:port"),
        ({**env, "OURO_JAX_NUM_PROCESSES": "two"}, "integer"),
        ({**env, "OURO_JAX_NUM_PROCESSES": "0"}, ">= 1"),
        ({**env, "OURO_JAX_PROCESS_ID": "2"}, "not below"),
    ):
        with pytest.raises(ValueError, match=match):
            distributed_config(bad)


def test_distributed_initialize_one_process_builds_mesh():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(
        OURO_JAX_DISTRIBUTED="1",
        OURO_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        OURO_JAX_NUM_PROCESSES="1",
        OURO_JAX_PROCESS_ID="0",
    )
    out = run_script(
        """
        from ouro_jax.distributed import initialize_from_env
        ran = initialize_from_env()  # before any device is touched
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        from ouro_jax.parallel import make_mesh
        mesh = make_mesh(2)
        f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()))
        print(json.dumps(dict(ran=ran, processes=jax.process_count(), index=jax.process_index(),
                              mesh=[d.id for d in mesh.devices.flat], psum=np.asarray(f(jnp.arange(4.0))).tolist())))
        """,
        devices=2,
        timeout=120,
        env=env,
    )
    assert out == dict(ran=True, processes=1, index=0, mesh=[0, 1], psum=[2.0, 4.0])
