"""The one benchmark harness: ``python -m jdet bench`` and every ``benchmarks/`` script use it.

Timing: ``copies`` independent input sets (so small problems do not sit in L2)
are run back to back inside one jitted call. On a GPU the time is the sum of the
device kernels' durations measured by CUPTI (Mosaic GPU's profiler), so host
dispatch is left out for jdet and the baseline alike; the time per op is the
median over ``repeats`` calls, divided by ``copies``, after a warm-up call.
Elsewhere it is wall time of ``inner`` calls per repeat, and means nothing about
GPU speed. Always compare against the baseline timed in the same process:
absolute numbers on shared machines drift.

A benchmark is a list of :class:`BenchCase` (one per shape, pass and baseline),
built by the op's registry entry (:mod:`jdet._registry`); :func:`run_cases`
times them and :func:`markdown_table` prints one table with the same columns
for every op.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

# Measured on the lent H100: device-to-device copy ~3.0 TB/s counting read +
# write. The floor of a memory-bound op is the bytes it must move at this rate.
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
    # in groups whose outputs fit RETAINED_OUTPUT_BYTES.
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


@dataclasses.dataclass(frozen=True)
class BenchCase:
  """One timed comparison: ``fn`` against ``baseline_fn`` on the same inputs.

  ``make_args(seed)`` builds one input set; ``set_bytes`` is its size (it sets
  how many copies rotate through L2). ``flops`` and ``bytes_moved`` (the HBM
  traffic the pass cannot avoid) give the TFLOP/s and HBM-floor columns on a
  GPU; leave them ``None`` where they mean nothing.
  """
  op: str
  case: str
  pass_: str
  fn: Callable
  baseline: str
  baseline_fn: Callable
  make_args: Callable[[int], tuple]
  set_bytes: int
  flops: float | None = None
  bytes_moved: float | None = None


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


def gpu_columns() -> tuple[str, ...]:
  """The columns that mean something only on a GPU (empty elsewhere)."""
  return ("jdet TFLOP/s", "jdet / HBM floor") if on_gpu() else ()


def _gpu_cells(case: BenchCase, jdet_us: float) -> dict[str, str]:
  extra = dict.fromkeys(gpu_columns(), "")
  if extra and case.flops:
    extra["jdet TFLOP/s"] = f"{case.flops / jdet_us / 1e6:.1f}"
  if extra and case.bytes_moved:
    floor_us = case.bytes_moved / H100_HBM_BYTES_PER_S * 1e6
    extra["jdet / HBM floor"] = f"{jdet_us / floor_us:.2f}x"
  return extra


def run_cases(cases: Sequence[BenchCase], *, progress: bool = True,
              on_row: Callable[[Row], None] | None = None,
              most_copies: int = 8) -> list[Row]:
  """Times every case (a baseline shared by several cases is timed once); ``on_row``
  sees each row as soon as it is measured. ``most_copies`` caps the input sets per
  case (fewer compile faster; a small weight then may sit in L2)."""
  rows, baseline_us = [], {}
  sets_key, sets = None, None  # one shape's input sets at a time, reused by its passes
  for i, case in enumerate(cases):
    if progress:
      progress_bar(i, len(cases), f"{case.op} {case.case} {case.pass_}")
    if sets_key != (case.op, case.case):
      sets = None  # free the previous shape's inputs before building these
      sets = [case.make_args(seed)
              for seed in range(copies_for(case.set_bytes, most=most_copies))]
      sets_key = (case.op, case.case)
    jdet_us = time_us(case.fn, sets)
    timed = (case.op, case.case, case.pass_, case.baseline)
    if timed not in baseline_us:
      try:
        baseline_us[timed] = time_us(case.baseline_fn, sets)
      except jax.errors.JaxRuntimeError as err:  # e.g. the baseline does not fit in memory
        print(f"{case.baseline} failed on {case.case}: {str(err).splitlines()[0]}",
              file=sys.stderr)
        baseline_us[timed] = float("nan")
    rows.append(Row(case.op, case.case, case.pass_, jdet_us, case.baseline,
                    baseline_us[timed], _gpu_cells(case, jdet_us)))
    if on_row:
      on_row(rows[-1])
  if progress:
    progress_bar(len(cases), len(cases), "done")
  return rows


def first_call_seconds(fn: Callable[..., Any], args: tuple) -> float:
  """Wall seconds of the first ``jax.jit(fn)(*args)``: trace, lower, compile (the
  Triton and Mosaic kernels included) and run, until the result is ready. Only
  meaningful for shapes the process has not compiled ``fn`` for."""
  jax.block_until_ready(args)
  start = time.perf_counter()
  jax.block_until_ready(jax.jit(fn)(*args))
  return time.perf_counter() - start


def first_call_rows(cases: Sequence[BenchCase], *, progress: bool = True,
                    on_row: Callable[[Row], None] | None = None) -> list[Row]:
  """First-call latency of jdet and of the baseline for every case, on one input
  set each (the cases' shapes must be fresh: ``first_call_cases`` in the registry).
  A row's pass reads "<pass> first call" and its times are microseconds, so the
  one table (:func:`markdown_table`) holds them. The first case of each op and
  pass warms the process (its row reads "<pass> warm-up call"): the first
  call there also pays one-off costs that a later new shape does not."""
  rows, baseline_us, warm = [], {}, set()
  for i, case in enumerate(cases):
    if progress:
      progress_bar(i, len(cases), f"{case.op} {case.case} {case.pass_} first call")
    args = case.make_args(0)
    jdet_us = first_call_seconds(case.fn, args) * 1e6
    timed = (case.op, case.case, case.pass_, case.baseline)
    if timed not in baseline_us:
      baseline_us[timed] = first_call_seconds(case.baseline_fn, args) * 1e6
    kind = "first call" if (case.op, case.pass_) in warm else "warm-up call"
    warm.add((case.op, case.pass_))
    rows.append(Row(case.op, case.case, f"{case.pass_} {kind}", jdet_us, case.baseline,
                    baseline_us[timed]))
    if on_row:
      on_row(rows[-1])
  if progress:
    progress_bar(len(cases), len(cases), "done")
  return rows


def progress_bar(done: int, total: int, label: str) -> None:
  """A one-line progress bar on stderr; a plain line per step when stderr is not a terminal."""
  if sys.stderr.isatty():
    width = 24
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{label[:50]:<50}")
    if done == total:
      sys.stderr.write("\n")
  else:
    sys.stderr.write(f"[{done}/{total}] {label}\n")
  sys.stderr.flush()


def markdown_table(rows: Sequence[Row], *, head: bool = True) -> str:
  """The results table (``head=False``: its rows alone)."""
  extra_keys = list(dict.fromkeys([*gpu_columns(), *(k for r in rows for k in r.extra)]))
  columns = ["op", "case", "pass", "jdet us", "baseline", "baseline us",
             "speed vs baseline", *extra_keys]
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] if head else []
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


def plot(rows: Sequence[Row], path: str) -> bool:
  """One panel per op, one series per (pass, baseline); False without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
  except ImportError:
    return False
  ops = list(dict.fromkeys(r.op for r in rows))
  fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.8 * len(ops)), squeeze=False)
  for ax, op in zip(axes[:, 0], ops):
    mine = [r for r in rows if r.op == op]
    cases = list(dict.fromkeys(r.case for r in mine))
    for pass_, baseline in dict.fromkeys((r.pass_, r.baseline) for r in mine):
      series = {r.case: r.speedup for r in mine if (r.pass_, r.baseline) == (pass_, baseline)}
      xs = [i for i, case in enumerate(cases) if case in series]
      ax.plot(xs, [series[cases[i]] for i in xs], "o-", label=f"{pass_} vs {baseline}")
    ax.set_xticks(range(len(cases)), cases, rotation=60, ha="right", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("baseline time / jdet time")
    ax.set_title(op)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def report(title: str, cases: Sequence[BenchCase], *, first_call: bool = False,
           **options) -> list[Row]:
  """A benchmark's output: the device line, the interpret warning, then one table
  whose rows print as they are measured: the steady-state times (``options`` go
  to :func:`run_cases`) or, with ``first_call``, :func:`first_call_rows`."""
  print(f"# {title} on {device_description()}")
  if interpret_warning():
    print(interpret_warning())
  print(markdown_table([]), flush=True)
  measure = first_call_rows if first_call else run_cases
  return measure(cases, on_row=lambda row: print(markdown_table([row], head=False),
                                                 flush=True), **options)
