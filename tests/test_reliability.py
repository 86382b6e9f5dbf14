"""Edges every op shares: higher-order derivatives raise one clear error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet

A, B = jnp.ones((4, 64)) * 0.5, jnp.ones((64, 8)) * 0.25
LOGITS = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4, 4)), jnp.float32)
TRI = jdet.gdn_chunk_matrices(jax.random.key(0), 2, 16)


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
]
IDS = ["matmul-dA", "matmul-dB", "sinkhorn", "sinkhorn-exp", "sinkhorn-implicit",
       "tri_inverse"]


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
