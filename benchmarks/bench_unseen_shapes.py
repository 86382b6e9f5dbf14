"""Every op at shapes outside its benchmark list: the check that speed holds on
the shapes users bring, not only on the ones the rules were tuned on.

The shapes are model sizes the benchmark lists do not hold (Qwen2.5, Llama-3 70B,
Qwen3 MoE, GPT-2's odd vocabulary), row counts between the tile sizes, and odd
lengths; the cases and the timing are the op registry's and the one harness's
(:mod:`jdet._registry`, :mod:`jdet.bench`), so the rows read as `python -m jdet
bench`'s. Results: benchmarks/results/h100.md (nineteenth session).

Run: ``PYTHONPATH=. python3 benchmarks/bench_unseen_shapes.py [--part NAME ...]``
(parts: rows, attention, token_logprobs, matmul, matmul_random; default all; on
a CPU the kernels run in interpret mode and the timings mean nothing).
``matmul_random`` draws its GEMM sizes at random from a fixed seed
(benchmarks/results/h100_unseen_shapes.md, fortieth section), or from ``--seed``.
"""

from __future__ import annotations

import argparse
import math

import jax.numpy as jnp
import numpy as np

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


def _random_gemm_sizes(rng, min_m: int) -> tuple[int, int, int]:
  """(M, K, N): M log-uniform in min_m-16384, K and N log-uniform in 256-16384, each
  rounded down to a multiple of 128 with probability 0.5, of 8 with 0.3, left as drawn
  with 0.2; drawn again until K N <= 2^27 and M K N <= 2^39 (a bounded time)."""
  def dim():
    size = round(math.exp(rng.uniform(math.log(256), math.log(16384))))
    align = int(rng.choice((128, 8, 1), p=(0.5, 0.3, 0.2)))
    return max(align, size // align * align)

  while True:
    m = round(math.exp(rng.uniform(math.log(min_m), math.log(16384))))
    k, n = dim(), dim()
    if k * n <= 2 ** 27 and m * k * n <= 2 ** 39:
      return m, k, n


def matmul_random_cases(seed: int = 20261128, forward: int = 70, backward: int = 16):
  """GEMMs at sizes drawn at random (:func:`_random_gemm_sizes`): ``forward``
  forward cases, then ``backward`` forward+backward ones with M >= 64."""
  rng = np.random.default_rng(seed)
  fwd = [_random_gemm_sizes(rng, 1) for _ in range(forward)]
  bwd = [_random_gemm_sizes(rng, 64) for _ in range(backward)]
  return [*registry.matmul_bench_cases([(m, (k, n)) for m, k, n in fwd], passes=("fwd",)),
          *registry.matmul_bench_cases([(m, (k, n)) for m, k, n in bwd], passes=("fwd+bwd",))]


PARTS = {"rows": row_op_cases, "attention": attention_cases,
         "token_logprobs": token_logprobs_cases, "matmul": matmul_cases,
         "matmul_random": matmul_random_cases}


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--part", choices=list(PARTS), action="append",
                      help="only these cases (repeatable); default: all")
  parser.add_argument("--copies", type=int, default=2,
                      help="input sets per case (fewer compile faster, but where "
                           "all the sets fit in L2 they stay there between calls)")
  parser.add_argument("--seed", type=int,
                      help="matmul_random's seed, for a fresh draw (default: the fixed seed of "
                           "its table in benchmarks/results/h100_unseen_shapes.md)")
  args = parser.parse_args()
  for part in args.part or PARTS:
    draw = {"seed": args.seed} if part == "matmul_random" and args.seed is not None else {}
    bench.report(f"unseen shapes: {part}", PARTS[part](**draw), most_copies=args.copies)


if __name__ == "__main__":
  main()
