"""jdet.softmax / log_softmax vs jax.nn, forward and forward+backward.

On a GPU each row also gives jdet's time over the HBM floor: the bytes a pass
must move at 3.0e12 B/s (forward: read x, write y; forward+backward: that, plus
read x and dy and write dx). Targets (H100): at least 0.9x of XLA and within 2x
of the floor at 8192 x 8192. The cases are the op registry's (``SOFTMAX_BENCH``,
``SOFTMAX_QUICK`` and ``softmax_bench_cases`` in :mod:`jdet._registry`).

Run: ``PYTHONPATH=. python3 benchmarks/bench_softmax.py [--quick] [--logsumexp]``.
"""

from __future__ import annotations

import argparse

from jdet import bench
from jdet._registry import SOFTMAX_BENCH, SOFTMAX_QUICK, softmax_bench_cases


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--logsumexp", action="store_true", help="also time logsumexp")
  args = parser.parse_args()
  shapes = SOFTMAX_QUICK if args.quick or not bench.on_gpu() else SOFTMAX_BENCH
  names = ("softmax", "log_softmax") + (("logsumexp",) if args.logsumexp else ())
  bench.report("jdet.softmax", softmax_bench_cases(shapes, names=names))


if __name__ == "__main__":
  main()
