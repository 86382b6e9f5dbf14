"""jdet.rms_norm vs the jnp reference under jit (XLA's fusions), forward and forward+backward, bf16.

Rows labelled ``rms_norm`` normalise x; ``rms_norm[residual]`` are the fused
``(rms_norm(x + residual) * weight, x + residual)``. Each row also gives the HBM
floor: the bytes a single pass must move (read x [and residual], the weight,
write y [and the sum]; backward: read the normalised input and the cotangents,
write dx and dweight) at ``harness.H100_HBM_BYTES_PER_S``.

Run: ``PYTHONPATH=. python3 benchmarks/bench_rms_norm.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness

# (rows, H): decode, prefill and training token counts at common hidden sizes,
# and a small H that puts many rows in a program.
CASES = ((1, 4096), (256, 4096), (4096, 4096), (8192, 4096), (8192, 8192), (16384, 8192),
         (8192, 16384), (65536, 128))
QUICK_CASES = ((8, 96), (40, 200))  # CPU interpret: shapes that finish
EPS = 1e-6


def _forward(norm, residual: bool):
  """fn(x, [residual,] w, g) -> the op's output(s); g (the cotangent) is unused."""
  if residual:
    return lambda x, r, w, g: norm(x, w, eps=EPS, residual=r)
  return lambda x, w, g: norm(x, w, eps=EPS)


def _fwd_bwd(fn, residual: bool):
  def run(*args):
    out, vjp = jax.vjp(lambda *a: fn(*a, None), *args[:-1])
    g = args[-1]
    return out, *vjp((g, g) if residual else g)
  return run


def _floor_bytes(m: int, h: int, itemsize: int, residual: bool, backward: bool) -> int:
  """Bytes one pass must move: forward reads the inputs and writes the outputs;
  backward reads the normalised input and the cotangents and writes dx and dw."""
  rows = m * h * itemsize
  arrays = 2 if residual else 1
  forward = 2 * arrays * rows + h * 4
  # Backward: read h and the cotangent(s) of the output(s), write dx (dresidual is dx).
  return forward + ((1 + arrays + 1) * rows + 2 * h * 4 if backward else 0)


def rows(cases=CASES, dtype=jnp.bfloat16) -> list[harness.Row]:
  result = []
  itemsize = jnp.dtype(dtype).itemsize
  for m, h in cases:
    for residual in (False, True):
      per_set = (4 if residual else 3) * 2 * m * h * itemsize
      sets = []
      for i in range(harness.copies_for(per_set)):
        x, r, g = (harness.random_normal(4 * i + j, (m, h), dtype) for j in range(3))
        w = harness.random_normal(4 * i + 3, (h,), jnp.float32)
        sets.append((x, r, w, g) if residual else (x, w, g))
      for pass_, backward in (("fwd", False), ("fwd+bwd", True)):
        wrap = (functools.partial(_fwd_bwd, residual=residual) if backward
                else lambda f: f)
        theirs = harness.time_us(wrap(_forward(jdet.rms_norm_reference, residual)), sets)
        ours = harness.time_us(wrap(_forward(jdet.rms_norm, residual)), sets)
        floor_us = (_floor_bytes(m, h, itemsize, residual, backward)
                    / harness.H100_HBM_BYTES_PER_S * 1e6)
        result.append(harness.Row(
            "rms_norm[residual]" if residual else "rms_norm", f"M={m} H={h}", pass_, ours,
            "jnp reference (XLA)", theirs,
            {"HBM floor us": f"{floor_us:.2f}", "jdet / floor": f"{ours / floor_us:.2f}x"}))
        print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--m", type=int, action="append", help="only these M (repeatable)")
  args = parser.parse_args()
  harness.print_report("jdet.rms_norm", rows, [c for c in CASES if not args.m or c[0] in args.m],
                       QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
