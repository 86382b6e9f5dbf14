"""``python -m jdet check``: every op's invariance, determinism and accuracy on this device.

On a GPU the ops run natively at production-like sizes; on a CPU they run in
Pallas interpret mode at small sizes. Each case checks the forward and the
per-row gradients with :mod:`jdet.testing` and measures the error against a
float64 (or float32 jnp) reference.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax

from jdet import testing
from jdet.bench import progress_bar


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
  first_call_seconds: float
  seconds: float
  message: str = ""

  @property
  def ok(self) -> bool:
    return self.invariant and self.deterministic and self.error <= self.case.tolerance


def run_case(case: Case) -> Result:
  """Times the first jitted call on the full batch (compile + run), then checks."""
  start = time.perf_counter()
  jax.block_until_ready(jax.jit(case.fn)(*case.args))
  first_call = time.perf_counter() - start
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
  return Result(case, passed["invariance"], passed["determinism"], case.error(), first_call,
                time.perf_counter() - start, "; ".join(messages))


def format_results(results: list[Result]) -> str:
  head = ("| op | case | batch sizes tried | invariant | deterministic | max rel error | "
          "tolerance | first call s | total s | status |")
  lines = [head, "|---" * 10 + "|"]
  for r in results:
    total = jax.tree.leaves(r.case.args[0])[0].shape[0]
    tried = ",".join(str(b) for b in r.case.batch_sizes if b <= total)
    lines.append(
        f"| {r.case.op} | {r.case.label} | {tried},{total}, padded, vmap | "
        f"{'yes' if r.invariant else 'NO'} | "
        f"{'yes' if r.deterministic else 'NO'} | {r.error:.2e} | {r.case.tolerance:.0e} | "
        f"{r.first_call_seconds:.1f} | {r.seconds:.1f} | {'ok' if r.ok else 'FAIL'} |")
  return "\n".join(lines)


def main(ops=None, full: bool | None = None) -> int:
  """Runs the checks, prints the table; returns 0 if every case passed, else 1."""
  full = jax.default_backend() == "gpu" if full is None else full
  device = jax.devices()[0]
  print(f"jdet check on {device.device_kind} ({device.platform}), jax {jax.__version__}; "
        f"{'native kernels, production sizes' if full else 'Pallas interpret mode, small sizes'}")
  from jdet._registry import OPS
  cases = [c for op in (ops or OPS) for c in OPS[op].check_cases(full)]
  results = []
  for i, case in enumerate(cases):
    progress_bar(i, len(cases), f"{case.op}: {case.label}")
    results.append(run_case(case))
  progress_bar(len(cases), len(cases), "done")
  print(format_results(results))
  for r in results:
    if r.message:
      print(f"{r.case.op} {r.case.label}: {r.message}")
  failed = sum(not r.ok for r in results)
  print(f"{len(results) - failed} passed, {failed} failed")
  print(f"(first call: compile and run of the full batch; total: that plus the checks, "
        f"{sum(r.seconds for r in results):.0f} s in all. A persistent compilation cache, "
        f"JAX_COMPILATION_CACHE_DIR, makes a second run faster.)")
  return 1 if failed else 0
