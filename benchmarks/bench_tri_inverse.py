"""jdet.tri_inverse vs solve_triangular and jnp.linalg.inv, forward and forward+backward, f32.

The cases are the op registry's (:mod:`jdet._registry`). ``--sweep`` instead
times every candidate tile config per n and checks that their bits agree (the
measurement behind ``GPU_FORWARD_TILES`` and ``GPU_BACKWARD_TILES`` in
``pallas_kernels/tri_inverse.py``).

Run: ``PYTHONPATH=. python3 benchmarks/bench_tri_inverse.py [--quick | --sweep]``.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jdet
from jdet import bench
from jdet._registry import OPS
from jdet.testing import random_normal
from jdet.tri_inverse import gdn_chunk_matrices
from pallas_kernels import tri_inverse as kernels

# Candidates per n for --sweep, (matrices per program, warps), forward and
# backward. Stages do not matter: the kernels have no pipelined loop over loads.
FORWARD_SWEEP = {
    16: [(8, 1), (4, 1), (8, 2)],
    32: [(4, 2), (2, 1), (4, 1)],
    64: [(1, 1), (1, 2), (1, 4), (2, 1)],
    128: [(1, 2), (1, 4), (1, 8)],
}
BACKWARD_SWEEP = {
    16: [(8, 1), (4, 1), (4, 2)],
    32: [(2, 1), (2, 2), (2, 4)],
    64: [(1, 1), (1, 2), (1, 4)],
    128: [(1, 4), (1, 8)],
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
  """Prints one sweep row: microseconds and whether the bits match the pass's first row."""
  try:
    equal = _bits_match(run(*args), references, key)
    print(f"| {label} | {bench.time_us(run, [args]):.1f} | {equal} |", flush=True)
  except Exception as error:  # a config Triton cannot compile is a result, not a stop
    print(f"| {label} | failed: {type(error).__name__}: "
          f"{str(error).splitlines()[0][:120]} | |", flush=True)


def sweep(sizes=tuple(FORWARD_SWEEP), passes=("fwd", "bwd")):
  """Times every tile candidate per n and pass; checks that their bits agree."""
  hi = jax.lax.Precision.HIGHEST
  print("| n | pass | matrices/program | warps | us | bits equal |\n" + "|---" * 6 + "|")
  for n in sizes:
    a = gdn_chunk_matrices(jax.random.key(n), SWEEP_MATRICES, n)
    g = random_normal(n, a.shape)
    for name, baseline in (("fwd", jdet.tri_inverse_reference),
                           ("fwd+bwd", _fwd_bwd(jdet.tri_inverse_reference))):
      args = (a,) if name == "fwd" else (a, g)
      print(f"| {n} | {name} solve_triangular | | | "
            f"{bench.time_us(baseline, [args]):.1f} | |", flush=True)
    x = jdet.tri_inverse(a)
    references = {}
    for per_program, warps in FORWARD_SWEEP[n] if "fwd" in passes else ():
      forward = functools.partial(
          kernels.tri_inverse, method="blocked", precision=hi,
          tiles=kernels.TriInverseTiles(per_program, warps, 1), interpret=False)
      _time_candidate(f"{n} | fwd | {per_program} | {warps}", forward,
                      "fwd", references, (a,))
    for per_program, warps in BACKWARD_SWEEP[n] if "bwd" in passes else ():
      backward = functools.partial(
          kernels.tri_inverse_backward, out_dtype=jnp.float32, precision=hi,
          tiles=kernels.TriInverseTiles(per_program, warps, 1), interpret=False)
      _time_candidate(f"{n} | bwd | {per_program} | {warps}", backward,
                      "bwd", references, (x, g))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--sweep", action="store_true", help="time the GPU tile candidates (GPU only)")
  parser.add_argument("--sizes", type=int, nargs="*", default=list(FORWARD_SWEEP),
                      help="n values for --sweep")
  parser.add_argument("--passes", nargs="*", choices=("fwd", "bwd"), default=["fwd", "bwd"],
                      help="passes for --sweep")
  args = parser.parse_args()
  if args.sweep:
    print(f"# jdet.tri_inverse tile sweep on {bench.device_description()}")
    sweep(args.sizes, args.passes)
  else:
    bench.report("jdet.tri_inverse", OPS["tri_inverse"].bench_cases(bench.on_gpu() and not args.quick))


if __name__ == "__main__":
  main()
