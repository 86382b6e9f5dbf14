"""Edges every op shares: higher-order derivatives raise one clear error, NaN input
keeps tri_inverse's upper triangle zero, input builders and helpers on edge cases.
(Argument checks are in each op's own test file.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import bits, relative_error

A, B = jnp.ones((4, 64)) * 0.5, jnp.ones((64, 8)) * 0.25
LOGITS = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 4)), jnp.float32)
TRI = jdet.gdn_chunk_matrices(jax.random.key(0), 2, 16)
ROWS = jnp.asarray(np.random.default_rng(1).standard_normal((3, 40)), jnp.float32)
TOKENS = jnp.asarray([1, 5, 7], jnp.int32)
QKV = jnp.asarray(np.random.default_rng(2).standard_normal((1, 8, 2, 16)), jnp.float32)


def _square_sum(fn):
  return lambda *args: jnp.sum(fn(*args) ** 2)


# (op name, function of its differentiable args, args, argnums to differentiate)
OPS = [
    ("matmul", jdet.matmul, (A, B), 0),
    ("matmul", jdet.matmul, (A, B), 1),
    ("sinkhorn", jdet.sinkhorn, (LOGITS,), 0),
    ("sinkhorn", functools.partial(jdet.sinkhorn, init="exp"), (LOGITS,), 0),
    ("sinkhorn", functools.partial(jdet.sinkhorn, grad="implicit"), (LOGITS,), 0),
    ("tri_inverse", jdet.tri_inverse, (TRI,), 0),
    ("rms_norm", jdet.rms_norm, (ROWS, jnp.ones((40,))), 0),
    ("softmax", jdet.log_softmax, (ROWS,), 0),
    ("token_logprobs", lambda h, w: jdet.token_logprobs(h, w, TOKENS), (ROWS, jnp.tile(ROWS.T, 3)),
     0),
    ("dot_product_attention",
     lambda q: jdet.dot_product_attention(q, QKV, QKV, is_causal=True), (QKV,), 0),
]
IDS = ["matmul-dA", "matmul-dB", "sinkhorn", "sinkhorn-exp", "sinkhorn-implicit",
       "tri_inverse", "rms_norm", "log_softmax", "token_logprobs", "attention"]


def _grad_of_grad(fn, args, argnum):
  inner = jax.grad(_square_sum(fn), argnums=argnum)
  return jax.grad(lambda *a: jnp.sum(inner(*a) ** 2), argnums=argnum)(*args)


SECOND_ORDER = {
    "grad of grad": _grad_of_grad,
    "hessian": lambda fn, args, argnum: jax.hessian(_square_sum(fn), argnums=argnum)(*args),
    "jvp": lambda fn, args, argnum: jax.jvp(lambda x: fn(*args[:argnum], x, *args[argnum + 1:]),
                                            (args[argnum],), (args[argnum],)),
    "jit(grad of grad)": lambda fn, args, argnum: jax.jit(
        lambda *a: _grad_of_grad(fn, a, argnum))(*args),
}


@pytest.mark.parametrize("how", SECOND_ORDER)
@pytest.mark.parametrize("name,fn,args,argnum", OPS, ids=IDS)
def test_beyond_first_order_raises_one_clear_error(name, fn, args, argnum, how):
  with pytest.raises(NotImplementedError,
                     match=rf"jdet\.{name} is differentiable once, in reverse mode"):
    SECOND_ORDER[how](fn, args, argnum)


@pytest.mark.parametrize("name,fn,args,argnum", OPS, ids=IDS)
def test_first_order_still_works(name, fn, args, argnum):
  grad = jax.grad(_square_sum(fn), argnums=argnum)(*args)
  assert grad.shape == args[argnum].shape and np.isfinite(np.asarray(grad)).all()


@pytest.mark.parametrize("method", ["blocked", "doubling"])
def test_tri_inverse_upper_triangle_is_exact_zeros_with_nan_and_inf(method):
  a = np.array(jdet.gdn_chunk_matrices(jax.random.key(1), 4, 32))
  a[0, 5, 2] = np.nan
  a[1, 20, 3] = np.inf
  a[2, 31, 30] = -np.inf
  x = np.asarray(jdet.tri_inverse(a, method=method))
  upper = np.triu(np.ones((32, 32), bool), 1)
  assert (bits(x)[:, upper] == 0).all()  # +0.0, not -0.0 or NaN
  assert np.isnan(x[0]).any() and not np.isnan(x[3]).any()


def test_gdn_chunk_matrices_are_float32_under_x64():
  with jax.enable_x64(True):
    a = jdet.gdn_chunk_matrices(jax.random.key(0), 2, 16)
    assert a.dtype == jnp.float32
    assert jdet.tri_inverse(a).dtype == jnp.float32


def test_relative_error_of_empty_arrays_is_zero():
  assert relative_error(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
  assert relative_error([], []) == 0.0
