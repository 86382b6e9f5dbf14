"""jdet.token_logprobs vs XLA's unfused LM-head log-probs, forward and forward+backward.

Baseline: ``take_along_axis(jax.nn.log_softmax(jnp.dot(h, w,
preferred_element_type=f32) / temperature), tokens)``, which materialises the
[T, V] float32 logits. A second table gives both sides' peak temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``); the
targets are at least XLA's speed and, where jdet's logits would pass 1 GiB
(``pallas_kernels.softmax.token_whole_vocab``; the forward then holds at most
512 MiB of them at a time, the gradient streams the vocabulary), at most 1/8 of its
temporary memory; below, jdet holds the logits too, for speed. The
cases are the op registry's (``TOKEN_LOGPROBS_BENCH``, ``TOKEN_LOGPROBS_QUICK``,
``token_logprobs_bench_cases`` in :mod:`jdet._registry`).

Run: ``PYTHONPATH=. python3 benchmarks/bench_token_logprobs.py [--quick] [--memory-only]``.
"""

from __future__ import annotations

import argparse

import jax

from jdet import bench
from jdet._registry import (TOKEN_LOGPROBS_BENCH, TOKEN_LOGPROBS_QUICK,
                            token_logprobs_bench_cases)


def _temp_mib(fn, args) -> float:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def print_memory_table(cases) -> None:
  """Prints each case's peak temporary memory, jdet against XLA, as it is measured."""
  print("| case | pass | jdet temp MiB | XLA temp MiB | jdet / XLA |\n|---|---|---|---|---|",
        flush=True)
  for case in cases:
    args = jax.eval_shape(lambda: case.make_args(0))
    ours, theirs = _temp_mib(case.fn, args), _temp_mib(case.baseline_fn, args)
    print(f"| {case.case} | {case.pass_} | {ours:.0f} | {theirs:.0f} | "
          f"{ours / max(theirs, 1e-9):.3f} |", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--memory-only", action="store_true",
                      help="only the first shape's peak temporary memory (compiles, runs nothing)")
  args = parser.parse_args()
  shapes = TOKEN_LOGPROBS_QUICK if args.quick or not bench.on_gpu() else TOKEN_LOGPROBS_BENCH
  cases = token_logprobs_bench_cases(shapes)
  if not args.memory_only:
    bench.report("jdet.token_logprobs", cases)
  print_memory_table(cases[:2] if args.memory_only else cases)


if __name__ == "__main__":
  main()
