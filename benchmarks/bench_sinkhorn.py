"""jdet.sinkhorn vs ``jit`` of the jnp reference, forward and forward+backward, f32, 20 iterations.

The backward baseline is ``jit(grad)`` of the reference (autodiff through the
iteration). Each row also gives the fraction of the HBM roofline: the bytes a
pass must move (forward: read logits, write R; forward+backward: that, plus read
logits and dR and write dlogits) over ``H100_HBM_BYTES_PER_S``.

Run: ``PYTHONPATH=. python3 benchmarks/bench_sinkhorn.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness

ITERS = 20
# (tokens, n): the sizes; the target is 65,536 tokens at n = 4.
CASES = tuple(itertools.product((4096, 16384, 65536, 262144), (4, 8)))
QUICK_CASES = ((256, 4),)  # CPU interpret: a shape that finishes


def _jdet(grad):
  return lambda x: jdet.sinkhorn(x, iters=ITERS, grad=grad)


def _reference(x):
  return jdet.sinkhorn_reference(x, iters=ITERS)


def _fwd_bwd(fn):
  def run(x, g):
    out, vjp = jax.vjp(fn, x)
    return out, *vjp(g)
  return run


def _first(fn):
  return lambda x, g: fn(x)


def rows(cases=CASES) -> list[harness.Row]:
  result = []
  for tokens, n in cases:
    matrix_bytes = tokens * n * n * 4
    sets = [(harness.random_normal(2 * i, (tokens, n, n), jnp.float32),
             harness.random_normal(2 * i + 1, (tokens, n, n), jnp.float32))
            for i in range(harness.copies_for(5 * matrix_bytes))]
    passes = (
        ("fwd", _first(_jdet("unrolled")), _first(_reference), 2 * matrix_bytes),
        ("fwd+bwd unrolled", _fwd_bwd(_jdet("unrolled")), _fwd_bwd(_reference),
         5 * matrix_bytes),
        ("fwd+bwd implicit", _fwd_bwd(_jdet("implicit")), _fwd_bwd(_reference),
         6 * matrix_bytes),  # the implicit backward also reads the saved R
    )
    baseline_us = {}
    for pass_, jdet_fn, reference_fn, moved in passes:
      ours = harness.time_us(jdet_fn, sets)
      key = pass_.split()[0]
      if key not in baseline_us:
        baseline_us[key] = harness.time_us(reference_fn, sets)
      roofline_us = moved / harness.H100_HBM_BYTES_PER_S * 1e6
      result.append(harness.Row(
          "sinkhorn", f"T={tokens} n={n} iters={ITERS}", pass_, ours,
          "jit(jnp reference)" + (" + jit(grad)" if key != "fwd" else ""), baseline_us[key],
          {"jdet % HBM roofline": f"{100 * roofline_us / ours:.1f}",
           "baseline % HBM roofline": f"{100 * roofline_us / baseline_us[key]:.1f}"}))
      print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  args = parser.parse_args()
  harness.print_report("jdet.sinkhorn", rows, CASES, QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
