"""jdet.softmax / log_softmax vs jax.nn, forward and forward+backward.

Each row also gives the HBM floor: the bytes a pass must move at least (forward:
read x, write y; forward+backward: that, plus read x and dy and write dx) over
``H100_HBM_BYTES_PER_S``. The targets (H100): at least 0.9x of XLA and within 2x
of the floor at 8192 x 8192.

Run: ``PYTHONPATH=. python3 benchmarks/bench_softmax.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness

OPS = {"softmax": (jdet.softmax, jax.nn.softmax),
       "log_softmax": (jdet.log_softmax, jax.nn.log_softmax)}
# (rows, row length, dtype): square, a vocab row (bf16 input: 2.5 GB; float32
# logits: 5 GB), and short rows.
CASES = tuple(itertools.product(
    ((8192, 8192, jnp.float32), (8192, 8192, jnp.bfloat16), (8192, 151936, jnp.bfloat16),
     (8192, 151936, jnp.float32), (65536, 128, jnp.float32)), OPS))
QUICK_CASES = (((16, 300, jnp.float32), "softmax"), ((16, 300, jnp.float32), "log_softmax"))


def _fwd_bwd(fn):
  def run(x, g):
    out, vjp = jax.vjp(fn, x)
    return out, *vjp(g)
  return run


def _first(fn):
  return lambda x, g: fn(x)


def rows(cases=CASES) -> list[harness.Row]:
  result = []
  for (count, length, dtype), name in cases:
    ours_fn, xla_fn = OPS[name]
    array_bytes = count * length * jnp.dtype(dtype).itemsize
    sets = [(harness.random_normal(2 * i, (count, length), dtype),
             harness.random_normal(2 * i + 1, (count, length), dtype))
            for i in range(harness.copies_for(5 * array_bytes, budget_bytes=12 << 30))]
    for pass_, wrap, moved in (("fwd", _first, 2 * array_bytes),
                               ("fwd+bwd", _fwd_bwd, 5 * array_bytes)):
      ours = harness.time_us(wrap(ours_fn), sets)
      theirs = harness.time_us(wrap(xla_fn), sets)
      floor_us = moved / harness.H100_HBM_BYTES_PER_S * 1e6
      result.append(harness.Row(
          name, f"{count} x {length} {jnp.dtype(dtype).name}", pass_, ours, f"jax.nn.{name}",
          theirs, {"HBM floor us": f"{floor_us:.1f}", "jdet / floor": f"{ours / floor_us:.2f}"}))
      print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  args = parser.parse_args()
  harness.print_report("jdet.softmax", rows, CASES, QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
