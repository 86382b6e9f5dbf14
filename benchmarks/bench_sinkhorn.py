"""jdet.sinkhorn vs ``jit`` of the jnp reference, forward and forward+backward, f32, 20 iterations.

The backward baseline is ``jit(grad)`` of the reference (autodiff through the
iteration). On a GPU each row also gives jdet's time over the HBM floor: the
bytes a pass must move (forward: read logits, write R; forward+backward: that,
plus read logits and dR and write dlogits). The cases are the op registry's.

Run: ``PYTHONPATH=. python3 benchmarks/bench_sinkhorn.py [--quick]``.
"""

from __future__ import annotations

import argparse

from jdet import bench
from jdet._registry import OPS


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  args = parser.parse_args()
  bench.report("jdet.sinkhorn", OPS["sinkhorn"].bench_cases(bench.on_gpu() and not args.quick))


if __name__ == "__main__":
  main()
