"""``jdet.softmax``, ``jdet.log_softmax``, ``jdet.logsumexp``: each row bitwise on its own.

Numerics: float32 math whatever the input dtype; a row is reduced in fixed-width
sub-chunks, in increasing order, with an online max and sum of exponentials
(``pallas_kernels.softmax``). The sub-chunk width, rows per program and warps
depend on the row length only, never on the number of rows.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from jdet._backend import as_array, check_float, differentiable_once, use_interpret
from pallas_kernels import softmax as kernels

@dataclasses.dataclass(frozen=True)
class _RowConfig:
  kind: str
  tiles: kernels.SoftmaxTiles
  interpret: bool


def softmax(x, axis=-1, *, interpret=None):
  """Batch-invariant :func:`jax.nn.softmax` along one axis.

  Args:
    x: any shape of rank >= 1, bfloat16, float16 or float32.
    axis: the int axis to normalise (length >= 1); other axes are rows.
    interpret: ``None`` picks by platform (Triton on GPU, interpret on CPU).

  Returns:
    ``x``'s shape and dtype: exp(x - max) / sum(exp(x - max)), computed in float32.
    As :func:`jax.nn.softmax`: a row of all -inf, or holding +inf or NaN, is all
    NaN; -inf entries give 0.

  Invariance: each row's result (and, under ``jax.grad``, its cotangent) depends
  only on that row: not on the number of rows, their order, padding, chunking,
  ``jit``/``vmap``, nor on the run. A NaN stays in its own row.
  """
  return _apply(kernels.SOFTMAX, x, axis, keepdims=True, interpret=interpret)


def log_softmax(x, axis=-1, *, interpret=None):
  """Batch-invariant :func:`jax.nn.log_softmax` along one axis.

  Args and Returns as :func:`softmax`: (x - max) - log(sum(exp(x - max))) in
  float32, rounded to ``x``'s dtype. -inf entries give -inf; a row of all -inf,
  or holding +inf or NaN, is all NaN (as :func:`jax.nn.log_softmax`).

  For float32 rows this is, bit for bit, what :func:`jdet.token_logprobs`
  computes for the picked entries of ``jdet.matmul(h, w, preferred_element_type=
  jnp.float32) / temperature`` (the same sub-chunks and update; see there).

  Invariance: each row's result (and, under ``jax.grad``, its cotangent) depends
  only on that row: not on the number of rows, their order, padding, chunking,
  ``jit``/``vmap``, nor on the run. A NaN stays in its own row.
  """
  return _apply(kernels.LOG_SOFTMAX, x, axis, keepdims=True, interpret=interpret)


def logsumexp(x, axis=-1, *, keepdims=False, interpret=None):
  """Batch-invariant :func:`jax.nn.logsumexp` along one axis.

  Args:
    x, axis, interpret: as :func:`softmax`.
    keepdims: keep the reduced axis with length 1.

  Returns:
    ``x``'s shape without ``axis`` (or with length 1 there), in ``x``'s dtype:
    max + log(sum(exp(x - max))) in float32. As :func:`jax.nn.logsumexp`: a
    row of all -inf gives -inf, a row holding +inf gives +inf, NaN gives NaN
    (on the GPU a row holding both +inf and NaN gives +inf: Triton's max skips
    NaN, where :func:`jax.nn.logsumexp` gives NaN).

  Invariance: each row's result (and, under ``jax.grad``, its cotangent) depends
  only on that row: not on the number of rows, their order, padding, chunking,
  ``jit``/``vmap``, nor on the run. A NaN stays in its own row.
  """
  return _apply(kernels.LOGSUMEXP, x, axis, keepdims=keepdims, interpret=interpret)


def _check_axis(axis, ndim: int) -> int:
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
    raise TypeError(f"axis must be an int, got {axis!r}")
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} is out of range for x of rank {ndim}")
  return int(axis) % ndim


def _apply(kind: str, x, axis, *, keepdims: bool, interpret):
  x = as_array("x", x)
  if x.ndim < 1:
    raise ValueError(f"x must have rank >= 1, got a scalar of shape {x.shape}")
  check_float("x", x)
  axis = _check_axis(axis, x.ndim)
  length = x.shape[axis]
  if length < 1:
    raise ValueError(f"x must have length >= 1 along axis {axis}, got shape {x.shape}")
  interpret = use_interpret(interpret, x)
  config = _RowConfig(kind, kernels.softmax_tiles(length, interpret=interpret), interpret)
  moved = jnp.moveaxis(x, axis, -1)
  lead = moved.shape[:-1]
  if kind == kernels.LOGSUMEXP:
    out_shape = x.shape[:axis] + (1,) * keepdims + x.shape[axis + 1:]
    if x.size == 0:
      return jnp.zeros(out_shape, x.dtype)
    return _row_op(moved.reshape(-1, length), config).reshape(out_shape)
  if x.size == 0:
    return jnp.zeros(x.shape, x.dtype)
  y = _row_op(moved.reshape(-1, length), config)
  return jnp.moveaxis(y.reshape(lead + (length,)), -1, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _row_op(x, config: _RowConfig):
  """x: [rows, L]; returns [rows, L] (softmax, log_softmax) or [rows] (logsumexp)."""
  return _row_op_forward(x, config)[0]


def _row_op_forward(x, config):
  y, m, s = kernels.row_forward(x, kind=config.kind, tiles=config.tiles,
                                interpret=config.interpret)
  return y, (x, m, s)


def _row_op_backward(config, saved, cotangent):
  x, m, s = saved
  return (kernels.row_backward(x, m, s, cotangent, kind=config.kind, tiles=config.tiles,
                               interpret=config.interpret),)


_row_op = differentiable_once("softmax", _row_op, _row_op_forward, _row_op_backward)


def _in_float32(fn, x, axis, **kwargs):
  x = jnp.asarray(x)
  return fn(x.astype(jnp.float32), axis=axis, **kwargs).astype(x.dtype)


def softmax_reference(x, axis=-1):
  """:func:`jax.nn.softmax` computed in float32, in ``x``'s dtype (not batch-invariant)."""
  return _in_float32(jax.nn.softmax, x, axis)


def log_softmax_reference(x, axis=-1):
  """:func:`jax.nn.log_softmax` computed in float32, in ``x``'s dtype."""
  return _in_float32(jax.nn.log_softmax, x, axis)


def logsumexp_reference(x, axis=-1, *, keepdims=False):
  """:func:`jax.nn.logsumexp` computed in float32, in ``x``'s dtype."""
  return _in_float32(jax.nn.logsumexp, x, axis, keepdims=keepdims)
