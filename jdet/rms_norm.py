"""``jdet.rms_norm``: RMSNorm, optionally fused with the residual add; each row on its own."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jdet._backend import (as_array, check_eps, check_float, check_ndim, differentiable_once,
                           use_interpret)
from pallas_kernels import rms_norm as kernels


@dataclasses.dataclass(frozen=True)
class _RmsNormConfig:
  eps: float
  interpret: bool


def rms_norm(x, weight, *, eps=1e-6, residual=None, interpret=None):
  """Batch-invariant RMSNorm over the last axis, optionally after a residual add.

  Args:
    x: ``[..., H]``, bfloat16, float16 or float32, H >= 1.
    weight: ``[H]``, bfloat16, float16 or float32 (any of them, whatever x is).
    eps: added to the mean of squares; a finite float > 0.
    residual: ``None``, or an array of x's shape and dtype. Then
      ``h = x + residual`` is added in float32 and rounded to x's dtype (what
      ``x + residual`` gives in jnp), and ``h`` is what is normalised.
    interpret: ``None`` picks by platform (Triton on GPU, interpret on CPU).

  Returns:
    Without ``residual``: ``y = x * rsqrt(mean(x², -1) + eps) * weight``,
    computed in float32 and returned in x's dtype. With ``residual``: the
    pair ``(rms_norm(h) * weight, h)``, the fused add + norm of a pre-norm
    block, bitwise equal to ``h = x + residual`` followed by
    ``rms_norm(h, weight)``.

  Invariance: each row's outputs, and its rows of ``dx``/``dresidual`` under
  ``jax.grad``, depend only on that row (and ``weight``): not on the number
  of rows, their order, padding, ``jit``/``vmap``, nor on the run. The mean
  of squares runs over H in fixed-size chunks in increasing order, with a tile
  that depends on H only. ``dweight`` is reduced over rows in a fixed order of
  fixed row blocks: appending rows whose cotangent is zero leaves it bitwise
  unchanged. A NaN or inf stays in its own row (and in ``dweight``).
  ``dweight`` is returned in weight's dtype, ``dx`` and ``dresidual`` in
  x's dtype; with ``residual`` they are equal (the sum's cotangent is added
  in float32 and rounded once).
  """
  x = as_array("x", x)
  check_ndim("x", x, 1, "[..., H]")
  check_float("x", x)
  h = x.shape[-1]
  if h < 1:
    raise ValueError(f"x must have H >= 1 features in its last dim, got shape {x.shape}")
  weight = as_array("weight", weight)
  check_float("weight", weight)
  if weight.shape != (h,):
    raise ValueError(f"weight must have shape [H] = ({h},) to match x {x.shape}, "
                     f"got {weight.shape}")
  if residual is not None:
    residual = as_array("residual", residual)
    check_float("residual", residual)
    if residual.shape != x.shape:
      raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
    if residual.dtype != x.dtype:
      raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
  config = _RmsNormConfig(check_eps(eps), use_interpret(interpret, x, weight))
  if x.size == 0:
    empty = jnp.zeros(x.shape, x.dtype)
    return empty if residual is None else (empty, empty)
  rows = lambda a: None if a is None else a.reshape(-1, h)
  y, total = _rms_norm(rows(x), rows(residual), weight, config)
  if residual is None:
    return y.reshape(x.shape)
  return y.reshape(x.shape), total.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm(x, residual, weight, config: _RmsNormConfig):
  """x, residual: [M, H] (residual may be None); weight: [H]. Returns (y, sum or None)."""
  return _rms_norm_forward(x, residual, weight, config)[0]


def _rms_norm_forward(x, residual, weight, config):
  y, total, rstd = kernels.rms_norm_forward(
      x, weight, residual, eps=config.eps,
      tiles=kernels.rms_norm_tiles(x.shape[1], interpret=config.interpret),
      interpret=config.interpret)
  normalized = x if residual is None else total
  return (y, total), (normalized, weight, rstd)


def _rms_norm_backward(config, saved, cotangents):
  normalized, weight, rstd = saved
  g, g_total = cotangents  # g_total: None exactly when there is no residual
  h = normalized.shape[1]
  has_residual = g_total is not None
  dx, dweight = kernels.rms_norm_backward(
      normalized, weight, rstd, g, g_total,
      tiles=kernels.rms_norm_tiles(h, interpret=config.interpret),
      sum_tiles=kernels.dweight_tiles(h, interpret=config.interpret), interpret=config.interpret)
  return dx, dx if has_residual else None, dweight


_rms_norm = differentiable_once("rms_norm", _rms_norm, _rms_norm_forward, _rms_norm_backward)


def rms_norm_reference(x, weight, *, eps=1e-6, residual=None):
  """Plain ``jax.numpy`` RMSNorm with :func:`rms_norm`'s semantics (not batch-invariant).

  x: ``[..., H]``; weight: ``[H]``; residual: ``None`` or x's shape and dtype.
  Returns ``y`` in x's dtype, or ``(y, x + residual)`` with a residual.
  Differentiable with ``jax.grad``.
  """
  x = jnp.asarray(x)
  total = None
  if residual is not None:
    total = (x.astype(jnp.float32) + jnp.asarray(residual).astype(jnp.float32)).astype(x.dtype)
    x = total
  h = x.astype(jnp.float32)
  rstd = lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  y = ((h * rstd) * jnp.asarray(weight).astype(jnp.float32)).astype(x.dtype)
  return y if total is None else (y, total)
