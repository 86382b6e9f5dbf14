"""Seeded random sweep over shapes, dtypes, leading dims and batch splits, all ops.

Each case draws a shape, splits the flattened batch at a random point, and asserts
that the two chunks' results concatenated are bitwise the full call's, and that
the full call is accurate. CPU runs a few cases per op; the GPU sweep many more.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import assert_bitwise_equal

CPU_CASES, GPU_CASES = 4, 40
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _leading_dims(rng, total):
  """Splits ``total`` rows into one or two leading dims (e.g. [batch, seq])."""
  divisors = [d for d in range(1, total + 1) if total % d == 0]
  first = int(rng.choice(divisors))
  return (total,) if rng.integers(2) else (first, total // first)


def _split_check(fn, x, rng, *, what):
  """fn on x's leading dims flattened, whole vs two chunks at a random row."""
  full = fn(x)
  rows = x.reshape((-1,) + x.shape[-2:])
  cut = int(rng.integers(1, rows.shape[0])) if rows.shape[0] > 1 else 1
  parts = [fn(rows[:cut])] + ([fn(rows[cut:])] if cut < rows.shape[0] else [])
  assert_bitwise_equal(jnp.concatenate(parts), full.reshape((-1,) + full.shape[-2:]),
                       what=f"{what}, split at {cut}")
  return full


def _matmul_case(rng):
  total, k, n = int(rng.integers(1, 70)), int(rng.integers(1, 150)), int(rng.integers(1, 100))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  a = jnp.asarray(rng.standard_normal(_leading_dims(rng, total) + (k,)), jnp.float32)
  a = a.astype(dtype)
  b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32).astype(dtype)
  what = f"matmul {dtype.__name__} a{a.shape} b{b.shape}"
  if a.ndim == 2:
    a = a[None]
  out = _split_check(lambda x: jdet.matmul(x, b), a, rng, what=what)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  tol = {jnp.float32: 2e-3 if jax.default_backend() == "gpu" else 1e-5,
         jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
  assert np.abs(np.asarray(out, np.float64) - ref).max() <= tol * max(np.abs(ref).max(), 1), what


def _sinkhorn_case(rng):
  n = int(rng.choice([1, 2, 3, 4, 8, 16]))
  total = int(rng.integers(1, 50))
  iters = int(rng.integers(1, 8))
  init = str(rng.choice(["softmax", "exp"]))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  logits = jnp.asarray(3 * rng.standard_normal(_leading_dims(rng, total) + (n, n)),
                       jnp.float32).astype(dtype)
  fn = functools.partial(jdet.sinkhorn, iters=iters, init=init)
  what = f"sinkhorn n={n} iters={iters} init={init} {dtype.__name__} {logits.shape}"
  out = _split_check(lambda x: fn(x), logits.reshape((-1, n, n)), rng, what=what)
  ref = jdet.sinkhorn_reference(logits.astype(jnp.float32), iters=iters, init=init)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref).reshape(out.shape),
                             rtol=1e-5, atol=1e-6, err_msg=what)


def _tri_inverse_case(rng):
  n = int(rng.choice([16, 32]))
  total = int(rng.integers(1, 12))
  dtype = DTYPES[rng.integers(len(DTYPES))]
  a = jdet.gdn_chunk_matrices(jax.random.key(int(rng.integers(1 << 30))), total, n)
  a = a.astype(dtype)
  what = f"tri_inverse n={n} {dtype.__name__} [{total},{n},{n}]"
  out = _split_check(jdet.tri_inverse, a, rng, what=what)
  exact = np.linalg.inv(np.eye(n) - np.tril(np.asarray(a, np.float64), -1))
  assert np.abs(np.asarray(out, np.float64) - exact).max() <= 1e-5 * np.abs(exact).max(), what


CASES = {"matmul": _matmul_case, "sinkhorn": _sinkhorn_case, "tri_inverse": _tri_inverse_case}


@pytest.mark.parametrize("op", sorted(CASES))
def test_random_sweep_cpu(op):
  rng = np.random.default_rng(2026)
  for _ in range(CPU_CASES):
    CASES[op](rng)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(CASES))
def test_random_sweep_gpu(op):
  rng = np.random.default_rng(11)
  for _ in range(GPU_CASES):
    CASES[op](rng)
