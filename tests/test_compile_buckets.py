"""Row counts of one bucket compile to the same GPU kernels (issue 24).

The row-parallel Triton kernels read their row count from an operand and run on
a bucketed grid (``pallas_kernels._common.counted_rows_call``), so every count
whose programs share a bucket lowers to the same kernels (IR, grid, warps); XLA's
kernel cache then serves a new count from the compiled kernels of an old one.
These tests lower each op's forward and backward for the GPU on any machine and
compare. The GEMM kernels (the LM head's in token_logprobs) still depend on the
row count and are left out; so does attention.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import lowered_triton_kernels
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


def _tri_inverse(rows):
  a = (jax.ShapeDtypeStruct((rows, 16, 16), jnp.float32),)
  return jax.grad(_loss(lambda a: jdet.tri_inverse(a, interpret=False))), a


CASES = {"rms_norm": _rms_norm, "log_softmax": _softmax, "sinkhorn": _sinkhorn,
         "token_logprobs": _token_logprobs, "tri_inverse": _tri_inverse}


def _row_kernels(case, rows):
  fn, args = CASES[case](rows)
  return [k for k in lowered_triton_kernels(fn, *args) if 'name = "jdet_matmul' not in k]


@pytest.mark.parametrize("case", sorted(CASES))
def test_row_counts_of_a_bucket_lower_to_the_same_kernels(case):
  first, second = (_row_kernels(case, rows) for rows in SAME_BUCKET)
  assert first, "the op lowered to no row kernel"
  assert second == first
  assert _row_kernels(case, NEXT_BUCKET) != first


def test_bucketed_grid_adds_at_most_a_quarter():
  programs = np.arange(1, 100_000)
  grids = np.array([bucketed_grid(int(p)) for p in programs])
  assert (grids >= programs).all() and (grids <= np.maximum(programs, 1.25 * programs)).all()
  assert len(set(grids[programs > 8])) < 4 * np.log2(100_000)
  for p in (1, 8, 9, 17, 1000, 1024, 1025):
    assert bucketed_grid(bucketed_grid(p)) == bucketed_grid(p)
