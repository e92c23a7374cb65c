"""Run 25, calls 5-6: does the engine on the Mosaic attention kernel give the Triton kernel's
tokens for other prompt seeds? ``tests/test_gpu_engine.py::
test_mosaic_kernel_engine_equals_triton_kernel_engine``'s setup (bf16, ouro-small, buckets 8 / 32
/ 256, prompts of 300 / 129 / 64 / 7 tokens, gate rule at 0.6) over prompt seeds 1-4, Triton
against Mosaic only. Run from the repo root as ``pytest -m gpu benchmarks/results/run25/seed_probe.py``,
with ``OURO_JAX_STEP_XLA_OPTIONS`` choosing the GEMMs (the calls ran a copy of the test's body
inline; this file calls the test's helper, ``kernel_engines``, instead)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[3] / "tests"))
from test_gpu_engine import _diff, kernel_engines, model, pytestmark  # noqa: E402, F401 (fixture, GPU marks)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_probe(model, seed):  # noqa: F811
    from pallas_kernels.dispatch import hopper_available

    if not hopper_available():
        pytest.skip("the Mosaic GPU kernel needs a Hopper GPU")
    got = kernel_engines(model, seed, ("triton", "mgpu"))
    assert got["mgpu"] == got["triton"], "mgpu vs triton kernel: " + _diff(got["mgpu"], got["triton"])
