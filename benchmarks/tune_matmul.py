"""Times candidate GEMM tiles per M bucket on the GPU and checks their bits agree.

Writes nothing: its printed table is the measurement behind the tile tables in
``pallas_kernels/matmul.py``. Run: ``PYTHONPATH=. python3 benchmarks/tune_matmul.py``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels import matmul as kernels

T = kernels.MatmulTiles
FORWARD_CANDIDATES = (
    T(16, 32, 4, 4), T(16, 32, 4, 6), T(16, 64, 4, 5), T(32, 64, 4, 4), T(64, 64, 4, 4),
    T(64, 128, 4, 3), T(64, 128, 4, 4), T(128, 128, 8, 3), T(128, 256, 8, 3),
)
M_VALUES = (16, 64, 256, 1024)
AT_B_CANDIDATES = (T(128, 256, 8, 3), T(128, 128, 8, 3), T(64, 256, 4, 3))
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
COPIES = 3  # rotate B so that it does not sit in the 50 MB L2


def main():
  print(f"# GEMM tile sweep on {harness.device_description()}")
  print("| pass | M | K | N | tiles | us | XLA us | XLA/jdet | bits equal |\n" + "|---" * 9 + "|")
  for k, n in SHAPES:
    bs = [harness.random_normal(i, (1, k, n), jnp.bfloat16) for i in range(COPIES)]
    for m in M_VALUES:
      candidates = [t for t in FORWARD_CANDIDATES if t.block_m <= max(16, m)]
      a = harness.random_normal(0, (1, m, k), jnp.bfloat16)
      xla = harness.time_us(jnp.dot, [(a[0], b[0]) for b in bs])
      reference = None
      for tiles in candidates:
        fn = functools.partial(kernels.matmul, transpose_b=False, out_dtype=jnp.bfloat16,
                               precision=None, tiles=tiles, interpret=False)
        out = np.asarray(fn(a, bs[0])).view(np.uint16)
        reference = out if reference is None else reference
        us = harness.time_us(fn, [(a, b) for b in bs])
        print(f"| fwd | {m} | {k} | {n} | {tiles} | {us:.1f} | {xla:.1f} | "
                     f"{xla / us:.2f} | {np.array_equal(out, reference)} |", flush=True)
    for m in (1024,):
      a = harness.random_normal(0, (1, m, k), jnp.bfloat16)
      d = harness.random_normal(2, (1, m, n), jnp.bfloat16)
      xla = harness.time_us(lambda x, y: jnp.dot(x.T, y), [(a[0], d[0])])
      for tiles in AT_B_CANDIDATES:
        fn = functools.partial(kernels.matmul_at_b, out_dtype=jnp.bfloat16, precision=None,
                               tiles=tiles, interpret=False)
        us = harness.time_us(fn, [(a, d)])
        print(f"| dB | {m} | {k} | {n} | {tiles} | {us:.1f} | {xla:.1f} | "
                     f"{xla / us:.2f} | |", flush=True)


if __name__ == "__main__":
  main()
