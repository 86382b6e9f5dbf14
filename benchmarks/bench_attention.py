"""jdet.dot_product_attention vs jax.nn.dot_product_attention, bf16, H = 128, N = 32, K = 8.

Prefill (causal, T = S, forward and forward+backward) is compared with
``implementation="cudnn"`` where it compiles, else ``"xla"``; the baseline
column says which ran. Decode (T = 1 against a full cache of S keys, passed as
``key_value_seq_lengths``) is compared with ``implementation="xla"``. Prefill
FLOPs count half the square (causal), forward+backward 3.5x the forward's;
decode's HBM floor is reading K and V once. The cases are the op registry's.

Run: ``PYTHONPATH=. python3 benchmarks/bench_attention.py [--quick]``.
"""

from __future__ import annotations

import argparse

from jdet import bench
from jdet._registry import OPS


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  args = parser.parse_args()
  bench.report("jdet.dot_product_attention",
               OPS["dot_product_attention"].bench_cases(bench.on_gpu() and not args.quick))


if __name__ == "__main__":
  main()
