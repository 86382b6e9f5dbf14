"""jdet.matmul vs XLA's jnp.dot (cuBLAS on GPU), forward and forward+backward, bf16.

Run: ``PYTHONPATH=. python3 benchmarks/bench_matmul.py [--quick] [--backend triton]``.
``--backend`` (repeatable) picks jdet's backends: rows of the Pallas GEMM are
labelled ``matmul``, those of the Triton GEMM (jax-triton) ``matmul[triton]``,
each against XLA timed once per shape in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness
from jdet.matmul import BACKENDS as MATMUL_BACKENDS

M_VALUES = (1, 16, 64, 256, 512, 1024, 4096, 16384)
KN_VALUES = ((4096, 4096), (4096, 12288), (4096, 14336), (14336, 4096), (4096, 32000))
CASES = tuple(itertools.product(M_VALUES, KN_VALUES))
QUICK_CASES = ((1, (64, 128)), (40, (64, 128)))  # CPU interpret: shapes that finish


def _xla_matmul(a, b):
  return jnp.dot(a, b)


def _fwd_bwd(fn):
  def run(a, b, g):
    out, vjp = jax.vjp(fn, a, b)
    return out, *vjp(g)
  return run


def op_label(backend: str) -> str:
  return "matmul" if backend == "pallas" else f"matmul[{backend}]"


def rows(cases=CASES, dtype=jnp.bfloat16, backends=("pallas",)) -> list[harness.Row]:
  result = []
  for m, (k, n) in cases:
    per_set = (m * k + k * n + 2 * m * n) * jnp.dtype(dtype).itemsize
    sets = [(harness.random_normal(3 * i, (m, k), dtype),
             harness.random_normal(3 * i + 1, (k, n), dtype),
             harness.random_normal(3 * i + 2, (m, n), dtype))
            for i in range(harness.copies_for(per_set))]
    flops = 2 * m * k * n
    for pass_, wrap, passes, args in (("fwd", lambda f: f, 1, [s[:2] for s in sets]),
                                      ("fwd+bwd", _fwd_bwd, 3, sets)):
      theirs = harness.time_us(wrap(_xla_matmul), args)
      for backend in backends:
        ours = harness.time_us(wrap(functools.partial(jdet.matmul, backend=backend)), args)
        result.append(harness.Row(
            op_label(backend), f"M={m} K={k} N={n}", pass_, ours, "jnp.dot (XLA)", theirs,
            {"jdet TFLOP/s": f"{passes * flops / ours / 1e6:.1f}",
             "XLA TFLOP/s": f"{passes * flops / theirs / 1e6:.1f}"}))
        print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def plot_ratio_vs_m(table: list[harness.Row], path: str) -> None:
  """One line per backend, (K, N) and pass: XLA time / jdet time against M (log scale);
  Triton-backend lines are dashed. A case listed twice is plotted from its first row
  (results files put the newest table first)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
  for ax, pass_ in zip(axes, ("fwd", "fwd+bwd")):
    series, seen = {}, set()
    for row in table:
      if row.pass_ == pass_ and (row.op, row.case) not in seen:
        seen.add((row.op, row.case))
        m, k, n = (int(part.split("=")[1]) for part in row.case.split())
        series.setdefault((row.op, k, n), []).append((m, row.speedup))
    shapes = sorted({(k, n) for _, k, n in series})
    for (op, k, n), points in sorted(series.items()):
      style = "o-" if op == "matmul" else "x--"
      ax.plot(*zip(*sorted(points)), style, color=f"C{shapes.index((k, n))}",
              label=f"{op} K={k} N={n}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("M (rows)")
    ax.set_title(f"jdet.matmul {pass_}, bf16, H100")
  axes[0].set_ylabel("XLA time / jdet time")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--m", type=int, action="append", help="only these M (repeatable)")
  parser.add_argument("--plot", metavar="PNG", help="also plot the ratio against M")
  parser.add_argument("--backend", choices=MATMUL_BACKENDS, action="append",
                      help="jdet backend to time or plot (repeatable); default: pallas "
                           "(all backends with --from-results)")
  parser.add_argument("--from-results", metavar="MD",
                      help="plot rows recorded in a results file instead of measuring")
  args = parser.parse_args()
  if args.from_results:
    with open(args.from_results) as f:
      text = f.read()
    plot_ratio_vs_m([r for b in args.backend or MATMUL_BACKENDS
                     for r in harness.rows_from_markdown(text, op_label(b))], args.plot)
    return
  backends = tuple(args.backend or ("pallas",))
  table = harness.print_report("jdet.matmul", functools.partial(rows, backends=backends),
                               [c for c in CASES if not args.m or c[0] in args.m],
                               QUICK_CASES, quick=args.quick)
  if args.plot:
    plot_ratio_vs_m(table, args.plot)


if __name__ == "__main__":
  main()
