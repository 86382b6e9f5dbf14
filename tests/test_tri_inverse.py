"""jdet.tri_inverse: accuracy, gradients, batch invariance, hostile inputs, errors.

The same tests run in Pallas interpret mode on CPU and natively on a GPU; the
``gpu``-marked tests add the large batches and every GPU tile config.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import (assert_batch_invariant, assert_bitwise_equal, assert_deterministic,
                          random_normal)
from jdet.tri_inverse import gdn_chunk_matrices, hostile_chunk_matrices
from pallas_kernels import tri_inverse as kernels
from jdet.bench import on_gpu

SIZES = (16, 32, 64, 128)
GDN, HOSTILE = 6, 2  # matrices of each family in the accuracy batch

# Relative error (max |X - X_exact| / max |X_exact|) vs float64 NumPy.
BLOCKED_TOLERANCE = 1e-6
# What "doubling" gives, as measured in f32 (documented in jdet.tri_inverse):
# (GDN bound, hostile lower bound, hostile upper bound).
DOUBLING_MEASURED = {
    16: (1e-6, 1e-5, 1e-3),    # measured 1.9e-7 and 2.4e-4
    32: (1e-5, 1.0, np.inf),   # 2.2e-6 and 8
    64: (1e-2, 1.0, np.inf),   # 8.8e-4 and 8.6e10
}

inverse = jax.jit(jdet.tri_inverse, static_argnames="method")


def _loss_grad(a, g, method="blocked"):
  return jax.grad(lambda a: jnp.sum(jdet.tri_inverse(a, method=method) * g))(a)


grad = jax.jit(_loss_grad, static_argnames="method")
grad_reference = jax.jit(
    jax.grad(lambda a, g: jnp.sum(jdet.tri_inverse_reference(a) * g)))


def _exact_inverse(a):
  lower = np.tril(np.asarray(a, np.float64), -1)
  return np.linalg.inv(np.eye(lower.shape[-1]) - lower)


def _relative_errors(x, a):
  """Per-matrix max |x - exact| / max |exact|."""
  exact = _exact_inverse(a)
  error = np.abs(np.asarray(x, np.float64) - exact).max(axis=(-2, -1))
  return error / np.abs(exact).max(axis=(-2, -1))


def _accuracy_batch(n):
  """GDN matrices then hostile ones, with garbage on and above the diagonal."""
  a = jnp.concatenate([gdn_chunk_matrices(jax.random.key(n), GDN, n),
                       hostile_chunk_matrices(HOSTILE, n)])
  return a + jnp.triu(jax.random.normal(jax.random.key(1), a.shape))


@pytest.fixture(scope="module")
def batch64():
  """64 GDN matrices of 32x32 and a cotangent, shared by the invariance tests."""
  a = gdn_chunk_matrices(jax.random.key(7), 64, 32)
  return a + jnp.triu(random_normal(8, a.shape)), random_normal(9, a.shape)


@pytest.mark.parametrize("n", SIZES)
def test_blocked_accurate_on_gdn_and_hostile_inputs(n):
  a = _accuracy_batch(n)
  errors = _relative_errors(inverse(a), a)
  assert errors.max() < BLOCKED_TOLERANCE, errors


@pytest.mark.parametrize("n", kernels.DOUBLING_SIZES)
def test_doubling_accuracy_is_as_documented(n):
  a = _accuracy_batch(n)
  errors = _relative_errors(inverse(a, method="doubling"), a)
  gdn_bound, hostile_low, hostile_high = DOUBLING_MEASURED[n]
  assert errors[:GDN].max() < gdn_bound, errors
  hostile = errors[GDN:]
  hostile = np.where(np.isnan(hostile), np.inf, hostile)
  assert (hostile > hostile_low).all() and (hostile < hostile_high).all(), errors


@pytest.mark.parametrize("method", ["blocked", "doubling"])
def test_output_is_exactly_unit_lower_triangular(method):
  a = _accuracy_batch(32)[:GDN]
  x = np.asarray(inverse(a, method=method))
  assert (np.triu(x, 1) == 0).all()
  assert (np.diagonal(x, axis1=-2, axis2=-1) == 1).all()


def test_inverse_of_identity_plus_a_in_fla_convention():
  fla_a = -gdn_chunk_matrices(jax.random.key(3), 2, 64)  # solve_tril's A
  want = np.linalg.inv(np.eye(64) + np.tril(np.asarray(fla_a, np.float64), -1))
  np.testing.assert_allclose(np.asarray(inverse(-fla_a)), want, atol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_gradient_matches_reference(n):
  a = _accuracy_batch(n)[GDN - 2:GDN + 1]
  g = random_normal(n, a.shape)
  got = np.asarray(grad(a, g))
  want = np.asarray(grad_reference(a, g))
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
  assert (np.triu(got) == 0).all()  # nothing flows to the ignored diagonal and upper part


def test_doubling_uses_the_same_gradient():
  a = gdn_chunk_matrices(jax.random.key(4), 2, 16)
  g = random_normal(4, a.shape)
  np.testing.assert_allclose(np.asarray(grad(a, g, method="doubling")),
                             np.asarray(grad_reference(a, g)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_inputs_match_their_float32_upcast(dtype):
  a = gdn_chunk_matrices(jax.random.key(5), 3, 32).astype(dtype)
  g = random_normal(5, a.shape)
  x = inverse(a)
  assert x.dtype == jnp.float32
  assert_bitwise_equal(x, inverse(a.astype(jnp.float32)), what=f"{dtype.__name__} input")
  da = grad(a, g)
  assert da.dtype == dtype
  assert_bitwise_equal(da, grad(a.astype(jnp.float32), g).astype(dtype), what="dA")


def test_forward_batch_invariant(batch64):
  a, _ = batch64
  assert_batch_invariant(inverse, a, batch_sizes=(1, 3, 64), pad=3)


def test_backward_batch_invariant(batch64):
  a, g = batch64
  assert_batch_invariant(grad, a, g, batch_sizes=(1, 3, 64), pad=3)


def test_layouts_and_eager_equal_flattened(batch64):
  a, g = batch64
  flat_x, flat_da = inverse(a), grad(a, g)
  layout = (2, 4, 8, 32, 32)  # [B, H, NT, n, n]
  assert_bitwise_equal(inverse(a.reshape(layout)), flat_x.reshape(layout), what="[B,H,NT]")
  assert_bitwise_equal(grad(a.reshape(layout), g.reshape(layout)), flat_da.reshape(layout),
                       what="dA [B,H,NT]")
  assert_bitwise_equal(jdet.tri_inverse(a), flat_x, what="eager vs jit")
  heads_first = jnp.swapaxes(a.reshape(layout), 1, 2)
  assert_bitwise_equal(jax.jit(jax.vmap(jax.vmap(jdet.tri_inverse)))(heads_first),
                       jnp.swapaxes(flat_x.reshape(layout), 1, 2), what="nested vmap")


def test_deterministic(batch64):
  a, g = batch64
  assert_deterministic(inverse, a, runs=5)
  assert_deterministic(grad, a, g, runs=5)


def test_every_matrices_per_program_gives_the_same_bits(batch64):
  a, g = batch64
  x = inverse(a)
  launch = functools.partial(kernels.tri_inverse, method="blocked",
                             precision=jax.lax.Precision.HIGHEST, interpret=not on_gpu())
  backward = functools.partial(kernels.tri_inverse_backward, out_dtype=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST, interpret=not on_gpu())
  for per_program in (1, 4):
    tiles = kernels.TriInverseTiles(per_program, 4, 1)
    assert_bitwise_equal(launch(a, tiles=tiles), x, what=f"{per_program} per program")
    assert_bitwise_equal(backward(x, g, tiles=tiles), grad(a, g),
                         what=f"dA, {per_program} per program")


def test_nan_and_inf_stay_in_their_matrix(batch64):
  a, g = batch64
  a, g = a[:6], g[:6]
  poisoned_a = a.at[1, 20, 3].set(jnp.nan).at[2, 31, 30].set(jnp.inf)
  poisoned_g = g.at[3, 9, 2].set(jnp.nan).at[4, 25, 0].set(-jnp.inf)
  clean_x, clean_da = inverse(a), grad(a, g)
  x, da = inverse(poisoned_a), grad(poisoned_a, poisoned_g)
  healthy = np.array([0, 5])  # matrix 0 shares a CPU program with matrix 1
  assert_bitwise_equal(x[healthy], clean_x[healthy], what="X beside NaN/inf matrices")
  assert_bitwise_equal(da[healthy], clean_da[healthy], what="dA beside NaN/inf matrices")
  assert np.isnan(np.asarray(x[1, 20:, 3])).any()
  assert not np.isfinite(np.asarray(x[2, 31])).all()
  assert not np.isfinite(np.asarray(da[3])).all()


def test_diagonal_upper_triangle_and_their_cotangents_are_ignored(batch64):
  a, g = batch64
  garbage = jnp.triu(jnp.full(a.shape, jnp.nan))
  assert_bitwise_equal(inverse(a + garbage), inverse(jnp.tril(a, -1)), what="X")
  assert_bitwise_equal(grad(a, g + garbage), grad(jnp.tril(a, -1), g), what="dA")


def test_empty_batch():
  x = jdet.tri_inverse(jnp.zeros((0, 3, 16, 16), jnp.bfloat16))
  assert x.shape == (0, 3, 16, 16) and x.dtype == jnp.float32


@pytest.mark.parametrize("a,kwargs,error,match", [
    (np.ones((16,), np.float32), {}, ValueError, "a must have shape"),
    (np.ones((2, 16, 32), np.float32), {}, ValueError, "square"),
    (np.ones((48, 48), np.float32), {}, ValueError, "n = 48"),
    (np.ones((8, 8), np.float32), {}, ValueError, "n = 8"),
    (np.ones((16, 16), np.int32), {}, TypeError, "a must be"),
    (np.ones((16, 16), np.float64), {}, TypeError, "float64"),
    ("x", {}, TypeError, "a must be an array"),
    (np.ones((16, 16), np.float32), {"method": "neumann"}, ValueError, "method"),
    (np.ones((16, 16), np.float32), {"precision": "ultra"}, ValueError, "precision"),
    (np.ones((16, 16), np.float32), {"precision": ("high", "highest")}, ValueError, "precision"),
    (np.ones((16, 16), np.float32), {"method": ["blocked"]}, ValueError, "method"),
    (np.ones((128, 128), np.float32), {"method": "doubling"}, ValueError, "doubling"),
    (np.ones((16, 16), np.float32), {"interpret": 1}, TypeError, "interpret must be"),
])
def test_bad_input_raises(a, kwargs, error, match):
  with pytest.raises(error, match=match):
    jdet.tri_inverse(a, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_gpu_invariance_large_batches_and_tile_configs(n):
  """1000 matrices vs 1, 3 and 64; the dispatched tiles and their neighbours agree."""
  a = gdn_chunk_matrices(jax.random.key(n), 1000, n)
  g = random_normal(n, a.shape)
  x, da = inverse(a), grad(a, g)
  for size in (1, 3, 64):
    assert_bitwise_equal(inverse(a[-size:]), x[-size:], what=f"X, last {size} of 1000")
    assert_bitwise_equal(grad(a[:size], g[:size]), da[:size], what=f"dA, first {size}")
  hi = jax.lax.Precision.HIGHEST
  for kernel in ("blocked", "backward"):
    chosen = kernels.tri_inverse_tiles(n, interpret=False, kernel=kernel)
    candidates = {chosen, kernels.TriInverseTiles(1, 4, 1),
                  dataclasses.replace(chosen, matrices_per_program=2 * chosen.matrices_per_program),
                  dataclasses.replace(chosen, num_warps=2 * chosen.num_warps),
                  dataclasses.replace(chosen, num_stages=1 + chosen.num_stages % 3)}
    for tiles in sorted(candidates, key=str):
      if kernel == "backward":
        got = kernels.tri_inverse_backward(x[:992], g[:992], out_dtype=jnp.float32,
                                           precision=hi, tiles=tiles, interpret=False)
        assert_bitwise_equal(got, da[:992], what=f"dA, {tiles}")
      else:
        got = kernels.tri_inverse(a[:992], method="blocked", precision=hi, tiles=tiles,
                                  interpret=False)
        assert_bitwise_equal(got, x[:992], what=f"X, {tiles}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_gpu_tf32_precision_is_close(n):
  a = _accuracy_batch(n)[:GDN]
  x = jdet.tri_inverse(a, precision=jax.lax.Precision.DEFAULT)
  assert _relative_errors(x, a).max() < 1e-2
