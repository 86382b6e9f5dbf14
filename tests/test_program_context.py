"""Every op's forward and backward keep their bits inside ``lax.scan`` and ``lax.fori_loop``.

On CPU the kernels run in interpret mode as XLA:CPU code, and XLA:CPU contracts
``a*b + c`` into FMAs per program: a kernel inlined into a loop body used to
round differently from the same kernel called on its own (16-22 of 64 entries
of the default Sinkhorn backward differed). ``pallas_kernels._common.launcher``
gives every interpret-mode launch a program of its own. Each case here computes
a per-row function on the whole batch and again over two chunks inside a
``lax.scan`` and a ``lax.fori_loop``; the bits must agree. The matmul weight
gradient dB (a reduction over rows) is compared problem by problem instead.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jdet
from jdet.testing import assert_bitwise_equal, random_normal
from jdet.bench import on_gpu

CHUNKS = 2


def _normal(seed, shape, scale=1.0):
  return random_normal(seed, shape) * scale


def _vjp(fn, argnum=0):
  """(x..., cotangent) -> the cotangent of argument ``argnum``."""
  def grad(*args):
    *inputs, cotangent = args
    return jax.vjp(fn, *inputs)[1](cotangent)[argnum]
  return grad


def _split(x):
  return x.reshape((CHUNKS, x.shape[0] // CHUNKS) + x.shape[1:])


def _scan(fn, *stacked):
  return lax.scan(lambda carry, xs: (carry, fn(*xs)), 0, stacked)[1]


def _fori_loop(fn, *stacked):
  first = jax.eval_shape(fn, *(x[0] for x in stacked))
  out = jnp.zeros((CHUNKS,) + first.shape, first.dtype)
  return lax.fori_loop(0, CHUNKS, lambda i, out: out.at[i].set(fn(*(x[i] for x in stacked))),
                       out)


LOOPS = {"scan": _scan, "fori_loop": _fori_loop}


def _check_rows(fn, *args):
  """fn maps rows to rows: the whole batch vs two chunks under each loop."""
  whole = jax.jit(fn)(*args)
  for name, loop in LOOPS.items():
    chunked = jax.jit(lambda *xs, loop=loop: loop(fn, *map(_split, xs)))(*args)
    assert_bitwise_equal(chunked.reshape(whole.shape), whole, what=f"whole vs {name} chunks")


def _check_problems(fn, *stacked):
  """fn maps one problem to a result: each problem alone vs all of them under each loop."""
  alone = jnp.stack([jax.jit(fn)(*(x[i] for x in stacked)) for i in range(CHUNKS)])
  for name, loop in LOOPS.items():
    assert_bitwise_equal(jax.jit(functools.partial(loop, fn))(*stacked), alone,
                         what=f"alone vs {name}")


A, B, DC = _normal(0, (8, 80)), _normal(1, (80, 40)), _normal(2, (8, 40))


def test_matmul_forward():
  _check_rows(lambda a: jdet.matmul(a, B), A)


def test_matmul_da():
  _check_rows(_vjp(lambda a: jdet.matmul(a, B)), A, DC)


def test_matmul_db():
  _check_problems(_vjp(jdet.matmul, argnum=1), _split(A), jnp.stack([B, B * 0.5]), _split(DC))


LOGITS, G4 = _normal(3, (4, 4, 4), 2.0), _normal(4, (4, 4, 4))


@pytest.mark.parametrize("init", ["softmax", "exp"])
def test_sinkhorn_forward(init):
  _check_rows(functools.partial(jdet.sinkhorn, init=init), LOGITS)


@pytest.mark.parametrize("grad", ["unrolled", "implicit"])
@pytest.mark.parametrize("init", ["softmax", "exp"])
def test_sinkhorn_backward(init, grad):
  _check_rows(_vjp(functools.partial(jdet.sinkhorn, init=init, grad=grad)), LOGITS, G4)


def test_sinkhorn_issue_repro_default_backward():
  x = jax.random.normal(jax.random.key(0), (4, 4, 4)) * 2
  w = jax.random.normal(jax.random.key(1), (4, 4, 4))
  vjp = lambda z, c: jax.vjp(jdet.sinkhorn, z)[1](c)[0]
  whole = vjp(x, w)
  chunked = lax.scan(lambda k, zc: (k, vjp(*zc)), 0,
                     (x.reshape(2, 2, 4, 4), w.reshape(2, 2, 4, 4)))[1].reshape(4, 4, 4)
  assert_bitwise_equal(chunked, whole, what="issue repro")


TRI = jdet.gdn_chunk_matrices(jax.random.key(5), 4, 16) * 4
G16 = _normal(6, (4, 16, 16))


@pytest.mark.parametrize("method", ["blocked", "doubling"])
def test_tri_inverse_forward(method):
  _check_rows(functools.partial(jdet.tri_inverse, method=method), TRI)


def test_tri_inverse_backward():
  _check_rows(_vjp(jdet.tri_inverse), TRI, G16)


@pytest.mark.skipif(on_gpu(), reason="interpret mode is the CPU path")
def test_interpret_launch_is_a_host_callback_of_its_own():
  jaxpr = str(jax.make_jaxpr(lambda x: jdet.sinkhorn(x, interpret=True))(LOGITS))
  assert "pure_callback" in jaxpr and "pallas_call" not in jaxpr
