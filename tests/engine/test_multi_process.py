"""Several processes as one JAX runtime (docs/multi-gpu.md, "More hosts"), on one machine: two CPU
processes initialised from the environment (``ouro_jax.distributed.initialize_from_env``) form a
2-device mesh across processes (JAX's CPU collectives: gloo) and run the tiny model with TP=2 split
across them, in lockstep (each process runs the same deterministic ``generate``): the tokens and
exit depths equal one device's, which each process computes on its own local device.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script() -> dict:
    import jax
    import numpy as np

    from ouro_jax.distributed import initialize_from_env

    assert initialize_from_env()
    from ouro_jax import LLM, SamplingParams
    from ouro_jax.parallel import make_mesh

    res = dict(
        process=jax.process_index(),
        processes=jax.process_count(),
        devices=[d.process_index for d in jax.devices()],
        local=[d.id for d in jax.local_devices()],
    )
    # a collective across processes: each contributes its own value
    mesh = make_mesh(2)
    P = jax.sharding.PartitionSpec
    x = jax.make_array_from_process_local_data(
        jax.sharding.NamedSharding(mesh, P("tp")), np.full((1, 3), jax.process_index() + 1, np.float32)
    )
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()))(x)
    res["psum"] = np.asarray(psum.addressable_shards[0].data).tolist()
    base = dict(
        max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=8, block_size=4, max_model_len=64,
        buckets=[16], fused_decode_max_rows=0, progress=False, compile_cache_dir="off",
    )  # fmt: skip
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]
    sp = SamplingParams(max_tokens=5, ignore_eos=True, exit_threshold=0.6)
    tp = LLM("tiny", tensor_parallel_size=2, **base)  # the mesh spans both processes
    res["kv_devices"] = sorted(d.process_index for d in tp.runner.k_pool.sharding.device_set)
    got = tp.generate(prompts, sp, use_tqdm=False)
    one = LLM("tiny", devices=jax.local_devices()[:1], **base)  # this process's own device only
    want = one.generate(prompts, sp, use_tqdm=False)
    res["tp2"] = [[o.token_ids, o.exit_depths] for o in got]
    res["tp1"] = [[o.token_ids, o.exit_depths] for o in want]
    jax.distributed.shutdown()
    return res


@pytest.mark.slow  # ~20 s: two interpreters, a coordinator, two compiles each
def test_two_processes_form_one_mesh_and_run_tp2():
    port = _free_port()
    procs = []
    for i in range(2):
        env = dict(
            os.environ,
            PYTHONPATH=ROOT,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false",
            JAX_DEFAULT_MATMUL_PRECISION="highest",
            OURO_JAX_DISTRIBUTED="1",
            OURO_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            OURO_JAX_NUM_PROCESSES="2",
            OURO_JAX_PROCESS_ID=str(i),
        )
        cmd = [sys.executable, os.path.abspath(__file__), "worker"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, r in enumerate(outs):
        assert r["process"] == i and r["processes"] == 2
        assert sorted(r["devices"]) == [0, 1] and len(r["local"]) == 1  # the global list: one device per process
        assert r["psum"] == [[3.0, 3.0, 3.0]]  # 1 + 2, summed across the processes
        assert r["kv_devices"] == [0, 1]  # the KV pool split over both processes' devices
        assert r["tp2"] == r["tp1"], (r["tp2"], r["tp1"])  # TP across processes == one device
        assert any(d < 3 for _, depths in r["tp2"] for d in depths)  # early exit was exercised
    assert outs[0]["tp2"] == outs[1]["tp2"]  # one decision on both processes


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    print(json.dumps(_script()))
