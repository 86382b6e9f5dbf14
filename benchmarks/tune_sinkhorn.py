"""Times candidate Sinkhorn tiles on the GPU (65,536 tokens, 20 iterations, f32).

Its printed table is the measurement behind the tile tables in
``pallas_kernels/sinkhorn.py``. Run: ``PYTHONPATH=. python3 benchmarks/tune_sinkhorn.py``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels import sinkhorn as kernels

S = kernels.SinkhornTiles
TOKENS, ITERS = 65536, 20
FORWARD = (S(32, 1), S(64, 1), S(64, 2), S(128, 2), S(128, 4), S(256, 4), S(256, 8), S(512, 8))
BACKWARD = {4: (S(64, 2, 6), S(128, 4, 6), S(64, 2, 4), S(64, 2, 10), S(32, 1, 6)),
            8: (S(64, 2, 2), S(128, 4, 2), S(64, 2, 4), S(32, 1, 2), S(32, 1, 4))}


def main():
  print(f"# Sinkhorn tile sweep on {harness.device_description()}, T={TOKENS}, iters={ITERS}")
  print("| pass | n | tiles | us | bits equal to first |\n|---|---|---|---|---|")
  for n in (4, 8):
    sets = [(harness.random_normal(2 * i, (TOKENS, n, n), jnp.float32),
             harness.random_normal(2 * i + 1, (TOKENS, n, n), jnp.float32)) for i in range(4)]
    for name, candidates, launch in (
        ("fwd", FORWARD, lambda t: functools.partial(
            kernels.sinkhorn_forward, iters=ITERS, eps=1e-6, init="softmax", tiles=t,
            interpret=False)),
        ("bwd unrolled", BACKWARD[n], lambda t: functools.partial(
            kernels.sinkhorn_unrolled_backward, iters=ITERS, eps=1e-6, init="softmax",
            tiles=t, interpret=False)),
        ("bwd implicit", FORWARD[1:6], lambda t: functools.partial(
            kernels.sinkhorn_implicit_backward, out_dtype=jnp.float32, tiles=t,
            interpret=False))):
      first = None
      for tiles in candidates:
        fn = launch(tiles)
        args = [s[:1] for s in sets] if name == "fwd" else sets
        bits = np.asarray(fn(*args[0])).view(np.uint32)
        first = bits if first is None else first
        us = harness.time_us(fn, args)
        print(f"| {name} | {n} | {tiles} | {us:.1f} | {np.array_equal(bits, first)} |",
              flush=True)


if __name__ == "__main__":
  main()
