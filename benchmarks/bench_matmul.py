"""jdet.matmul vs XLA's jnp.dot (cuBLAS on GPU), forward and forward+backward, bf16.

Run: ``PYTHONPATH=. python3 benchmarks/bench_matmul.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness

M_VALUES = (1, 16, 64, 256, 1024, 4096, 16384)
KN_VALUES = ((4096, 4096), (4096, 12288), (4096, 14336), (14336, 4096), (4096, 32000))
CASES = tuple(itertools.product(M_VALUES, KN_VALUES))
QUICK_CASES = ((1, (64, 128)), (40, (64, 128)))  # CPU interpret: shapes that finish


def _xla_matmul(a, b):
  return jnp.dot(a, b)


def _fwd_bwd(fn):
  def run(a, b, g):
    out, vjp = jax.vjp(fn, a, b)
    return out, *vjp(g)
  return run


def rows(cases=CASES, dtype=jnp.bfloat16) -> list[harness.Row]:
  result = []
  for m, (k, n) in cases:
    per_set = (m * k + k * n + 2 * m * n) * jnp.dtype(dtype).itemsize
    sets = [(harness.random_normal(3 * i, (m, k), dtype),
             harness.random_normal(3 * i + 1, (k, n), dtype),
             harness.random_normal(3 * i + 2, (m, n), dtype))
            for i in range(harness.copies_for(per_set))]
    flops = 2 * m * k * n
    for pass_, jdet_fn, xla_fn, passes, args in (
        ("fwd", jdet.matmul, _xla_matmul, 1, [s[:2] for s in sets]),
        ("fwd+bwd", _fwd_bwd(jdet.matmul), _fwd_bwd(_xla_matmul), 3, sets)):
      ours = harness.time_us(jdet_fn, args)
      theirs = harness.time_us(xla_fn, args)
      result.append(harness.Row(
          "matmul", f"M={m} K={k} N={n}", pass_, ours, "jnp.dot (XLA)", theirs,
          {"jdet TFLOP/s": f"{passes * flops / ours / 1e6:.1f}",
           "XLA TFLOP/s": f"{passes * flops / theirs / 1e6:.1f}"}))
      print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--m", type=int, action="append", help="only these M (repeatable)")
  args = parser.parse_args()
  harness.print_report("jdet.matmul", rows, [c for c in CASES if not args.m or c[0] in args.m],
                       QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
