"""jdet.matmul vs XLA's jnp.dot (cuBLAS on GPU), forward and forward+backward, bf16.

Run: ``PYTHONPATH=. python3 benchmarks/bench_matmul.py [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness

M_VALUES = (1, 16, 64, 256, 1024, 4096, 16384)
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


def rows(cases=CASES, dtype=jnp.bfloat16) -> list[harness.Row]:
  result = []
  for m, (k, n) in cases:
    per_set = (m * k + k * n + 2 * m * n) * jnp.dtype(dtype).itemsize
    sets = [(harness.random_normal(3 * i, (m, k), dtype),
             harness.random_normal(3 * i + 1, (k, n), dtype),
             harness.random_normal(3 * i + 2, (m, n), dtype))
            for i in range(harness.copies_for(per_set))]
    flops = 2 * m * k * n
    for pass_, jdet_fn, xla_fn, passes, args in (
        ("fwd", jdet.matmul, _xla_matmul, 1, [s[:2] for s in sets]),
        ("fwd+bwd", _fwd_bwd(jdet.matmul), _fwd_bwd(_xla_matmul), 3, sets)):
      ours = harness.time_us(jdet_fn, args)
      theirs = harness.time_us(xla_fn, args)
      result.append(harness.Row(
          "matmul", f"M={m} K={k} N={n}", pass_, ours, "jnp.dot (XLA)", theirs,
          {"jdet TFLOP/s": f"{passes * flops / ours / 1e6:.1f}",
           "XLA TFLOP/s": f"{passes * flops / theirs / 1e6:.1f}"}))
      print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def plot_ratio_vs_m(table: list[harness.Row], path: str) -> None:
  """One line per (K, N) and pass: XLA time / jdet time against M (log scale)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
  for ax, pass_ in zip(axes, ("fwd", "fwd+bwd")):
    series = {}
    for row in table:
      if row.pass_ == pass_:
        m, k, n = (int(part.split("=")[1]) for part in row.case.split())
        series.setdefault((k, n), []).append((m, row.speedup))
    for (k, n), points in sorted(series.items()):
      ax.plot(*zip(*sorted(points)), "o-", label=f"K={k} N={n}")
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
  parser.add_argument("--from-results", metavar="MD",
                      help="plot rows recorded in a results file instead of measuring")
  args = parser.parse_args()
  if args.from_results:
    with open(args.from_results) as f:
      plot_ratio_vs_m(harness.rows_from_markdown(f.read(), "matmul"), args.plot)
    return
  table = harness.print_report("jdet.matmul", rows,
                               [c for c in CASES if not args.m or c[0] in args.m],
                               QUICK_CASES, quick=args.quick)
  if args.plot:
    plot_ratio_vs_m(table, args.plot)


if __name__ == "__main__":
  main()
