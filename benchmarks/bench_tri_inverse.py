"""jdet.tri_inverse vs solve_triangular and jnp.linalg.inv, forward and forward+backward, f32.

Each row also gives matrices/s and the relative error (max |X - X_exact| /
max |X_exact|, vs float64 NumPy on a sample) on GDN chunks and on the hostile
``a = -0.99 * (strictly lower ones)``, for jdet and for the baseline.
``--sweep`` instead times every candidate tile config per n and checks that
their bits agree (the measurement behind ``GPU_FORWARD_TILES`` and
``GPU_BACKWARD_TILES`` in ``pallas_kernels/tri_inverse.py``).

Run: ``PYTHONPATH=. python3 benchmarks/bench_tri_inverse.py [--quick | --sweep]``.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jdet
from benchmarks import harness
from jdet.testing import relative_error
from jdet.tri_inverse import gdn_chunk_matrices, hostile_chunk_matrices
from pallas_kernels import tri_inverse as kernels

# (matrices, n): GDN chunk counts (batch x heads x chunks) at chunk sizes 64 and 128.
CASES = ((8192, 64), (65536, 64), (8192, 128), (65536, 128))
QUICK_CASES = ((8, 16), (4, 64))  # CPU interpret: shapes that finish
ACCURACY_SAMPLE = 64  # matrices of each family whose error is measured

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


def _identity_like(a):
  return jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)


def _linalg_inv(a):
  """The dense baseline: ``jnp.linalg.inv(I - tril(a, -1))`` (LU, pivoting)."""
  return jnp.linalg.inv(_identity_like(a) - jnp.tril(a, -1))


BASELINES = (("solve_triangular", jdet.tri_inverse_reference),
             ("jnp.linalg.inv", _linalg_inv))


def _fwd_bwd(fn):
  def run(a, g):
    x, vjp = jax.vjp(fn, a)
    return x, *vjp(g)
  return run


def _errors(fn, n) -> str:
  """'gdn error / hostile error' of ``fn`` against a float64 NumPy inverse."""
  results = []
  for a in (gdn_chunk_matrices(jax.random.key(n), ACCURACY_SAMPLE, n),
            hostile_chunk_matrices(ACCURACY_SAMPLE, n)):
    exact = np.linalg.inv(np.eye(n) - np.tril(np.asarray(a, np.float64), -1))
    results.append(f"{relative_error(jax.jit(fn)(a), exact):.1e}")
  return " / ".join(results)


def rows(cases=CASES) -> list[harness.Row]:
  """Forward and forward+backward rows for every (matrices, n) case, both baselines."""
  result = []
  for count, n in cases:
    per_set = 4 * count * n * n * 4  # a, g, X, dA in f32
    # One set on CPU: XLA:CPU (jax 0.10.2) hung on 8 batched jnp.linalg.inv in one jit.
    copies = harness.copies_for(per_set) if harness.on_gpu() else 1
    sets = [(gdn_chunk_matrices(jax.random.key(i), count, n),
             harness.random_normal(i, (count, n, n), jnp.float32))
            for i in range(copies)]
    jdet_error = _errors(jdet.tri_inverse, n)
    baseline_errors = {name: _errors(fn, n) for name, fn in BASELINES}
    for pass_, wrap, args in (("fwd", lambda f: f, [s[:1] for s in sets]),
                              ("fwd+bwd", _fwd_bwd, sets)):
      ours = harness.time_us(wrap(jdet.tri_inverse), args)
      for name, baseline in BASELINES:
        try:
          theirs = harness.time_us(wrap(baseline), args)
        except jax.errors.JaxRuntimeError as err:  # XLA's inverse may not fit in memory
          print(f"{name} failed at {count} x {n}x{n}: {str(err).splitlines()[0]}")
          theirs = float("nan")
        result.append(harness.Row(
            "tri_inverse", f"{count} x {n}x{n}", pass_, ours, name, theirs,
            {"jdet matrices/s": f"{count / ours * 1e6:.3g}",
             "baseline matrices/s": f"{count / theirs * 1e6:.3g}",
             "jdet error gdn / hostile": jdet_error,
             "baseline error gdn / hostile": baseline_errors[name]}))
        print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def _bits_match(outputs, references, key):
  """True when ``outputs`` has the bits of the first result for ``key`` (the pass)."""
  reference = references.setdefault(key, outputs)
  return np.array_equal(np.asarray(outputs).view(np.uint32),
                        np.asarray(reference).view(np.uint32))


def _time_candidate(label, run, key, references, args):
  """Prints one sweep row: microseconds and whether the bits match the pass's first row."""
  try:
    equal = _bits_match(run(*args), references, key)
    print(f"| {label} | {harness.time_us(run, [args]):.1f} | {equal} |", flush=True)
  except Exception as error:  # a config Triton cannot compile is a result, not a stop
    print(f"| {label} | failed: {type(error).__name__}: "
          f"{str(error).splitlines()[0][:120]} | |", flush=True)


def sweep(sizes=tuple(FORWARD_SWEEP), passes=("fwd", "bwd")):
  """Times every tile candidate per n and pass; checks that their bits agree."""
  hi = jax.lax.Precision.HIGHEST
  print("| n | pass | matrices/program | warps | us | bits equal |\n" + "|---" * 6 + "|")
  for n in sizes:
    a = gdn_chunk_matrices(jax.random.key(n), SWEEP_MATRICES, n)
    g = harness.random_normal(n, a.shape, jnp.float32)
    for name, baseline in (("fwd", jdet.tri_inverse_reference),
                           ("fwd+bwd", _fwd_bwd(jdet.tri_inverse_reference))):
      args = (a,) if name == "fwd" else (a, g)
      print(f"| {n} | {name} solve_triangular | | | "
            f"{harness.time_us(baseline, [args]):.1f} | |", flush=True)
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
    print(f"# jdet.tri_inverse tile sweep on {harness.device_description()}")
    sweep(args.sizes, args.passes)
  else:
    harness.print_report("jdet.tri_inverse", rows, CASES, QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
