"""Row counts of one bucket compile to the same GPU kernels (issue 24).

The row-parallel Triton kernels read their row count from an operand and run on
a bucketed grid (``pallas_kernels._common.counted_call`` and its row and axis
forms), so every count whose programs share a bucket lowers to the same kernels
(IR, grid, warps); XLA's kernel cache then serves a new count from the compiled
kernels of an old one. That covers the row ops, the GEMM's Triton forward and dA
(the rows of its tiles; the LM head's in token_logprobs too) and every Triton
attention kernel (the sequences of a batch), and so a model's decode step. These
tests lower each op's forward and backward for the GPU on any machine and
compare. Left out: the GEMM's dB kernel, whose contraction is the token count,
and the Mosaic GPU kernels, whose TMA descriptors take the arrays' shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import lowered_triton_kernels
from pallas_kernels import matmul as matmul_kernels
from pallas_kernels._common import bucketed_grid

# 1000 and 1024 rows share a bucket for every power-of-two rows-per-program up to
# 256; 1025 starts the next one.
SAME_BUCKET, NEXT_BUCKET = (1000, 1024), 1025


def _loss(fn):
  return lambda x, *rest: jnp.sum(jnp.square(fn(x, *rest).astype(jnp.float32)))


def _rms_norm(rows):
  x = jax.ShapeDtypeStruct((rows, 640), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((640,), jnp.bfloat16)
  fn = lambda x, r, w: jdet.rms_norm(x, w, residual=r, interpret=False)[0]  # noqa: E731
  return jax.grad(_loss(fn), argnums=(0, 1, 2)), (x, x, w)


def _softmax(rows):
  return (jax.grad(_loss(lambda x: jdet.log_softmax(x, interpret=False))),
          (jax.ShapeDtypeStruct((rows, 300), jnp.float32),))


def _sinkhorn(rows):
  x = (jax.ShapeDtypeStruct((rows, 4, 4), jnp.float32),)
  unrolled = jax.grad(_loss(lambda x: jdet.sinkhorn(x, interpret=False)))
  implicit = jax.grad(_loss(lambda x: jdet.sinkhorn(x, grad="implicit", interpret=False)))
  return (lambda x: (unrolled(x), implicit(x))), x


def _token_logprobs(rows):
  h = jax.ShapeDtypeStruct((rows, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((64, 5000), jnp.float32)
  t = jax.ShapeDtypeStruct((rows,), jnp.int32)
  fn = lambda h, w, t: jdet.token_logprobs(h, w, t, interpret=False)  # noqa: E731
  return jax.grad(lambda h, w, t: jnp.sum(fn(h, w, t) ** 2), argnums=(0, 1)), (h, w, t)


def _matmul(rows, dtype=jnp.float32):
  """Float32 by default: the Triton kernels on any GPU at any row count (an H100 runs
  16-bit GEMMs of more than 64 rows on its Mosaic GPU kernel)."""
  a = jax.ShapeDtypeStruct((rows, 96), dtype)
  b = jax.ShapeDtypeStruct((96, 80), dtype)
  return jax.grad(_loss(lambda a, b: jdet.matmul(a, b, interpret=False))), (a, b)


def _tri_inverse(rows):
  a = (jax.ShapeDtypeStruct((rows, 16, 16), jnp.float32),)
  return jax.grad(_loss(lambda a: jdet.tri_inverse(a, interpret=False))), a


CASES = {"rms_norm": _rms_norm, "log_softmax": _softmax, "sinkhorn": _sinkhorn,
         "token_logprobs": _token_logprobs, "tri_inverse": _tri_inverse, "matmul": _matmul}


def _row_kernels(case, rows, **options):
  fn, args = CASES[case](rows, **options)
  return [k for k in lowered_triton_kernels(fn, *args) if 'name = "jdet_matmul_at_b' not in k]


@pytest.mark.parametrize("case", sorted(CASES))
def test_row_counts_of_a_bucket_lower_to_the_same_kernels(case):
  first, second = (_row_kernels(case, rows) for rows in SAME_BUCKET)
  assert first, "the op lowered to no row kernel"
  assert second == first
  assert _row_kernels(case, NEXT_BUCKET) != first


def test_gemm_rows_that_one_tile_holds_lower_to_one_kernel():
  """Up to GPU_ONE_ROW_OF_TILES rows the bf16 GEMM (Triton on every GPU there) takes
  the smallest ladder tile that holds them all (matmul_plan.triton_tiles): every row
  count from one tile height up to the next (a decode batch of 1-16 rows, say) runs one
  compiled kernel."""
  heights = sorted({t.block_m for t in matmul_kernels.GPU_MATMUL_LADDER
                    if t.block_m <= matmul_kernels.GPU_ONE_ROW_OF_TILES})
  kernels = functools.partial(_row_kernels, "matmul", dtype=jnp.bfloat16)
  lowest = 1
  for height in heights:
    first = kernels(lowest)
    assert first, "the GEMM lowered to no Triton kernel"
    assert kernels(height) == first, f"{lowest} and {height} rows"
    assert kernels(height + 1) != first, f"{height} and {height + 1} rows"
    lowest = height + 1


# 9 and 10 sequences share a bucket of the batch axis; 11 starts the next one.
SAME_BATCH_BUCKET, NEXT_BATCH_BUCKET = (9, 10), 11


def _attention_kernels(batch):
  """Forward and gradients of a causal prefill (Triton) and of decode steps into a
  cache of 1024 keys (the split-KV path): every Triton attention kernel."""
  q = jax.ShapeDtypeStruct((batch, 5, 4, 16), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((batch, 5, 2, 16), jnp.bfloat16)
  step = jax.ShapeDtypeStruct((batch, 1, 4, 16), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((batch, 1024, 2, 16), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
  prefill = jax.grad(_loss(lambda q, k, v: jdet.dot_product_attention(
      q, k, v, is_causal=True, interpret=False)), argnums=(0, 1, 2))
  decode = functools.partial(jdet.dot_product_attention, is_causal=True, interpret=False)

  def both(q, k, v, step, cache, lengths):
    return prefill(q, k, v), decode(step, cache, cache, key_value_seq_lengths=lengths,
                                    query_offsets=lengths - 1)

  return lowered_triton_kernels(both, q, kv, kv, step, cache, lengths)


def _decode_step(batch, monkeypatch):
  """The Llama model's decode step (jdet ops, lowered for the GPU) at ``batch``."""
  from jdet import _backend
  from jdet.models import llama
  monkeypatch.setattr(_backend, "_platform", lambda arrays: "gpu")
  config = llama.CONFIGS["cpu"]
  params = jax.eval_shape(functools.partial(llama.init_params, config=config), jax.random.key(0))
  cache = jax.eval_shape(lambda: llama.init_cache(config, batch, 1024))
  token = jax.ShapeDtypeStruct((batch,), jnp.int32)
  step = functools.partial(llama.decode_step, config=config)
  return lowered_triton_kernels(step, params, token, cache)


def test_batch_sizes_of_a_bucket_lower_to_the_same_attention_kernels():
  first, second = (_attention_kernels(b) for b in SAME_BATCH_BUCKET)
  assert len(first) == 6, "prefill, delta, dK/dV, dQ, split and combine kernels"
  assert second == first
  assert _attention_kernels(NEXT_BATCH_BUCKET) != first


def test_decode_steps_of_a_bucket_lower_to_the_same_kernels(monkeypatch):
  """A rollout engine's new batch size in a bucket it has seen compiles none of jdet's
  kernels again."""
  first, second = (_decode_step(b, monkeypatch) for b in SAME_BATCH_BUCKET)
  assert first and second == first
  assert _decode_step(NEXT_BATCH_BUCKET, monkeypatch) != first


def test_bucketed_grid_adds_at_most_a_quarter():
  programs = np.arange(1, 100_000)
  grids = np.array([bucketed_grid(int(p)) for p in programs])
  assert (grids >= programs).all() and (grids <= np.maximum(programs, 1.25 * programs)).all()
  assert len(set(grids[programs > 8])) < 4 * np.log2(100_000)
  for p in (1, 8, 9, 17, 1000, 1024, 1025):
    assert bucketed_grid(bucketed_grid(p)) == bucketed_grid(p)
