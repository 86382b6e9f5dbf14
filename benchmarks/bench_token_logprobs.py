"""jdet.token_logprobs vs XLA's unfused LM-head log-probs, forward and forward+backward.

Baseline: ``take_along_axis(jax.nn.log_softmax(jnp.dot(h, w,
preferred_element_type=f32) / temperature), tokens)``, which materialises the
[T, V] float32 logits. Each row also reports both sides' peak temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``); the
target is at most 1/8 of the baseline's and at least its speed.

Run: ``PYTHONPATH=. python3 benchmarks/bench_token_logprobs.py [--quick]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jdet
from benchmarks import harness

TEMPERATURE = 0.7
# (T, D, V): the LM head (Qwen-sized vocab), a Llama-3 vocab, and decode.
CASES = ((8192, 4096, 151936), (8192, 4096, 128256), (64, 4096, 151936))
QUICK_CASES = ((16, 64, 300),)


def _jdet(h, w, t):
  return jdet.token_logprobs(h, w, t, temperature=TEMPERATURE)


def _xla(h, w, t):
  logits = jnp.dot(h, w, preferred_element_type=jnp.float32) / TEMPERATURE
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[:, None], -1)[:, 0]


def _fwd_bwd(fn):
  def run(h, w, t, g):
    out, vjp = jax.vjp(lambda h, w: fn(h, w, t), h, w)
    return out, *vjp(g)
  return run


def _first(fn):
  return lambda h, w, t, g: fn(h, w, t)


def _temp_bytes(fn, args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def rows(cases=CASES) -> list[harness.Row]:
  result = []
  for t_rows, d, vocab in cases:
    rng = np.random.default_rng(0)
    per_set = (t_rows * d + d * vocab) * 2
    sets = [(harness.random_normal(3 * i, (t_rows, d), jnp.bfloat16),
             harness.random_normal(3 * i + 1, (d, vocab), jnp.bfloat16) * 0.02,
             jnp.asarray(rng.integers(0, vocab, (t_rows,)), jnp.int32),
             harness.random_normal(3 * i + 2, (t_rows,), jnp.float32))
            for i in range(harness.copies_for(per_set, budget_bytes=4 << 30, most=2))]
    for pass_, wrap, passes in (("fwd", _first, 1), ("fwd+bwd", _fwd_bwd, 3)):
      ours = harness.time_us(wrap(_jdet), sets)
      theirs = harness.time_us(wrap(_xla), sets)
      ours_mem, theirs_mem = (_temp_bytes(wrap(fn), sets[0]) for fn in (_jdet, _xla))
      flops = passes * 2 * t_rows * d * vocab
      result.append(harness.Row(
          "token_logprobs", f"T={t_rows} D={d} V={vocab} bf16", pass_, ours,
          "XLA dot + log_softmax + gather", theirs,
          {"jdet TFLOP/s": f"{flops / ours / 1e6:.1f}",
           "jdet temp MiB": f"{ours_mem / 2**20:.0f}",
           "XLA temp MiB": f"{theirs_mem / 2**20:.0f}",
           "temp ratio": f"{ours_mem / max(theirs_mem, 1):.3f}"}))
      print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  args = parser.parse_args()
  harness.print_report("jdet.token_logprobs", rows, CASES, QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
