"""jdet.rms_norm vs ``jit`` of the jnp reference (XLA's fusions), forward and
forward+backward, bf16.

Rows labelled ``rms_norm`` normalise x; ``rms_norm[residual]`` are the fused
``(rms_norm(x + residual) * weight, x + residual)``; the backward baseline is
``jit(vjp)`` of the reference. On a GPU each row also gives jdet's time over the
HBM floor: the bytes a pass must move at 3.0e12 B/s (forward: read x [and the
residual], write y [and the sum]; forward+backward: that, plus read the
normalised input and the cotangents and write dx). The cases are the op
registry's (``RMS_NORM_BENCH``, ``RMS_NORM_QUICK`` and ``rms_norm_bench_cases``
in :mod:`jdet._registry`), among them 8192 x 8192 and 8192 x 4096.

Run: ``PYTHONPATH=. python3 benchmarks/bench_rms_norm.py [--quick] [--m 8192 ...]``.
"""

from __future__ import annotations

import argparse

from jdet import bench
from jdet._registry import RMS_NORM_BENCH, RMS_NORM_QUICK, rms_norm_bench_cases


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--m", type=int, action="append", help="only these row counts (repeatable)")
  args = parser.parse_args()
  if args.quick or not bench.on_gpu():
    shapes = RMS_NORM_QUICK
  else:
    shapes = [(m, h) for m, h in RMS_NORM_BENCH if not args.m or m in args.m]
  bench.report("jdet.rms_norm", rms_norm_bench_cases(shapes))


if __name__ == "__main__":
  main()
