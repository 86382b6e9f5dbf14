"""jdet.tri_inverse vs solve_triangular and jnp.linalg.inv, forward and forward+backward, f32.

The cases are the op registry's (:mod:`jdet._registry`). ``--sweep`` instead
times (and times the compile of) every candidate tile config per n and kernel,
and checks that their bits agree: the measurement behind the ``GPU_*_TILES``
tables in ``pallas_kernels/tri_inverse.py``.

Run: ``PYTHONPATH=. python3 benchmarks/bench_tri_inverse.py [--quick | --sweep]``.
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
from jdet._registry import OPS
from jdet.testing import random_normal
from jdet.tri_inverse import gdn_chunk_matrices
from pallas_kernels import tri_inverse as kernels

# Candidates per n for --sweep, (matrices per program, warps, stages), per kernel.
SWEEP = {
    "blocked": {16: [(4, 1, 1), (4, 1, 2)],
                32: [(2, 1, 1), (1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 2)],
                64: [(1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 2)],
                128: [(1, 1, 1), (1, 1, 2), (1, 2, 2), (1, 4, 2), (1, 2, 3)]},
    "backward": {16: [(4, 1, 1), (4, 1, 2)],
                 32: [(1, 2, 1), (1, 2, 2), (1, 1, 2), (1, 1, 3)],
                 64: [(1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 2), (2, 1, 2)],
                 128: [(1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 2), (1, 2, 3)]},
    "doubling": {16: [(4, 1, 1)], 32: [(1, 4, 1)], 64: [(1, 8, 1), (1, 16, 1)]},
}
SWEEP_MATRICES = 8192


def _fwd_bwd(fn):
  def run(a, g):
    x, vjp = jax.vjp(fn, a)
    return x, *vjp(g)
  return run


def _bits_match(outputs, references, key):
  """True when ``outputs`` has the bits of the first result for ``key`` (the pass)."""
  reference = references.setdefault(key, outputs)
  return np.array_equal(np.asarray(outputs).view(np.uint32),
                        np.asarray(reference).view(np.uint32))


def _time_candidate(label, run, key, references, args):
  """Prints one sweep row: compile seconds (first call less the second), microseconds,
  and whether the bits match the kernel's first candidate."""
  try:
    start = time.perf_counter()
    out = jax.block_until_ready(run(*args))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(run(*args))
    compile_s = first - (time.perf_counter() - start)
    equal = _bits_match(out, references, key)
    print(f"| {label} | {compile_s:.2f} | {bench.time_us(run, [args]):.1f} | {equal} |",
          flush=True)
  except Exception as error:  # a config Triton cannot compile is a result, not a stop
    print(f"| {label} | failed: {type(error).__name__}: "
          f"{str(error).splitlines()[0][:120]} | | | |", flush=True)


def sweep(sizes=kernels.SIZES, kernel_names=tuple(SWEEP)):
  """Times every tile candidate per n and kernel; checks that their bits agree."""
  hi = jax.lax.Precision.HIGHEST
  print("| n | kernel | matrices/program | warps | stages | compile s | us | bits equal |\n"
        + "|---" * 8 + "|")
  for n in sizes:
    a = gdn_chunk_matrices(jax.random.key(n), SWEEP_MATRICES, n)
    g = random_normal(n, a.shape)
    for name, baseline in (("fwd", jdet.tri_inverse_reference),
                           ("fwd+bwd", _fwd_bwd(jdet.tri_inverse_reference))):
      args = (a,) if name == "fwd" else (a, g)
      print(f"| {n} | {name} solve_triangular | | | | | "
            f"{bench.time_us(baseline, [args]):.1f} | |", flush=True)
    x = jdet.tri_inverse(a)
    references = {}
    for kernel in kernel_names:
      for per_program, warps, stages in SWEEP[kernel].get(n, ()):
        tiles = kernels.TriInverseTiles(per_program, warps, stages)
        if kernel == "backward":
          run = functools.partial(kernels.tri_inverse_backward, out_dtype=jnp.float32,
                                  precision=hi, tiles=tiles, interpret=False)
          args = (x, g)
        else:
          run = functools.partial(kernels.tri_inverse, method=kernel, precision=hi,
                                  tiles=tiles, interpret=False)
          args = (a,)
        _time_candidate(f"{n} | {kernel} | {per_program} | {warps} | {stages}",
                        jax.jit(run), kernel, references, args)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--sweep", action="store_true",
                      help="time the GPU tile candidates (GPU only)")
  parser.add_argument("--sizes", type=int, nargs="*", default=list(kernels.SIZES),
                      help="n values for --sweep")
  parser.add_argument("--kernels", nargs="*", choices=tuple(SWEEP), default=list(SWEEP),
                      help="kernels for --sweep")
  args = parser.parse_args()
  if args.sweep:
    print(f"# jdet.tri_inverse tile sweep on {bench.device_description()}")
    sweep(args.sizes, args.kernels)
  else:
    bench.report("jdet.tri_inverse",
                 OPS["tri_inverse"].bench_cases(bench.on_gpu() and not args.quick))


if __name__ == "__main__":
  main()
