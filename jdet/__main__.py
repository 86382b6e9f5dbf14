"""``python -m jdet check`` and ``python -m jdet bench``: the report of what jdet does here."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
  # The check and the fuzz run worker processes on the same GPU (jdet/_workers.py):
  # before anything starts jax's backend, this process stops claiming most of its memory.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from jdet.testing import synchronous_cpu_dispatch
  synchronous_cpu_dispatch()  # before the first computation: see its docstring
  from jdet._registry import OPS
  parser = argparse.ArgumentParser(prog="python -m jdet", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  check = sub.add_parser("check", help="invariance, determinism and accuracy of every op")
  check.add_argument("--op", choices=list(OPS), action="append",
                     help="only this op (repeatable); default: all")
  check.add_argument("--small", action="store_true",
                     help="small shapes even on a GPU (the CPU default)")
  check.add_argument("--trials", type=int, default=None,
                     help="instead of the report, run this many seeded random invariance "
                          "trials per op (jdet.fuzz); each failure prints a one-line repro")
  check.add_argument("--seed", type=int, default=0, help="seed of the --trials fuzz")
  check.add_argument("--pool", type=int, default=None,
                     help="with --trials: draw the trials' cases (shapes, dtypes, options) "
                          "from this many per op, so that compiled programs repeat")
  check.add_argument("--workers", type=int, default=None,
                     help="worker processes that run the cases (or the trials) and share "
                          "a compilation cache; default: one per two cores on a GPU (at most "
                          "8), none on a CPU (the --trials fuzz: none)")
  bench = sub.add_parser("bench", help="timings versus XLA, as a table and a plot")
  bench.add_argument("--op", choices=list(OPS), action="append",
                     help="only this op (repeatable); default: all")
  bench.add_argument("--out", default=None,
                     help="folder for results.md and results.png (first_call.* with --first-call)")
  bench.add_argument("--first-call", action="store_true",
                     help="instead of steady-state times, the first call's latency (trace, "
                          "compile, run) at three sizes nothing else compiled, vs the baseline's")
  args = parser.parse_args(argv)
  if args.command == "check" and args.workers is not None and args.workers < 1:
    parser.error(f"--workers must be >= 1, got {args.workers}")
  if args.command == "check" and args.trials is not None:
    if args.trials < 1:
      parser.error(f"--trials must be >= 1, got {args.trials}")
    if args.pool is not None and args.pool < 1:
      parser.error(f"--pool must be >= 1, got {args.pool}")
    from jdet import fuzz
    return fuzz.main(args.op, args.trials, args.seed, args.pool, args.workers or 1)
  if args.command == "check":
    from jdet import check as check_module
    return check_module.main(args.op, full=False if args.small else None,
                             workers=args.workers)
  return _bench(args.op or list(OPS), args.out, first_call=args.first_call)


def _bench(ops, out_dir, *, first_call: bool = False) -> int:
  from jdet import bench
  from jdet._registry import OPS
  title = "jdet bench --first-call" if first_call else "jdet bench"
  builders = [OPS[op].first_call_cases if first_call else OPS[op].bench_cases for op in ops]
  rows = bench.report(title, [c for build in builders for c in build(bench.on_gpu())],
                      first_call=first_call)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "first_call" if first_call else "results")
    with open(stem + ".md", "w") as f:
      f.write(f"# {title} on {bench.device_description()}\n\n")
      if bench.interpret_warning():
        f.write(bench.interpret_warning() + "\n\n")
      f.write(bench.markdown_table(rows) + "\n")
    print(f"wrote {stem}.md" + (f" and {stem}.png" if bench.plot(rows, stem + ".png") else
                                " (no plot: install matplotlib, e.g. pip install -e '.[plot]')"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
