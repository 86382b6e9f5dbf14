"""The one benchmark harness: timing, device facts and result tables for every op.

Timing: ``copies`` independent input sets (so small problems do not sit in L2)
are run back to back inside one jitted call. On a GPU the time is the sum of the
device kernels' durations measured by CUPTI (Mosaic GPU's profiler), so host
dispatch is left out for jdet and XLA alike; the time per op is the median over
``repeats`` calls, divided by ``copies``, after a warm-up call. Elsewhere it is
wall time of ``inner`` calls per repeat. Always compare against the XLA baseline
timed in the same process: absolute numbers on shared machines drift.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

# Measured on the lent H100 (DESIGN.md / device notes): device-to-device copy
# ~3.0 TB/s counting read + write; bf16 dense GEMM ~800 TFLOP/s.
H100_HBM_BYTES_PER_S = 3.0e12
RETAINED_OUTPUT_BYTES = 16 << 30


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def device_description() -> str:
  dev = jax.devices()[0]
  return f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}"


def time_us(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, repeats: int = 10,
            inner: int = 5, warmup: int = 2) -> float:
  """Median microseconds of one ``fn(*args)``; see the module docstring."""
  run_all = jax.jit(lambda sets: [fn(*args) for args in sets])
  if on_gpu():
    from jax.experimental.mosaic.gpu import profiler
    # The profiler keeps every iteration's outputs alive until it returns: measure
    # in groups whose outputs fit RETAINED_OUTPUT_BYTES (a 65,536 x 128 x 128
    # forward+backward returns 8 GiB a call).
    out_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(jax.eval_shape(run_all, arg_sets)))
    group = max(1, min(repeats, RETAINED_OUTPUT_BYTES // max(out_bytes, 1)))
    per_call_ms = []
    while len(per_call_ms) < repeats:
      count = min(group, repeats - len(per_call_ms))
      _, ms = profiler.measure(run_all, iterations=count)(arg_sets)
      per_call_ms += np.atleast_1d(ms).tolist()  # one float when count == 1
    return statistics.median(per_call_ms) * 1e3 / len(arg_sets)
  for _ in range(warmup):
    jax.block_until_ready(run_all(arg_sets))
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(inner):
      out = run_all(arg_sets)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / (inner * len(arg_sets)))
  return statistics.median(samples) * 1e6


def copies_for(bytes_per_set: int, *, budget_bytes: int = 1 << 30, most: int = 8) -> int:
  """How many input sets to rotate through: enough to defeat L2, within a memory budget."""
  return int(max(1, min(most, budget_bytes // max(bytes_per_set, 1))))


@dataclasses.dataclass
class Row:
  """One benchmark line: a named case, jdet's time, the baseline's, and extras."""
  op: str
  case: str
  pass_: str
  jdet_us: float
  baseline: str
  baseline_us: float
  extra: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def speedup(self) -> float:
    """baseline time / jdet time: > 1 means jdet is faster."""
    return self.baseline_us / self.jdet_us


def markdown_table(rows: Sequence[Row]) -> str:
  extra_keys = sorted({k for r in rows for k in r.extra})
  head = ["op", "case", "pass", "jdet us", "baseline", "baseline us",
          "speed vs baseline", *extra_keys]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r.op, r.case, r.pass_, f"{r.jdet_us:.1f}", r.baseline, f"{r.baseline_us:.1f}",
             f"{r.speedup:.2f}x", *(r.extra.get(k, "") for k in extra_keys)]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def rows_from_markdown(text: str, op: str) -> list[Row]:
  """Reads back the rows of ``op`` from tables written by :func:`markdown_table`."""
  rows, head = [], None
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[:2] == ["op", "case"]:  # a new table; only timing tables have a pass column
      head = cells if cells[2:3] == ["pass"] else None
    elif head and len(cells) == len(head) and cells[0] == op:
      record = dict(zip(head, cells))
      extra = {k: v for k, v in record.items() if k not in head[:7]}
      rows.append(Row(op, record["case"], record["pass"], float(record["jdet us"]),
                      record["baseline"], float(record["baseline us"]), extra))
  return rows


def interpret_warning() -> str | None:
  if on_gpu():
    return None
  return ("NOTE: no GPU: jdet kernels ran in Pallas interpret mode; these timings say "
          "nothing about speed.")


def random_normal(seed: int, shape, dtype) -> jax.Array:
  return jax.numpy.asarray(np.random.default_rng(seed).standard_normal(shape),
                           dtype=np.float32).astype(dtype)


def print_report(op: str, rows: Callable[[Sequence], list[Row]], cases: Sequence,
                 quick_cases: Sequence, *, quick: bool) -> list[Row]:
  """A benchmark script's output: the device line, the interpret warning, the table.

  Runs ``rows(quick_cases)`` when ``quick`` or without a GPU, else ``rows(cases)``.
  """
  print(f"# {op} on {device_description()}")
  if interpret_warning():
    print(interpret_warning())
  table = rows(quick_cases if quick or not on_gpu() else cases)
  print(markdown_table(table))
  return table
