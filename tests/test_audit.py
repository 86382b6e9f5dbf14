"""jdet.testing.audit lists the batch-dependent operations of a function, with their lines."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jdet
from jdet.testing import Finding, audit

X = jax.ShapeDtypeStruct((8, 32), jnp.float32)
W = jax.ShapeDtypeStruct((32, 16), jnp.float32)


def _line(marker: str) -> int:
  """The line of this file that ends with ``# <marker>``."""
  with open(__file__) as source:
    (line,) = [i for i, text in enumerate(source, 1) if text.rstrip().endswith(f"# {marker}")]
  return line


def _found(findings):
  return sorted((f.primitive, f.line) for f in findings)


def jnp_model(x, w):
  h = jnp.dot(x, w)  # dot
  s = jax.nn.softmax(h)  # softmax
  return jnp.cumsum(s, axis=-1) + jnp.sum(x)  # cumsum and sum


def test_flags_xla_matmul_reductions_softmax_and_cumsum_with_their_lines():
  findings = audit(jnp_model, X, W)
  assert _found(findings) == sorted([
      ("dot_general", _line("dot")), ("reduce_sum", _line("softmax")),
      ("cumsum", _line("cumsum and sum")), ("reduce_sum", _line("cumsum and sum"))])
  assert all(f.file == __file__ and f.function == "jnp_model" for f in findings)
  dot = next(f for f in findings if f.primitive == "dot_general")
  assert str(dot).startswith(f"{__file__}:{_line('dot')} (jnp_model): dot_general: ")
  assert "jdet.matmul" in dot.hint


def jdet_model(x, w, logits):
  h = jnp.tanh(jdet.matmul(x, w))
  mixing = jdet.sinkhorn(logits, iters=3)
  return h * jnp.exp(h), jnp.max(h, axis=-1), jnp.argmax(h, axis=-1), mixing


def test_jdet_ops_and_elementwise_math_give_no_findings():
  logits = jax.ShapeDtypeStruct((8, 4, 4), jnp.float32)
  assert audit(jdet_model, X, W, logits) == []
  assert audit(jax.jit(jdet_model), X, W, logits) == []


def test_the_backward_of_jdet_ops_is_jdet_s_own():
  def loss(x, w, logits):
    h, _, _, mixing = jdet_model(x, w, logits)
    return jnp.vdot(h, h) + jnp.vdot(mixing, mixing)  # loss

  logits = jax.ShapeDtypeStruct((8, 4, 4), jnp.float32)
  assert audit(jax.grad(loss, argnums=(0, 1, 2)), X, W, logits) == []
  # With the loss value returned, its two contractions (vdot) are the caller's.
  findings = audit(jax.value_and_grad(loss, argnums=(0, 1, 2)), X, W, logits)
  assert _found(findings) == [("dot_general", _line("loss"))] * 2


def test_reference_functions_are_not_jdet_ops():
  (finding,) = audit(jdet.matmul_reference, X, W)
  assert finding.primitive == "dot_general" and finding.function == "matmul_reference"


def test_looks_inside_jit_scan_remat_while_and_cond():
  @jax.jit
  def inner(x, w):
    return jnp.dot(x, w)  # inner dot

  def body(carry, x):
    return carry + jax.checkpoint(lambda y: jnp.sum(y))(x), None  # remat sum

  def fn(x, w):
    total, _ = lax.scan(body, 0.0, x)
    looped = lax.while_loop(lambda v: v[0, 0] < 9, lambda v: v + jnp.prod(v), x)  # while prod
    chosen = lax.cond(total > 0, lambda v: v @ w, lambda v: v[:, :16], x)  # cond dot
    return inner(x, w) + chosen, looped

  findings = audit(fn, X, W)
  assert _found(findings) == sorted([
      ("dot_general", _line("inner dot")), ("reduce_sum", _line("remat sum")),
      ("reduce_prod", _line("while prod")), ("dot_general", _line("cond dot"))])
  where = {f.line: f.where for f in findings}
  assert where[_line("inner dot")] == ("jit(inner)",)
  assert where[_line("remat sum")][0] == "scan" and len(where[_line("remat sum")]) == 2
  assert where[_line("while prod")][0] == "while"


def test_flags_psum_inside_shard_map_and_scatter_add():
  mesh = jax.make_mesh((1,), ("data",))

  def fn(x):
    summed = jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh,  # psum
                           in_specs=P(), out_specs=P(), check_vma=False)(x)
    return summed.at[jnp.array([0, 0])].add(1.0)  # scatter

  assert _found(audit(fn, X)) == sorted([("psum", _line("psum")),
                                          ("scatter-add", _line("scatter"))])


def test_exact_operations_are_not_flagged():
  def fn(x):
    ones = jnp.sum(x[:, :1], axis=1)  # a sum of one element is exact
    count = jnp.sum(x > 0, axis=1, keepdims=True) + jnp.cumsum(x.astype(jnp.int32), axis=1)  # integers
    return (jnp.max(x, axis=0), jnp.argmin(x, axis=1), lax.cummax(x, axis=1), ones, x[::2] * 2,
            count)

  assert audit(fn, X) == []


def test_static_arguments_and_keywords_pass_through():
  def fn(x, w, *, transpose: bool, scale):
    return jnp.dot(x.T if transpose else x, w) * scale

  findings = audit(fn, np.ones((32, 8), np.float32), W, transpose=True, scale=2.0)
  assert [f.primitive for f in findings] == ["dot_general"]
  assert isinstance(findings[0], Finding)
