"""jdet.matmul vs XLA's jnp.dot (cuBLAS on GPU), forward and forward+backward, bf16.

Run: ``PYTHONPATH=. python3 benchmarks/bench_matmul.py [--quick] [--m 256 ...]
[--backend triton] [--plot ratio.png]``. ``--backend`` (repeatable) picks jdet's
backends: rows of the Pallas GEMM are labelled ``matmul``, those of the Triton
GEMM (jax-triton) ``matmul[triton]``, each against XLA timed once per shape.
``--grid`` times the shape-general grid instead: every weight of
``MATMUL_MODEL_WEIGHTS`` (``--weights`` keeps the names containing a given text)
at every M of ``MATMUL_GRID_M``, forward only unless ``--pass fwd+bwd`` is given
too (``--min-m`` skips the smaller M), and ends with the worst cases and the
geometric mean of the ratios. The cases are the op registry's (:mod:`jdet._registry`).
"""

from __future__ import annotations

import argparse
import itertools
import math

from jdet import bench
from jdet._registry import (MATMUL_BENCH_KN, MATMUL_BENCH_M, MATMUL_GRID_M, MATMUL_MODEL_WEIGHTS,
                            MATMUL_QUICK, matmul_bench_cases)
from jdet.matmul import BACKENDS


def plot_ratio_vs_m(table: list[bench.Row], path: str) -> None:
  """One panel per pass measured, one line per backend and (K, N): XLA time / jdet
  time against M (log scale), one color (and marker) per (K, N) in every panel, the
  legend that of the fullest panel; Triton-backend lines are dashed. A case listed
  twice is plotted from its first row (results files put the newest table first)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  passes = list(dict.fromkeys(row.pass_ for row in table))
  fig, axes = plt.subplots(1, len(passes), figsize=(7 * len(passes) + 3, 5), sharey=True,
                           squeeze=False)
  colors = plt.get_cmap("tab20").colors
  shapes = sorted({tuple(int(part.split("=")[1]) for part in row.case.split()[1:])
                   for row in table})  # one color per (K, N) in every panel
  for ax, pass_ in zip(axes[0], passes):
    series, seen = {}, set()
    for row in table:
      if row.pass_ == pass_ and (row.op, row.case) not in seen:
        seen.add((row.op, row.case))
        m, k, n = (int(part.split("=")[1]) for part in row.case.split())
        series.setdefault((row.op, k, n), []).append((m, row.speedup))
    for (op, k, n), points in sorted(series.items()):
      index = shapes.index((k, n))
      style = ("o" if index < 20 else "s") + ("-" if op == "matmul" else "--")
      ax.plot(*zip(*sorted(points)), style, ms=3, color=colors[index % 20],
              label=f"{op} K={k} N={n}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("M (rows)")
    ax.set_title(f"jdet.matmul {pass_}, bf16")
  axes[0, 0].set_ylabel("XLA time / jdet time")
  fullest = max(axes[0], key=lambda ax: len(ax.get_lines()))
  axes[0, -1].legend(*fullest.get_legend_handles_labels(), fontsize=7, loc="center left",
                     bbox_to_anchor=(1.02, 0.5))
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def grid_summary(table: list[bench.Row], worst: int = 12) -> None:
  """Per pass: the geometric mean of XLA time / jdet time and the ``worst`` cases."""
  for pass_ in dict.fromkeys(r.pass_ for r in table):
    ratios = [r for r in table if r.pass_ == pass_ and math.isfinite(r.speedup)]
    mean = math.exp(sum(math.log(r.speedup) for r in ratios) / len(ratios))
    print(f"\n{pass_}: geometric mean {mean:.3f}x over {len(ratios)} cases; "
          f"{sum(r.speedup < 0.95 for r in ratios)} below 0.95x; worst:")
    print(bench.markdown_table(sorted(ratios, key=lambda r: r.speedup)[:worst]))


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--m", type=int, action="append", help="only these M (repeatable)")
  parser.add_argument("--plot", metavar="PNG", help="also plot the ratio against M")
  parser.add_argument("--backend", choices=BACKENDS, action="append",
                      help="jdet backend to time or plot (repeatable); default: pallas "
                           "(all backends with --from-results)")
  parser.add_argument("--grid", action="store_true",
                      help="the shape-general grid (model weights x MATMUL_GRID_M)")
  parser.add_argument("--weights", action="append",
                      help="with --grid: only weights whose name contains this (repeatable)")
  parser.add_argument("--pass", dest="passes", action="append", choices=("fwd", "fwd+bwd"),
                      help="with --grid: passes to time (repeatable; default fwd)")
  parser.add_argument("--min-m", type=int, default=1, help="with --grid: skip smaller M")
  parser.add_argument("--copies", type=int, default=2,
                      help="with --grid: input sets per case (fewer compile faster, but where "
                           "all the sets fit in L2 they stay there between calls)")
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
  if args.grid and bench.on_gpu():
    weights = [kn for name, kn in MATMUL_MODEL_WEIGHTS.items()
               if not args.weights or any(w in name for w in args.weights)]
    shapes = [(m, kn) for kn in weights for m in MATMUL_GRID_M
              if m >= args.min_m and (not args.m or m in args.m)]
    table = bench.report("jdet.matmul, shape-general grid", matmul_bench_cases(
        shapes, backends=tuple(args.backend or ("pallas",)),
        passes=tuple(args.passes or ("fwd",))), most_copies=args.copies)
    grid_summary(table)
    if args.plot:
      plot_ratio_vs_m(table, args.plot)
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
