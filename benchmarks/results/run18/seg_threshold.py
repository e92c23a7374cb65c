"""``benchmarks.run`` with the hybrid split's segment threshold set from the command line (run 18's probe).

    PYTHONPATH=$PWD python benchmarks/results/run18/seg_threshold.py 64 --workload long4 --mode wavefront --chunk 64

The run-18 probes ran this before the split had its own constant: they set
``dispatch.MGPU_MIN_ROWS_PER_SEGMENT``, which then also set the split (and the bucket rule, which
long4's S = R buckets do not use). With the current code the split's threshold is
``dispatch.HYBRID_MIN_SEGMENT_ROWS``, set here.
"""

import runpy
import sys

import pallas_kernels.dispatch as d

d.HYBRID_MIN_SEGMENT_ROWS = int(sys.argv[1])
print("HYBRID_MIN_SEGMENT_ROWS =", d.HYBRID_MIN_SEGMENT_ROWS, flush=True)
sys.argv = ["benchmarks.run", *sys.argv[2:]]
runpy.run_module("benchmarks.run", run_name="__main__")
