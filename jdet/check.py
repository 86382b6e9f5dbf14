"""``python -m jdet check``: every op's invariance, determinism and accuracy on this device.

On a GPU the ops run natively at production-like sizes; on a CPU they run in
Pallas interpret mode at small sizes. Each case checks the forward and the
per-row gradients with :mod:`jdet.testing` and measures the error against a
float64 (or float32 jnp) reference.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable

import jax

from jdet import testing
from jdet.bench import first_call_seconds, progress_bar


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
  def check_seconds(self) -> float:
    """The rest of the case after the first call: the other batch shapes, the
    comparisons and the reference."""
    return self.seconds - self.first_call_seconds

  @property
  def ok(self) -> bool:
    return self.invariant and self.deterministic and self.error <= self.case.tolerance


def run_case(case: Case, *, compile_workers: int = 1) -> Result:
  """Times the first jitted call on the full batch (compile + run), then checks;
  ``compile_workers > 1`` compiles the check's other batch shapes on that many
  threads first (see :func:`jdet.testing.assert_batch_invariant`)."""
  start = time.perf_counter()
  first_call = first_call_seconds(case.fn, case.args)
  messages = []
  checks = {
      "invariance": lambda: testing.assert_batch_invariant(
          case.fn, *case.args, in_axes=case.in_axes, batch_sizes=case.batch_sizes,
          compile_workers=compile_workers),
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
          "tolerance | first call s | checks s | status |")
  lines = [head, "|---" * 10 + "|"]
  for r in results:
    total = jax.tree.leaves(r.case.args[0])[0].shape[0]
    tried = ",".join(str(b) for b in r.case.batch_sizes if b <= total)
    lines.append(
        f"| {r.case.op} | {r.case.label} | {tried},{total}, padded, vmap | "
        f"{'yes' if r.invariant else 'NO'} | "
        f"{'yes' if r.deterministic else 'NO'} | {r.error:.2e} | {r.case.tolerance:.0e} | "
        f"{r.first_call_seconds:.1f} | {r.check_seconds:.1f} | {'ok' if r.ok else 'FAIL'} |")
  return "\n".join(lines)


def main(ops=None, full: bool | None = None) -> int:
  """Runs the checks, prints the table; returns 0 if every case passed, else 1.

  Without ``ops`` it also runs the model-level check,
  :func:`jdet.models.parity.parity_check`: a decoder built from jdet ops samples
  completions with its KV cache, the trainer recomputes their log-probs in other
  batches, and every token must agree bitwise (GPU sizes on a GPU).
  """
  began = time.perf_counter()
  full = jax.default_backend() == "gpu" if full is None else full
  device = jax.devices()[0]
  print(f"jdet check on {device.device_kind} ({device.platform}), jax {jax.__version__}; "
        f"{'native kernels, production sizes' if full else 'Pallas interpret mode, small sizes'}")
  from jdet._registry import OPS
  cases = [c for op in (ops or OPS) for c in OPS[op].check_cases(full)]
  # On a GPU each batch size compiles its own Triton kernels; the compiles of one
  # case run on every core. Interpret mode stays on one thread (its kernels call back
  # into Python, and XLA:CPU already uses the cores).
  workers = (os.cpu_count() or 1) if full else 1
  results = []
  for i, case in enumerate(cases):
    progress_bar(i, len(cases), f"{case.op}: {case.label}")
    results.append(run_case(case, compile_workers=workers))
    r = results[-1]
    print(f"  {case.op} {case.label}: first call {r.first_call_seconds:.1f} s, "
          f"checks {r.check_seconds:.1f} s, {'ok' if r.ok else 'FAIL'}",
          file=sys.stderr, flush=True)
  progress_bar(len(cases), len(cases), "done")
  print(format_results(results))
  for r in results:
    if r.message:
      print(f"{r.case.op} {r.case.label}: {r.message}")
  failed = sum(not r.ok for r in results)
  passed = len(results) - failed
  if ops is None:
    from jdet.models import parity
    parity_began = time.perf_counter()
    if parity.parity_check("gpu" if full else "cpu")["ok"]:
      passed += 1
    else:
      failed += 1
    print(f"model parity check: {time.perf_counter() - parity_began:.1f} s")
  print(f"{passed} passed, {failed} failed in {time.perf_counter() - began:.0f} s")
  print("(first call: compile and run of the full batch; checks: the other batch shapes' "
        "compiles, the comparisons and the reference. A persistent compilation cache, "
        "JAX_COMPILATION_CACHE_DIR, makes a second run faster.)")
  return 1 if failed else 0
