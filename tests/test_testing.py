"""jdet.testing catches real batch variance and passes invariant models."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import (assert_batch_invariant, assert_bitwise_equal, assert_deterministic,
                          relative_error)

# K = 512, N = 256: XLA:CPU's dot gives rows different bits in a batch of 64 than in
# smaller batches (at K = N = 32 it did on an earlier machine, not on this AMD EPYC).
K, N = 512, 256


@pytest.fixture(scope="module")
def model_inputs():
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.standard_normal((64, K)), jnp.float32),
          jnp.asarray(rng.standard_normal((K, N)), jnp.float32))


def _model(matmul):
  def layer(x, w):
    h = matmul(x, w)
    return {"hidden": h, "out": jnp.tanh(h)}
  return layer


def test_fails_on_jnp_dot_model_and_reports_where(model_inputs):
  x, w = model_inputs
  with pytest.raises(AssertionError) as info:
    assert_batch_invariant(_model(jnp.dot), x, w, in_axes=(0, None))
  message = str(info.value)
  assert "leaf ['hidden']" in message
  assert "batch of 64 vs" in message and "first at index" in message
  assert "max abs difference" in message


def test_compiling_ahead_on_threads_checks_the_same_batches(model_inputs):
  """compile_workers > 1 (what `python -m jdet check` uses on a GPU) compiles the
  batch shapes on threads first and still catches the variance."""
  x, w = model_inputs
  with pytest.raises(AssertionError, match="leaf \\['hidden'\\]"):
    assert_batch_invariant(_model(jnp.dot), x, w, in_axes=(0, None), compile_workers=2)
  assert_batch_invariant(lambda x, w: jnp.tanh(x * w[:, 0]), x, w, in_axes=(0, None),
                         batch_sizes=(1, 3), compile_workers=2)


def test_passes_on_the_same_model_built_on_jdet(model_inputs):
  x, w = model_inputs
  assert_batch_invariant(_model(jdet.matmul), x, w, in_axes=(0, None), vmap_splits=(2, 4))


def test_per_example_gradients(model_inputs):
  x, w = model_inputs

  def per_row_grad(matmul):
    return jax.grad(lambda x, w: jnp.sum(_model(matmul)(x, w)["out"] ** 2))

  assert_batch_invariant(per_row_grad(jdet.matmul), x, w, in_axes=(0, None))
  with pytest.raises(AssertionError):
    assert_batch_invariant(per_row_grad(jnp.dot), x, w, in_axes=(0, None))


def test_batch_axis_other_than_zero(model_inputs):
  x, w = model_inputs
  xt = x.T  # batch along axis 1
  assert_batch_invariant(lambda xt, w: jdet.matmul(xt.T, w).T, xt, w, in_axes=(1, None),
                         out_axis=1)


def test_assert_deterministic_detects_run_to_run_change(model_inputs):
  x, w = model_inputs
  assert_deterministic(jdet.matmul, x, w, runs=3)
  counter = itertools.count()

  def drifting(x):
    noise = jax.pure_callback(lambda: np.float32(next(counter) * 1e-7),
                              jax.ShapeDtypeStruct((), jnp.float32))
    return x + noise

  with pytest.raises(AssertionError, match="run 1 vs run 0"):
    assert_deterministic(drifting, x, runs=3)


def test_bitwise_equal_distinguishes_signed_zeros():
  with pytest.raises(AssertionError, match="differs in 1 of 2"):
    assert_bitwise_equal(jnp.array([0.0, 1.0]), jnp.array([-0.0, 1.0]))
  assert_bitwise_equal(jnp.array([jnp.nan]), jnp.array([jnp.nan]))


def test_relative_error_is_max_abs_error_over_max_abs_reference():
  assert relative_error([1.0, -4.0], [1.5, -2.0]) == 1.0  # max |diff| 2 over max |want| 2
  assert relative_error(np.float32([0.1]), np.float64([0.1])) == abs(
      float(np.float32(0.1)) - 0.1) / 0.1
  assert relative_error([0.0, 0.0], [0.0, 0.0]) == 0.0
