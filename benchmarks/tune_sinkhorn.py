"""Times candidate Sinkhorn tiles on the GPU (65,536 tokens, 20 iterations, f32).

Its printed table is the measurement behind the tile tables in
``pallas_kernels/sinkhorn.py``: kernel time, compile seconds, the unrolled or
implicit gradient's error against ``jax.grad`` of the reference (first 4096
tokens; unrolled backward only), whether the first 1000 tokens run alone give the
same bits as inside the whole batch, and whether the bits equal the first
candidate's. Run: ``PYTHONPATH=. python3 benchmarks/tune_sinkhorn.py [--n 4 8]``.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jdet
from jdet import bench
from jdet.testing import random_normal
from jdet.testing import relative_error
from pallas_kernels import sinkhorn as kernels

S = kernels.SinkhornTiles
TOKENS, ITERS, CHECKED = 65536, 20, 4096
# For n <= 8 a token's row sits in one thread whatever the block; block_tokens
# below 32 * num_warps replicates work. For n = 16 smaller blocks split a row
# over threads.
FORWARD = {4: (S(128, 4), S(32, 1), S(256, 8)), 8: (S(256, 8), S(128, 4)),
           16: (S(32, 2), S(64, 2), S(16, 1))}
UNROLLED = {4: (S(128, 4, 3), S(128, 4, 5), S(128, 4, 10), S(128, 4, 20), S(64, 4, 3)),
            8: (S(64, 4, 1), S(64, 4, 2), S(64, 4, 4), S(64, 4, 7)),
            16: (S(64, 2, 2), S(32, 2, 2), S(32, 2, 1), S(16, 1, 2))}
IMPLICIT = {4: (S(128, 4), S(64, 4)), 8: (S(64, 4), S(128, 4)), 16: (S(64, 2), S(32, 2))}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--n", type=int, nargs="+", default=[4, 8, 16])
  args = parser.parse_args()
  print(f"# Sinkhorn tile sweep on {bench.device_description()}, jax {jax.__version__}, "
        f"T={TOKENS}, iters={ITERS}")
  print("| pass | n | tiles | us | compile s | grad rel error | 1000 alone same bits "
        "| bits equal to first |\n|---|---|---|---|---|---|---|---|")
  for n in args.n:
    sets = [(random_normal(2 * i, (TOKENS, n, n)),
             random_normal(2 * i + 1, (TOKENS, n, n))) for i in range(4)]
    result_sets = [(jdet.sinkhorn(x, iters=ITERS), g) for x, g in sets]
    _, reference_vjp = jax.vjp(lambda x: jdet.sinkhorn_reference(x, iters=ITERS),
                               sets[0][0][:CHECKED])
    reference_grad = reference_vjp(sets[0][1][:CHECKED])[0]
    for name, candidates, arg_sets, launch in (
        ("fwd", FORWARD[n], sets, lambda t: lambda x, g: kernels.sinkhorn_forward(
            x, iters=ITERS, eps=1e-6, init="softmax", tiles=t, interpret=False)),
        ("bwd unrolled", UNROLLED[n], sets, lambda t: functools.partial(
            kernels.sinkhorn_unrolled_backward, iters=ITERS, eps=1e-6, init="softmax",
            tiles=t, interpret=False)),
        ("bwd implicit", IMPLICIT[n], result_sets, lambda t: functools.partial(
            kernels.sinkhorn_implicit_backward, out_dtype=jnp.float32, tiles=t,
            interpret=False))):
      first = None
      for tiles in candidates:
        fn = jax.jit(launch(tiles))
        x, g = arg_sets[0]
        began = time.perf_counter()
        out = np.asarray(fn(x, g))
        compile_s = time.perf_counter() - began
        alone = np.asarray(fn(x[:1000], g[:1000]))
        bits = out.view(np.uint32)
        first = bits if first is None else first
        error = ("-" if name != "bwd unrolled"  # implicit: the fixed point's gradient
                 else f"{relative_error(out[:CHECKED], reference_grad):.1e}")
        us = bench.time_us(fn, arg_sets)
        same_alone = np.array_equal(alone.view(np.uint32), bits[:1000])
        print(f"| {name} | {n} | {tiles} | {us:.1f} | {compile_s:.1f} | {error} | "
              f"{same_alone} | {np.array_equal(bits, first)} |", flush=True)


if __name__ == "__main__":
  main()
