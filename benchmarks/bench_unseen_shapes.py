"""Every op at shapes outside its benchmark list: the check that speed holds on
the shapes users bring, not only on the ones the rules were tuned on.

The shapes are model sizes the benchmark lists do not hold (Qwen2.5, Llama-3 70B,
Qwen3 MoE, GPT-2's odd vocabulary), row counts between the tile sizes, and odd
lengths; the cases and the timing are the op registry's and the one harness's
(:mod:`jdet._registry`, :mod:`jdet.bench`), so the rows read as `python -m jdet
bench`'s. Results: benchmarks/results/h100.md (nineteenth session).

Run: ``PYTHONPATH=. python3 benchmarks/bench_unseen_shapes.py [--part NAME ...]``
(parts: rows, attention, token_logprobs, matmul; default all; on a CPU the
kernels run in interpret mode and the timings mean nothing).
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from jdet import bench
from jdet import _registry as registry


def row_op_cases():
  """rms_norm, softmax/log_softmax, Sinkhorn and tri_inverse."""
  return [
      *registry.rms_norm_bench_cases(((3, 3584), (300, 5120), (777, 2048), (5000, 3584),
                                      (12288, 5120), (4097, 8192), (1000, 896),
                                      (4096, 10001))),
      *registry.softmax_bench_cases(((1000, 32000, jnp.bfloat16), (3000, 50257, jnp.float32),
                                     (777, 4096, jnp.float32), (300, 128256, jnp.bfloat16),
                                     (20000, 1000, jnp.float32), (1024, 50257, jnp.bfloat16),
                                     (4096, 32001, jnp.bfloat16))),
      *registry.sinkhorn_bench_cases(((5000, 4), (30001, 8), (100000, 4))),
      *registry.tri_inverse_bench_cases(((3000, 64), (20000, 32), (1000, 128)),
                                        baselines=("solve_triangular",)),
  ]


def attention_cases():
  """Prefill and decode with the heads of Qwen2.5-7B, Llama-3 70B, a 64-wide head
  without GQA, and multi-head attention."""
  return [case for heads, configs in (
      ((28, 4, 128), (("prefill", 2, 3000, 3000), ("decode", 3, 1, 5000),
                      ("decode", 40, 1, 2000))),
      ((64, 8, 128), (("prefill", 1, 2048, 2048), ("decode", 16, 1, 8192))),
      ((16, 16, 64), (("prefill", 2, 2048, 2048), ("decode", 32, 1, 2000))),
      ((32, 32, 128), (("decode", 4, 1, 4096),)),
  ) for case in registry.attention_bench_cases(configs, heads=heads)]


def token_logprobs_cases():
  """Decode-sized to training-sized T on Llama-3 70B, Qwen2.5, Llama-2 and GPT-2 heads."""
  return registry.token_logprobs_bench_cases((
      (16, 8192, 128256), (64, 4096, 151936), (300, 2048, 50257), (400, 3584, 152064),
      (1000, 3584, 152064), (1500, 4096, 151936), (2000, 4096, 32000), (4096, 4096, 32000),
      (8192, 4096, 32000), (8192, 4096, 151936)))


def matmul_cases():
  """The Llama-3 70B and Qwen2.5-7B weights at M between the benchmark's sizes."""
  names = [n for n in registry.MATMUL_MODEL_WEIGHTS if "70b" in n or "qwen2.5" in n]
  weights = [registry.MATMUL_MODEL_WEIGHTS[n] for n in names]
  return [*registry.matmul_bench_cases([(m, kn) for kn in weights for m in (5, 300, 1000, 5000)],
                                       passes=("fwd",)),
          *registry.matmul_bench_cases([(m, kn) for kn in weights[:5] for m in (300, 5000)],
                                       passes=("fwd+bwd",))]


PARTS = {"rows": row_op_cases, "attention": attention_cases,
         "token_logprobs": token_logprobs_cases, "matmul": matmul_cases}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--part", choices=list(PARTS), action="append",
                      help="only these cases (repeatable); default: all")
  parser.add_argument("--copies", type=int, default=2,
                      help="input sets per case (fewer compile faster)")
  args = parser.parse_args()
  for part in args.part or PARTS:
    bench.report(f"unseen shapes: {part}", PARTS[part](), most_copies=args.copies)


if __name__ == "__main__":
  main()
