"""benchmarks/profile_step.py: the aggregation on made-up kernels, the trace parsing on a fake GPU
plane, and the script end to end on the tiny preset (CPU: the host-plane fallback)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace as NS

import jax
import pytest

from benchmarks import profile_step as ps
from benchmarks.run import Harness
from benchmarks.workloads import suite_shape


# --------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize(
    "raw,base",
    [
        ("loop_add_fusion_12", "loop_add_fusion"),
        ("loop_add_fusion.3", "loop_add_fusion"),
        ("input_reduce_fusion_3_1", "input_reduce_fusion"),
        ("fusion", "fusion"),
        ("copy.7", "copy"),
        ("ragged_paged_attention_bq16_bk64", "ragged_paged_attention_bq16_bk64"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"),
        (
            "cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_32x6_tn_align8",
            "cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_32x6_tn_align8",
        ),
        ("void cutlass::Kernel2<Op_1>(Params_2)", "void cutlass::Kernel2<Op_1>(Params_2)"),
    ],
)
def test_base_name(raw, base):
    assert ps.base_name(raw) == base


@pytest.mark.parametrize(
    "name,cat",
    [
        ("ragged_paged_attention_bq16_bk64", "attention"),
        ("ragged_paged_attention_combine", "attention"),
        ("write_kv_kernel", "kv_write"),
        ("copy_kv_slots", "kv_write"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_cublas", "gemm"),
        ("triton_gemm_dot_3", "gemm"),
        ("loop_dot_fusion", "gemm"),
        ("dot.3", "gemm"),
        ("sort_1", "sort_topk"),
        ("input_scatter_fusion_2", "scatter_gather"),
        ("dynamic_update_slice_fusion", "scatter_gather"),
        ("MemcpyD2D", "copy_memset"),
        ("Memset", "copy_memset"),
        ("copy_12", "copy_memset"),
        ("loop_multiply_fusion", "xla_fusion"),
        ("input_reduce_fusion", "xla_fusion"),
        ("wrapped_concatenate", "xla_fusion"),
        ("reduce_3", "xla_fusion"),
        ("some_custom_kernel", "other"),
    ],
)
def test_categorise(name, cat):
    assert ps.categorise(name) == cat


def test_parse_bucket():
    assert ps.parse_bucket("decode:8", 1024, 4096) == dict(bucket="decode:8", kind="decode", R=8, context=1024)
    assert ps.parse_bucket("prefill:1024", 1024, 4096)["context"] == 4096
    assert ps.parse_bucket("prefill:64:512", 1024, 4096)["context"] == 512
    for bad in ("decode", "sample:8", "decode:x", "decode:0", "decode:8:9:10"):
        with pytest.raises(ValueError):
            ps.parse_bucket(bad, 1024, 4096)


def _ev(name, start, dur, **stats):
    return dict(name=name, start_ns=start, duration_ns=dur, stats=stats or None)


def test_aggregate_synthetic_events():
    # two invocations' worth: 5 kernels, a memset on a second stream overlapping a fusion
    evs = [
        _ev("loop_add_fusion_1", 0, 100, hlo_op="loop_add_fusion.1"),
        _ev("memset", 100, 100),
        _ev("loop_add_fusion_2", 150, 50),
        _ev("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 200, 300, hlo_op="custom-call.4"),
        _ev("ragged_paged_attention_bq16_bk64", 600, 200),
    ]
    hlo = {
        "loop_add_fusion.1": "jit(_step)/OuroModel.recurrent/layers_3/mlp/add",
        "loop_add_fusion.2": "jit(_step)/OuroModel.recurrent/layers_4/mlp/add",
        "custom-call.4": "jit(_step)/OuroModel.recurrent/layers_4/mlp/down_proj/dot_general",
    }
    a = ps.aggregate(evs, 2, top=3, hlo_ops=hlo)
    total = 750.0
    assert a["kernels"] == 5 and a["kernels_per_inv"] == 2.5
    assert a["distinct_kernels"] == 4 and a["distinct_raw_kernels"] == 5
    assert a["kernel_ms_per_inv"] == pytest.approx(total / 2 / 1e6)
    assert a["busy_ms_per_inv"] == pytest.approx(700 / 2 / 1e6)  # [0, 500] and [600, 800]
    assert a["span_ms_per_inv"] == pytest.approx(800 / 2 / 1e6)
    assert a["idle_in_span_ms_per_inv"] == pytest.approx(100 / 2 / 1e6)
    cats = a["categories"]
    assert list(cats) == ["gemm", "attention", "xla_fusion", "copy_memset"]  # by time
    assert cats["gemm"]["share"] == pytest.approx(300 / total)
    assert cats["xla_fusion"]["ms_per_inv"] == pytest.approx(150 / 2 / 1e6)
    assert cats["xla_fusion"]["count_per_inv"] == 1.0 and cats["xla_fusion"]["distinct_kernels"] == 1
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    top = a["top_kernels"]
    assert [k["name"] for k in top] == [
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT",
        "ragged_paged_attention_bq16_bk64",
        "loop_add_fusion",
    ]  # top=3 cuts the memset
    fus = top[2]
    assert fus["count"] == 2 and fus["distinct_raw_names"] == 2
    assert set(fus["raw_names"]) == {"loop_add_fusion_1", "loop_add_fusion_2"}
    assert fus["mean_us"] == pytest.approx(75 / 1e3) and fus["category"] == "xla_fusion"
    assert fus["op"] == "add" and fus["op_name"].endswith("mlp/add")
    assert top[0]["hlo_ops"] == ["custom-call.4"] and top[0]["op"] == "dot_general"
    assert top[0]["example_stats"] == {"hlo_op": "custom-call.4"}
    # the raw-name table keeps instances apart; JAX ops and scopes (layers together)
    assert len(a["top_raw_kernels"]) == 3 and a["top_raw_kernels"][0]["name"].startswith("nvjet")
    assert a["by_op"]["add"]["count"] == 2 and a["by_op"]["dot_general"]["total_ms"] == pytest.approx(300 / 1e6)
    assert a["by_op"]["(unmapped)"]["count"] == 2
    assert a["by_scope"]["OuroModel.recurrent/layers_*/mlp"]["count"] == 2
    assert a["by_scope"]["OuroModel.recurrent/layers_*/mlp/down_proj"]["count"] == 1
    gaps = a["inter_kernel_gap_us"]
    assert gaps["median"] == pytest.approx(0.0) and gaps["mean"] == pytest.approx(100 / 4 / 1e3)


def test_aggregate_gap_sites():
    # idle gaps above GAP_SITE_MIN_NS are charged to (kernel before, kernel after), numbering stripped
    us = 1000
    evs = [
        _ev("gemm_fusion_dot_1", 0, 10 * us),
        _ev("pallas_call_1", 15 * us, 5 * us),  # 5 us gap after the GEMM
        _ev("gemm_fusion_dot_2", 21 * us, 10 * us),  # 1 us: below the threshold
        _ev("pallas_call_2", 40 * us, 5 * us),  # 9 us
        _ev("loop_add_fusion", 48 * us, 1 * us),  # 3 us
    ]
    a = ps.aggregate(evs, 2)
    sites = a["gap_sites"]
    assert [(g["before"], g["after"]) for g in sites] == [
        ("gemm_fusion_dot", "pallas_call"),
        ("pallas_call", "loop_add_fusion"),
    ]
    assert sites[0]["count_per_inv"] == 1.0 and sites[0]["mean_us"] == pytest.approx(7.0)
    assert sites[0]["ms_per_inv"] == pytest.approx(14 * us / 2 / 1e6)
    assert sites[1]["ms_per_inv"] == pytest.approx(3 * us / 2 / 1e6)
    assert ps.aggregate(evs[:1], 1)["gap_sites"] == []


def test_aggregate_empty():
    a = ps.aggregate([], 4)
    assert a["kernels"] == 0 and a["busy_ms_per_inv"] == 0 and a["categories"] == {} and a["by_op"] is None


def test_hlo_op_names():
    text = """ENTRY %main.3 (p: f32[4]) -> f32[4] {
  %loop_add_fusion.1 = f32[4]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(_step)/a/add" stack_frame_id=1}
  ROOT %copy.2 = f32[4]{0} copy(%loop_add_fusion.1), metadata={op_name="jit(_step)/b/copy"}
  %c = f32[] constant(0)
}"""
    assert ps.hlo_op_names(text) == {"loop_add_fusion.1": "jit(_step)/a/add", "copy.2": "jit(_step)/b/copy"}


def _plane(name, lines):
    return NS(
        name=name,
        lines=[
            NS(name=ln, events=[NS(name=n, start_ns=s, duration_ns=d, stats=st) for n, s, d, st in evs])
            for ln, evs in lines
        ],
    )


def test_kernel_events_picks_the_gpu_plane_and_its_stream_lines():
    prof = NS(
        planes=[
            _plane("/host:CPU", [("python", [("PjitFunction(_step)", 0, 500, [])])]),
            _plane(
                "/device:GPU:0",
                [
                    ("XLA Modules", [("jit__step(1)", 0, 900, []), ("jit__step(1)", 1000, 900, [])]),
                    ("XLA Ops", [("fusion.1", 10, 100, [])]),
                    (
                        "Stream #13(Kernel,Memset)",
                        [("fusion_1", 10, 100, [("hlo_op", "fusion.1"), ("other", 1)]), ("Memset", 200, 5, [])],
                    ),
                    ("Stream #14(MemcpyD2D)", [("MemcpyD2D", 300, 7, [])]),
                ],
            ),
            _plane("/device:GPU:1", [("Stream #1", [("x", 0, 1, [])])]),
        ]
    )
    plane, evs, info = ps.kernel_events(prof, 0)
    assert plane == "/device:GPU:0"
    assert [e["name"] for e in evs] == ["fusion_1", "Memset", "MemcpyD2D"]
    assert evs[0]["stats"] == {"hlo_op": "fusion.1"}
    assert info["xla_modules"] == {"jit__step(1)": 2}
    assert info["kernel_lines"] == ["Stream #13(Kernel,Memset)", "Stream #14(MemcpyD2D)"]
    # no /device:GPU:<i> plane of that index: any device plane; no device plane at all: the host's pools
    assert ps.kernel_events(prof, 5)[0] == "/device:GPU:0"
    host = NS(
        planes=[
            _plane(
                "/host:CPU",
                [
                    ("python", [("PjitFunction(_step)", 0, 500, [])]),
                    (
                        "tf_XLAEigen/1",
                        [
                            ("ThunkExecutor::Execute", 0, 400, []),
                            ("fusion.1", 10, 50, []),
                            ("end: fusion.1", 60, 1, []),
                            ("ThreadpoolListener::Record", 70, 0, []),
                        ],
                    ),
                ],
            )
        ]
    )
    plane, evs, info = ps.kernel_events(host, 0)
    assert plane is None and [e["name"] for e in evs] == ["fusion.1"]
    with pytest.raises(RuntimeError):
        ps.kernel_events(NS(planes=[_plane("/host:metadata", [])]), 0)


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def harness():
    shape = suite_shape(0.02, 0.05, max_num_seqs=8, max_num_batched_tokens=16, buckets=(8, 16))
    return Harness("tiny", None, shape, quick_ceilings=True, progress=False)


ARGS = [
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--decode-context",
    "32",
    "--prefill-context",
    "64",
    "--prefill-segment",
    "16",
    "--no-progress",
    "--top",
    "10",
]


def test_time_uploads_slot_keeps_one_buffer_and_the_descriptor():
    """Each variant launches the descriptor's words; ``slot`` always from the same device buffer
    (so an executable's recorded addresses stay valid), ``uploaded`` and ``ahead`` from fresh ones."""
    import numpy as np

    words = np.arange(40, dtype=np.int32).reshape(5, 8)
    seen = {v: [] for v in ps.UPLOAD_VARIANTS}
    variant = iter(v for v in ps.UPLOAD_VARIANTS for _ in range(4))  # the launches in order, 4 each

    class Runner:
        ring = jax.numpy.zeros(3)

        def put(self, a):
            return jax.device_put(a)

        def upload(self, desc):
            return self.put(desc.pack())

        def launch(self, key, packed):
            np.testing.assert_array_equal(np.asarray(packed), words)
            seen[next(variant)].append(packed.unsafe_buffer_pointer())
            return packed[0], packed[1], None

    rec = ps.time_uploads(Runner(), "key", NS(pack=lambda: words), reps=4)
    assert set(rec) == {f"{v}_{m}_ms_per_inv" for v in ps.UPLOAD_VARIANTS for m in ("wall", "dispatch")}
    assert len(set(seen["slot"])) == 1
    assert all(len(v) == 4 for v in seen.values())


@pytest.mark.slow  # with the next test, the only users of the `harness` fixture (compiles an engine)
def test_main_on_tiny(harness, tmp_path):
    out = str(tmp_path / "sub" / "profile_step.json")
    res = ps.main(ARGS + ["--buckets", "decode:8", "prefill:16", "decode:32", "--out", out], harness=harness)
    with open(out) as f:
        d = json.load(f)
    assert d["benchmark"] == "profile_step" and d["preset"] == "tiny" and d["device"]
    assert {"jax_version", "backend", "ceilings", "engine_shape", "steps", "startup", "attention_impl"} <= set(d)
    assert [b["bucket"] for b in d["buckets"]] == ["decode:8", "prefill:16", "decode:32"]
    assert len(res["buckets"]) == 3
    for b in d["buckets"][:2]:
        assert "error" not in b, b.get("error")
        assert b["wall_ms_per_inv"] > 0 and b["busy_ms_per_inv"] > 0 and b["kernels_per_inv"] > 0
        for variant in ps.UPLOAD_VARIANTS:
            assert b[f"{variant}_wall_ms_per_inv"] > 0 and b[f"{variant}_dispatch_ms_per_inv"] > 0
        assert b["floor_ms"] > 0 and b["floor_bound"] in ("bandwidth", "flops")
        assert b["gap_ms_per_inv"] == pytest.approx(b["wall_ms_per_inv"] - b["busy_ms_per_inv"])
        assert b["rows"] == b["R"] and b["steps"] == 2
        if jax.default_backend() == "cpu":
            assert b["device_plane"] is None and "note" in b
        assert b["categories"] and sum(c["share"] for c in b["categories"].values()) == pytest.approx(1.0)
        assert 0 < len(b["top_kernels"]) <= 10
        for k in b["top_kernels"]:
            assert {"name", "category", "ms_per_inv", "count_per_inv", "share", "raw_names"} <= set(k)
        assert b["by_scope"]  # the compiled HLO maps thunks to JAX scopes
    assert d["buckets"][0]["kind"] == "decode" and d["buckets"][0]["coda"] == 8
    assert d["buckets"][1]["kind"] == "prefill" and d["buckets"][1]["coda"] == 0
    assert d["buckets"][1]["segments"] == 1 and d["buckets"][1]["context"] == 64
    # a bucket the engine does not have: an error in its entry, after the others
    assert "error" in d["buckets"][2] and "not one of the engine's row buckets" in d["buckets"][2]["error"]


@pytest.mark.slow
def test_profile_failure_keeps_the_wall_time(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(jax.profiler, "ProfileData", None)
    out = str(tmp_path / "p.json")
    ps.main(ARGS + ["--buckets", "decode:8", "--out", out], harness=harness)
    with open(out) as f:
        (b,) = json.load(f)["buckets"]
    assert b["wall_ms_per_inv"] > 0 and "ProfileData" in b["error"] and "busy_ms_per_inv" not in b
    assert os.path.exists(out)


def test_small_buckets_only_get_a_shape_the_scheduler_accepts(monkeypatch):
    """``--buckets decode:8`` alone: the engine's batch is 8 rows, so it must not ask for the suite's
    128 streams (the scheduler refuses max_num_seqs > max_num_batched_tokens); an explicit
    ``--max-num-seqs`` still wins."""
    import benchmarks.run as run_mod

    seen = []

    class Stop(Exception):
        pass

    def fake(a, shape):
        seen.append(shape)
        raise Stop

    monkeypatch.setattr(run_mod, "harness_from_args", fake)
    for extra, want in (([], (8, 8)), (["--max-num-seqs", "4"], (4, 8)), (["--buckets", "prefill:1024"], (128, 1024))):
        with pytest.raises(Stop):
            ps.main(["--preset", "tiny", "--buckets", "decode:8", *extra, "--out", "/dev/null"])
        assert (seen[-1].max_num_seqs, seen[-1].max_num_batched_tokens) == want


def test_traced_loops_count_the_fused_step_launched_ahead():
    """Run 54's window: 8 steps applied 8 fused tokens (32 loops) and launched 9 (one ahead), so the
    trace held 36 loops' kernels; dividing by the 32 applied put busy time at 106-111% of TPOT."""
    s0 = dict(invocations=100, fused_loops=40, fused_tokens=11, fused_row_tokens=10)
    s1 = dict(invocations=132, fused_loops=72, fused_tokens=20, fused_row_tokens=18)
    assert ps.traced_loops(s0, s1) == 36
    # gated exits: 2.5 loops a token applied, plus 3 loop-by-loop invocations
    s1 = dict(invocations=123, fused_loops=60, fused_tokens=20, fused_row_tokens=18)
    assert ps.traced_loops(s0, s1) == round(3 + 2.5 * 9)
    assert ps.traced_loops(dict(invocations=5), dict(invocations=12)) == 7  # no fused step


def test_profile_engine_window_keeps_the_host_spans_per_launch():
    """``host_top``: the window's host trace, its largest spans as ``[ms, count]`` per launch."""
    f = jax.jit(lambda x: x * 2 + 1)
    x = jax.numpy.ones((64, 64))
    counts = dict(invocations=0, launches=0, tokens=0, fused_launches=0)

    def window():
        for _ in range(3):
            jax.block_until_ready(f(x))
            counts["invocations"] += 1
            counts["launches"] += 1
        return 0.01

    llm = NS(stats=lambda: dict(counts), runner=NS(device=jax.devices()[0]))
    out = ps.profile_engine_window(llm, window, host_top=5)
    assert out["launches"] == 3 and out["loops"] == 3
    spans = out["host_spans_ms_per_launch"]
    assert 0 < len(spans) <= 5 and all(" | " in k for k in spans)
    assert all(ms >= 0 and n > 0 for ms, n in spans.values())
    ranked = [ms for ms, _ in spans.values()]
    assert ranked == sorted(ranked, reverse=True)
    assert "host_spans_ms_per_launch" not in ps.profile_engine_window(llm, window)
