"""``python -m jdet check``: every op's invariance, determinism and accuracy on this device.

On a GPU the ops run natively at production-like sizes; on a CPU they run in
Pallas interpret mode at small sizes. Each case checks the forward and the
per-row gradients with :mod:`jdet.testing` and measures the error against a
float64 (or float32 jnp) reference.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jdet
from jdet import testing


@dataclasses.dataclass
class Case:
  """One check: ``fn(*args)`` batched along axis 0 of the args whose in_axes is 0."""
  op: str
  label: str
  fn: Callable
  args: tuple
  in_axes: tuple
  error: Callable[[], float]  # max relative error vs the reference
  tolerance: float
  batch_sizes: tuple = (1, 2, 3, 7, 16, 17)


@dataclasses.dataclass
class Result:
  case: Case
  invariant: bool
  deterministic: bool
  error: float
  seconds: float
  message: str = ""

  @property
  def ok(self) -> bool:
    return self.invariant and self.deterministic and self.error <= self.case.tolerance


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32).astype(dtype)


def _row_grad(fn):
  """Gradient of sum(fn(x)**2)/2 w.r.t. x: row i's gradient depends on row i only."""
  return jax.grad(lambda x, *rest: 0.5 * jnp.sum(fn(x, *rest) ** 2))


def matmul_cases(full: bool) -> list[Case]:
  m, k, n = (1024, 4096, 4096) if full else (40, 96, 80)
  a, b = _normal(0, (m, k), jnp.bfloat16), _normal(1, (k, n), jnp.bfloat16)
  reference = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  sizes = (1, 2, 3, 7, 16, 17, 100, 129, 1000) if full else (1, 2, 3, 7, 16, 17)
  return [
      Case("matmul", f"fwd bf16 [{m},{k}]x[{k},{n}]", jdet.matmul, (a, b), (0, None),
           lambda: testing.relative_error(jdet.matmul(a, b), reference), 1e-2, sizes),
      Case("matmul", "dA (grad of sum of squares)", _row_grad(jdet.matmul), (a, b),
           (0, None), lambda: testing.relative_error(
               _row_grad(jdet.matmul)(a.astype(jnp.float32), b.astype(jnp.float32)),
               _row_grad(jdet.matmul_reference)(a.astype(jnp.float32), b.astype(jnp.float32))),
           1e-2 if full else 1e-5, sizes),
  ]


def sinkhorn_cases(full: bool) -> list[Case]:
  cases = []
  for n in (4, 8):
    tokens = (65536 if n == 4 else 16384) if full else 32
    logits = _normal(10 + n, (tokens, n, n)) * 2
    # Each token count compiles its own kernels (~10 s for an unrolled backward).
    sizes = (1, 7, 1000) if full else (1, 2, 7)
    reference = jdet.sinkhorn_reference(logits)
    cases.append(Case("sinkhorn", f"fwd n={n} [{tokens},{n},{n}]", jdet.sinkhorn, (logits,),
                      (0,), lambda r=reference, x=logits: testing.relative_error(jdet.sinkhorn(x), r),
                      1e-5, sizes))
    unrolled = lambda x: jdet.sinkhorn(x, grad="unrolled")
    want = _row_grad(jdet.sinkhorn_reference)(logits)
    cases.append(Case(
        "sinkhorn", f"grad=unrolled n={n}", _row_grad(unrolled), (logits,), (0,),
        lambda x=logits, w=want: testing.relative_error(_row_grad(unrolled)(x), w), 1e-4, sizes))
    # The implicit gradient is the fixed point's: compare where the iteration has
    # converged (moderate logits, 200 iterations), against the unrolled reference.
    converged = logits * 0.25
    implicit = lambda x: jdet.sinkhorn(x, iters=200, grad="implicit")
    want = _row_grad(lambda x: jdet.sinkhorn_reference(x, iters=200))(converged)
    cases.append(Case(
        "sinkhorn", f"grad=implicit n={n} (200 iters)", _row_grad(implicit), (converged,),
        (0,), lambda x=converged, w=want: testing.relative_error(_row_grad(implicit)(x), w), 1e-3,
        sizes))
  return cases


def tri_inverse_cases(full: bool) -> list[Case]:
  cases = []
  for n in (64,) if not full else (64, 128):
    count = 4096 if full else 8
    a = jdet.gdn_chunk_matrices(jax.random.key(n), count, n)
    exact = np.linalg.inv(np.eye(n) - np.tril(np.asarray(a, np.float64), -1))
    sizes = (1, 3, 64, 1000) if full else (1, 3)
    cases.append(Case("tri_inverse", f"fwd blocked n={n} [{count},{n},{n}]", jdet.tri_inverse,
                      (a,), (0,), lambda x=a, e=exact: testing.relative_error(jdet.tri_inverse(x), e),
                      1e-5, sizes))
    want = _row_grad(jdet.tri_inverse_reference)(a)
    cases.append(Case("tri_inverse", f"dA n={n}", _row_grad(jdet.tri_inverse), (a,), (0,),
                      lambda x=a, w=want: testing.relative_error(_row_grad(jdet.tri_inverse)(x), w),
                      1e-4, sizes))
  return cases


CASE_BUILDERS = {"matmul": matmul_cases, "sinkhorn": sinkhorn_cases,
                 "tri_inverse": tri_inverse_cases}


def run_case(case: Case) -> Result:
  start = time.perf_counter()
  messages = []
  checks = {
      "invariance": lambda: testing.assert_batch_invariant(
          case.fn, *case.args, in_axes=case.in_axes, batch_sizes=case.batch_sizes),
      "determinism": lambda: testing.assert_deterministic(case.fn, *case.args, runs=5),
  }
  passed = {}
  for name, check in checks.items():
    try:
      check()
      passed[name] = True
    except AssertionError as err:
      passed[name] = False
      messages.append(f"{name}: {err}")
  return Result(case, passed["invariance"], passed["determinism"], case.error(),
                time.perf_counter() - start, "; ".join(messages))


def _progress(i: int, total: int, label: str) -> None:
  width = 24
  done = int(width * i / total)
  sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label[:50]:<50}")
  sys.stderr.flush()


def format_results(results: list[Result]) -> str:
  head = ("| op | case | batch sizes tried | invariant | deterministic | max rel error | "
          "tolerance | seconds | status |")
  lines = [head, "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    total = jax.tree.leaves(r.case.args[0])[0].shape[0]
    tried = ",".join(str(b) for b in r.case.batch_sizes if b <= total)
    lines.append(
        f"| {r.case.op} | {r.case.label} | {tried},{total}, padded, vmap | "
        f"{'yes' if r.invariant else 'NO'} | "
        f"{'yes' if r.deterministic else 'NO'} | {r.error:.2e} | {r.case.tolerance:.0e} | "
        f"{r.seconds:.1f} | {'ok' if r.ok else 'FAIL'} |")
  return "\n".join(lines)


def main(ops=None, full: bool | None = None) -> int:
  """Runs the checks, prints the table; returns 0 if every case passed, else 1."""
  full = jax.default_backend() == "gpu" if full is None else full
  device = jax.devices()[0]
  print(f"jdet check on {device.device_kind} ({device.platform}), jax {jax.__version__}; "
        f"{'native kernels, production sizes' if full else 'Pallas interpret mode, small sizes'}")
  cases = [c for op in (ops or CASE_BUILDERS) for c in CASE_BUILDERS[op](full)]
  results = []
  for i, case in enumerate(cases):
    _progress(i, len(cases), f"{case.op}: {case.label}")
    results.append(run_case(case))
  _progress(len(cases), len(cases), "done")
  sys.stderr.write("\n")
  print(format_results(results))
  for r in results:
    if r.message:
      print(f"{r.case.op} {r.case.label}: {r.message}")
  failed = sum(not r.ok for r in results)
  print(f"{len(results) - failed} passed, {failed} failed")
  return 1 if failed else 0
