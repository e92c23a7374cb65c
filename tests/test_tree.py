"""The tree keeps its shape: results are data, retired switches stay retired, tests stay grouped."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

# switches of experiments that lost and were deleted (docs/decisions.md keeps their figures)
RETIRED = (
    "decode_matmul",
    "fused_decode_rows",
    "layer_loop",
    "mgpu_decode",
    "OURO_JAX_ROPE_WRITE",
    "OURO_JAX_FUSED_NORMS",
    "OURO_JAX_SKINNY_TUNING",
    "OURO_JAX_MATVEC_TUNING",
    "OURO_JAX_ATTENTION_KERNEL",
    "OURO_JAX_FUSED_CODA",
)


def test_results_hold_only_data():
    results = ROOT / "benchmarks" / "results"
    entries = list(results.iterdir())
    assert not [p.name for p in entries if p.is_dir()], "no per-run folders under benchmarks/results"
    bad = [p.name for p in entries if p.suffix not in (".json", ".png") and p.name != "REPORT.md"]
    assert not bad, f"only JSON, plots and REPORT.md belong in benchmarks/results: {bad}"


def test_retired_switches_stay_gone():
    files = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    for pkg in ("ouro_jax", "pallas_kernels", "scheduler", "weights", "benchmarks"):
        files += (ROOT / pkg).rglob("*.py")
    pattern = re.compile("|".join(RETIRED))
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files for m in pattern.finditer(p.read_text())]
    assert not hits, hits


def test_tests_are_grouped_by_package():
    top = [p.name for p in (ROOT / "tests").iterdir() if p.is_file() and p.suffix == ".py"]
    assert len(top) <= 8, top
    for folder in ("scheduler", "kernels", "model", "engine", "weights", "server", "benchmarks", "structured"):
        assert (ROOT / "tests" / folder / "__init__.py").exists(), folder
