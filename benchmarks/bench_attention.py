"""jdet.dot_product_attention vs jax.nn.dot_product_attention, bf16, H = 128, N = 32, K = 8.

Prefill (causal, T = S, forward and forward+backward) is compared with
``implementation="cudnn"`` where it compiles, else ``"xla"``; the baseline
column says which ran. Decode (T = 1 against a full cache of S keys, passed as
``key_value_seq_lengths``) is compared with ``implementation="xla"``.
Prefill rows give TFLOP/s (causal: half the square; forward+backward counts
3.5x the forward's FLOPs), decode rows the K/V bytes read per second.

Run: ``PYTHONPATH=. python3 benchmarks/bench_attention.py [--quick]``.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import jdet
from benchmarks import harness

N, K, H = 32, 8, 128
# (kind, B, T, S)
CASES = (
    ("prefill", 1, 4096, 4096),
    ("prefill", 4, 4096, 4096),
    *(("decode", b, 1, s) for s in (4096, 32768) for b in (1, 8, 64)),
)
QUICK_CASES = (("prefill", 1, 32, 32), ("decode", 2, 1, 64))  # CPU interpret: finishes


def _ours(causal):
  def run(q, k, v, lengths):
    return jdet.dot_product_attention(q, k, v, is_causal=causal, key_value_seq_lengths=lengths)
  return run


def _theirs(causal, implementation):
  def run(q, k, v, lengths):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation,
                                        key_value_seq_lengths=None if causal else lengths)
  return run


def _fwd_bwd(fn):
  def run(q, k, v, lengths, dout):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, lengths), q, k, v)
    return out, *vjp(dout)
  return run


def _prefill_baseline(args) -> str:
  """"cudnn" if jax.nn's cuDNN attention compiles for these inputs, else "xla"."""
  try:
    jax.jit(_fwd_bwd(_theirs(True, "cudnn"))).lower(*args).compile()
    return "cudnn"
  except Exception:  # noqa: BLE001 - cuDNN missing, too old, or no GPU
    return "xla"


def rows(cases=CASES, dtype=jnp.bfloat16) -> list[harness.Row]:
  result = []
  for kind, b, t, s in cases:
    itemsize = jnp.dtype(dtype).itemsize
    per_set = (2 * b * t * N * H + 2 * b * s * K * H) * itemsize
    sets = [(harness.random_normal(4 * i, (b, t, N, H), dtype),
             harness.random_normal(4 * i + 1, (b, s, K, H), dtype),
             harness.random_normal(4 * i + 2, (b, s, K, H), dtype),
             jnp.full((b,), s, jnp.int32),
             harness.random_normal(4 * i + 3, (b, t, N, H), dtype))
            for i in range(harness.copies_for(per_set))]
    causal = kind == "prefill"
    case = f"{kind} B={b} T={t} S={s}"
    if causal:
      impl = _prefill_baseline(sets[0])
      flops = 4 * b * N * t * s * H / 2
      passes = (("fwd", lambda f: f, 1.0, [x[:4] for x in sets]),
                ("fwd+bwd", _fwd_bwd, 3.5, sets))
    else:
      impl = "xla"
      kv_bytes = 2 * b * s * K * H * itemsize
      passes = (("fwd", lambda f: f, 1.0, [x[:4] for x in sets]),)
    for pass_, wrap, scale, args in passes:
      ours = harness.time_us(wrap(_ours(causal)), args)
      theirs = harness.time_us(wrap(_theirs(causal, impl)), args)
      if causal:
        extra = {"jdet TFLOP/s": f"{scale * flops / ours / 1e6:.1f}",
                 "baseline TFLOP/s": f"{scale * flops / theirs / 1e6:.1f}"}
      else:
        extra = {"jdet KV GB/s": f"{kv_bytes / ours / 1e3:.0f}",
                 "baseline KV GB/s": f"{kv_bytes / theirs / 1e3:.0f}"}
      result.append(harness.Row("dot_product_attention", case, pass_, ours,
                                f"jax.nn ({impl})", theirs, extra))
      print(harness.markdown_table(result[-1:]).splitlines()[-1], flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  parser.add_argument("--kind", choices=("prefill", "decode"), action="append",
                      help="only these cases (repeatable)")
  args = parser.parse_args()
  harness.print_report("jdet.dot_product_attention", functools.partial(rows),
                       [c for c in CASES if not args.kind or c[0] in args.kind],
                       QUICK_CASES, quick=args.quick)


if __name__ == "__main__":
  main()
