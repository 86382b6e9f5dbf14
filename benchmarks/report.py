"""``python -m jdet bench``: every op's benchmark, one table, a markdown file and a plot."""

from __future__ import annotations

import importlib
import os

from benchmarks import harness


def _plot(rows, path) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
  except ImportError:
    return False
  ops = sorted({r.op for r in rows})
  fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.5 * len(ops)), squeeze=False)
  for ax, op in zip(axes[:, 0], ops):
    mine = [r for r in rows if r.op == op]
    for pass_ in sorted({r.pass_ for r in mine}):
      sel = [r for r in mine if r.pass_ == pass_]
      ax.plot(range(len(sel)), [r.speedup for r in sel], "o-", label=pass_)
      ax.set_xticks(range(len(sel)), [r.case for r in sel], rotation=60, ha="right",
                    fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("baseline time / jdet time")
    ax.set_title(f"{op} vs {mine[0].baseline}")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def main(ops, out_dir=None) -> int:
  modules = [importlib.import_module(f"benchmarks.bench_{op}") for op in ops]
  rows = harness.print_report(
      "jdet bench", lambda selected: [r for module, cases in selected for r in module.rows(cases)],
      [(m, m.CASES) for m in modules], [(m, m.QUICK_CASES) for m in modules], quick=False)
  table = harness.markdown_table(rows)
  warning = harness.interpret_warning()
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
      f.write(f"# jdet bench on {harness.device_description()}\n\n")
      if warning:
        f.write(warning + "\n\n")
      f.write(table + "\n")
    png = os.path.join(out_dir, "results.png")
    print(f"wrote {os.path.join(out_dir, 'results.md')}"
          + (f" and {png}" if _plot(rows, png) else
             " (no plot: install matplotlib, e.g. pip install -e '.[plot]')"))
  return 0
