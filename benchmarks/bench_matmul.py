"""jdet.matmul vs XLA's jnp.dot (cuBLAS on GPU), forward and forward+backward, bf16.

Run: ``PYTHONPATH=. python3 benchmarks/bench_matmul.py [--quick] [--m 256 ...]
[--backend triton] [--plot ratio.png]``. ``--backend`` (repeatable) picks jdet's
backends: rows of the Pallas GEMM are labelled ``matmul``, those of the Triton
GEMM (jax-triton) ``matmul[triton]``, each against XLA timed once per shape.
The cases are the op registry's (:mod:`jdet._registry`).
"""

from __future__ import annotations

import argparse
import itertools

from jdet import bench
from jdet._registry import MATMUL_BENCH_KN, MATMUL_BENCH_M, MATMUL_QUICK, matmul_bench_cases
from jdet.matmul import BACKENDS


def plot_ratio_vs_m(table: list[bench.Row], path: str) -> None:
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
    ax.set_title(f"jdet.matmul {pass_}, bf16")
  axes[0].set_ylabel("XLA time / jdet time")
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--m", type=int, action="append", help="only these M (repeatable)")
  parser.add_argument("--plot", metavar="PNG", help="also plot the ratio against M")
  parser.add_argument("--backend", choices=BACKENDS, action="append",
                      help="jdet backend to time or plot (repeatable); default: pallas "
                           "(all backends with --from-results)")
  parser.add_argument("--from-results", metavar="MD",
                      help="plot rows recorded in a results file instead of measuring")
  args = parser.parse_args()
  if args.from_results:
    with open(args.from_results) as f:
      text = f.read()
    labels = ["matmul" if b == "pallas" else f"matmul[{b}]" for b in args.backend or BACKENDS]
    plot_ratio_vs_m([r for label in labels for r in bench.rows_from_markdown(text, label)],
                    args.plot)
    return
  if args.quick or not bench.on_gpu():
    shapes = MATMUL_QUICK
  else:
    shapes = [(m, kn) for m, kn in itertools.product(MATMUL_BENCH_M, MATMUL_BENCH_KN)
              if not args.m or m in args.m]
  table = bench.report("jdet.matmul", matmul_bench_cases(
      shapes, backends=tuple(args.backend or ("pallas",))))
  if args.plot:
    plot_ratio_vs_m(table, args.plot)


if __name__ == "__main__":
  main()
