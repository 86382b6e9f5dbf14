"""``python -m jdet check``: every op's invariance, determinism and accuracy on this device.

On a GPU the ops run natively at production-like sizes, the cases in worker
processes (:mod:`jdet._workers`: compiling is most of the time); on a CPU they run
in Pallas interpret mode at small sizes, in this process. Each case checks the
forward and the per-row gradients with :mod:`jdet.testing` and measures the error
of its full-batch output against a float64 (or float32 jnp) reference.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import time
from typing import Any, Callable

import jax

from jdet import testing
from jdet._workers import default_workers, worker_pool
from jdet.bench import first_call_seconds, progress_bar


@dataclasses.dataclass
class Case:
  """One check: ``fn(*args)`` batched along axis 0 of the args whose in_axes is 0."""
  op: str
  label: str
  fn: Callable
  args: tuple
  in_axes: tuple
  # The max relative error of ``out``, the full batch's output (already compiled and
  # run by the check), against a reference: no other program of the op compiles.
  error: Callable[[Any], float]
  tolerance: float
  batch_sizes: tuple = (1, 2, 3, 7, 16, 17)


@dataclasses.dataclass
class Result:
  """A case's outcome; plain data, so that a worker process can return it."""
  op: str
  label: str
  batch_sizes: str  # the batch layouts tried, as the table names them
  tolerance: float
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
    return self.invariant and self.deterministic and self.error <= self.tolerance


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
  total = jax.tree.leaves(case.args[0])[0].shape[0]
  tried = ",".join(str(b) for b in case.batch_sizes if b <= total)
  return Result(case.op, case.label, f"{tried},{total}, padded, vmap", case.tolerance,
                passed["invariance"], passed["determinism"],
                case.error(jax.jit(case.fn)(*case.args)), first_call,
                time.perf_counter() - start, "; ".join(messages))


def format_results(results: list[Result]) -> str:
  head = ("| op | case | batch sizes tried | invariant | deterministic | max rel error | "
          "tolerance | first call s | checks s | status |")
  lines = [head, "|---" * 10 + "|"]
  for r in results:
    lines.append(
        f"| {r.op} | {r.label} | {r.batch_sizes} | "
        f"{'yes' if r.invariant else 'NO'} | "
        f"{'yes' if r.deterministic else 'NO'} | {r.error:.2e} | {r.tolerance:.0e} | "
        f"{r.first_call_seconds:.1f} | {r.check_seconds:.1f} | {'ok' if r.ok else 'FAIL'} |")
  return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def _op_cases(op: str, full: bool) -> tuple[Case, ...]:
  from jdet._registry import OPS
  return tuple(OPS[op].check_cases(full))


def _case_count(op: str, full: bool) -> int:
  return len(_op_cases(op, full))


def _run_indexed_case(op: str, index: int, full: bool, compile_workers: int) -> Result:
  """Case ``index`` of ``op`` (a worker process builds each op's cases once)."""
  return run_case(_op_cases(op, full)[index], compile_workers=compile_workers)


def _parity(full: bool) -> tuple[bool, float]:
  """The model-level check (:func:`jdet.models.parity.parity_check`): ok, seconds."""
  from jdet.models import parity
  began = time.perf_counter()
  ok = parity.parity_check("gpu" if full else "cpu", xla_baseline=False)["ok"]
  return ok, time.perf_counter() - began


def _report_case(r: Result) -> None:
  print(f"  {r.op} {r.label}: first call {r.first_call_seconds:.1f} s, "
        f"checks {r.check_seconds:.1f} s, {'ok' if r.ok else 'FAIL'}",
        file=sys.stderr, flush=True)


def _run_here(ops, full: bool, compile_workers: int) -> list[Result]:
  from jdet._registry import OPS
  cases = [c for op in ops for c in OPS[op].check_cases(full)]
  results = []
  for i, case in enumerate(cases):
    progress_bar(i, len(cases), f"{case.op}: {case.label}")
    results.append(run_case(case, compile_workers=compile_workers))
    _report_case(results[-1])
  progress_bar(len(cases), len(cases), "done")
  return results


def _run_in_workers(ops, full: bool, workers: int, with_parity: bool):
  """Every case, and the parity check, as jobs of ``workers`` processes; returns
  the results in registry order and the parity outcome (None without it)."""
  threads = max(1, (os.cpu_count() or 1) // workers)
  with worker_pool(workers) as pool:
    parity = pool.submit(_parity, full) if with_parity else None
    counts = {op: pool.submit(_case_count, op, full) for op in ops}
    jobs = {pool.submit(_run_indexed_case, op, i, full, threads): (op, i)
            for op in ops for i in range(counts[op].result())}
    done = {}
    for finished in concurrent.futures.as_completed(jobs):
      done[jobs[finished]] = finished.result()
      _report_case(done[jobs[finished]])
    return [done[key] for key in sorted(done, key=lambda key: (ops.index(key[0]), key[1]))], (
        parity.result() if parity else None)


def main(ops=None, full: bool | None = None, workers: int | None = None) -> int:
  """Runs the checks, prints the table; returns 0 if every case passed, else 1.

  Without ``ops`` it also runs the model-level check,
  :func:`jdet.models.parity.parity_check`: a decoder built from jdet ops samples
  completions with its KV cache, the trainer recomputes their log-probs in other
  batches, and every token must agree bitwise (GPU sizes on a GPU).

  ``workers`` processes run the cases (default :func:`jdet._workers.default_workers`:
  one per two cores on a GPU, where compiling dominates; in-process on a CPU).
  """
  began = time.perf_counter()
  full = jax.default_backend() == "gpu" if full is None else full
  workers = default_workers() if workers is None else workers
  device = jax.devices()[0]
  print(f"jdet check on {device.device_kind} ({device.platform}), jax {jax.__version__}; "
        f"{'native kernels, production sizes' if full else 'Pallas interpret mode, small sizes'}"
        f"{f'; {workers} worker processes' if workers > 1 else ''}")
  from jdet._registry import OPS
  with_parity = ops is None
  ops = list(ops or OPS)
  if workers > 1:
    results, parity = _run_in_workers(ops, full, workers, with_parity)
  else:
    # On a GPU each batch size compiles its own Triton kernels; the compiles of one
    # case run on every core. Interpret mode stays on one thread (its kernels call back
    # into Python, and XLA:CPU already uses the cores).
    results = _run_here(ops, full, (os.cpu_count() or 1) if full else 1)
    parity = _parity(full) if with_parity else None
  print(format_results(results))
  for r in results:
    if r.message:
      print(f"{r.op} {r.label}: {r.message}")
  failed = sum(not r.ok for r in results)
  passed = len(results) - failed
  if parity is not None:
    ok, seconds = parity
    passed, failed = passed + ok, failed + (not ok)
    print(f"model parity check: {'ok' if ok else 'FAIL'} in {seconds:.1f} s")
  print(f"{passed} passed, {failed} failed in {time.perf_counter() - began:.0f} s")
  print("(first call: compile and run of the full batch; checks: the other batch shapes' "
        "compiles, the comparisons and the reference. A persistent compilation cache, "
        "JAX_COMPILATION_CACHE_DIR, makes a second run faster.)")
  return 1 if failed else 0
