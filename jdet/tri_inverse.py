"""``jdet.tri_inverse``: inv(I - A) for strictly lower-triangular A, one matrix at a time."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet._backend import (as_array, check_float, check_ndim, check_precision,
                           differentiable_once, use_interpret)
from pallas_kernels import tri_inverse as kernels

METHODS = ("blocked", "doubling")


@dataclasses.dataclass(frozen=True)
class _TriInverseConfig:
  method: str
  precision: lax.Precision
  input_dtype: np.dtype
  interpret: bool


def tri_inverse(a, *, method="blocked", precision=lax.Precision.HIGHEST, interpret=None):
  """Batch-invariant ``inv(I - tril(a, -1))``, forward and backward.

  This is the chunk inverse of chunked (gated) delta-rule attention. Users of
  flash-linear-attention's ``solve_tril``, which returns ``inv(I + A)``, call
  ``tri_inverse(-A)``.

  Args:
    a: ``[..., n, n]``, float32, bfloat16 or float16, n in {16, 32, 64, 128}.
      Only the strictly lower triangle is read: the diagonal and the upper
      triangle are ignored, whatever they hold.
    method: ``"blocked"`` (default) is block forward substitution: each
      16x16 diagonal block is inverted by forward substitution, then each
      block row follows from the rows above it
      (``X[i, j] = X[i, i] · Σ_k A[i, k] · X[k, j]``). Its relative error
      (max |X - X_exact| / max |X_exact|, X_exact by forward substitution in
      long double), measured in f32 on CPU for n = 16, 32, 64, 128: at most
      6e-8 on :func:`gdn_chunk_matrices` inputs and on ``a = -β·L`` (L the
      strictly lower ones, β = 0.99 or 1.01); on ``a = +β·L``, whose inverse
      grows like binomial coefficients (to 1e38 at n = 128), 2e-7, 4e-7,
      8e-7, 1.4e-6; on strictly lower N(0, 1) entries (inverse up to 2e15 at
      n = 128; 16 matrices of two seeds) at most 2e-7, 5e-6, 3e-6, 3e-5,
      about twice float32 ``solve_triangular`` (2e-7, 2e-6, 2e-6, 1.6e-5; a
      float64 ``np.linalg.inv`` is off by 0.8 at n = 128). Entries far
      smaller than the largest carry its absolute error, so their own
      relative errors are larger.
      ``"doubling"`` (n = 16, 32 or 64) runs ``X = I, Y = A``; ceil(log2 n)
      times ``X = X + X·Y, Y = Y·Y``, one n x n product after another:
      accurate only while the powers of A stay small. Its measured relative
      errors (f32, HIGHEST): on :func:`gdn_chunk_matrices` inputs about 2e-7
      at n = 16, 2e-6 at n = 32 and 1e-3 at n = 64 (above 1 at n = 128, which
      it therefore refuses); on ``a = -0.99 *`` (strictly lower ones) about
      2e-4 at n = 16 and above 1 from n = 32 on. Use it only for small n or
      strongly decaying gates.
    precision: of the block products. ``HIGHEST`` (default) is IEEE float32;
      ``DEFAULT``/``HIGH`` let the GPU use TF32. CPU is always IEEE float32.
      Also taken: the names ("HIGHEST") and the strings ``jax.lax.Precision``
      accepts ("highest", "float32", ...), or a pair of equal ones; ``None``
      is ``DEFAULT``. Anything else raises ValueError.
    interpret: ``None`` picks by platform (Triton on GPU, interpret on CPU).

  Returns:
    X: ``[..., n, n]`` float32, unit lower triangular (exact zeros above the
    diagonal), ``X = inv(I - tril(a, -1))``.

  Invariance: each matrix's X depends only on that matrix: not on how many
  matrices there are, on their leading-dim layout, on padding, ``jit``/``vmap``
  or the run; NaN/inf in one matrix leaves the others bitwise unchanged. Under
  ``jax.grad``, ``dA = tril(Xᵀ · G · Xᵀ, -1)`` (in ``a``'s dtype, zero on and
  above the diagonal) has the same property.

  Differentiable once, in reverse mode (``jax.grad``, ``jax.vjp``): a second
  derivative (``jax.grad`` of ``jax.grad``, ``jax.hessian``) or forward mode
  (``jax.jvp``, ``jax.jacfwd``) raises NotImplementedError.
  """
  a = as_array("a", a)
  check_ndim("a", a, 2, "[..., n, n]")
  dtype = check_float("a", a)
  n = a.shape[-1]
  if a.shape[-2] != n:
    raise ValueError(f"a must hold square matrices [..., n, n], got shape {a.shape}")
  if n not in kernels.SIZES:
    raise ValueError(
        f"a's matrices must be n x n with n in {kernels.SIZES}, got n = {n} "
        f"(pad a chunk to the next supported size: zero rows and columns leave "
        f"the inverse's leading block unchanged)")
  if not isinstance(method, str) or method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if method == "doubling" and n not in kernels.DOUBLING_SIZES:
    raise ValueError(
        f"method='doubling' takes n in {kernels.DOUBLING_SIZES}, got n = {n}: at n = 128 "
        f"its error exceeds 1 even on GDN inputs; use method='blocked'")
  precision = check_precision("precision", precision, lax.Precision.DEFAULT)
  config = _TriInverseConfig(method, precision, dtype, use_interpret(interpret, a))
  if a.size == 0:
    return jnp.zeros(a.shape, jnp.float32)
  x = _tri_inverse(a.reshape(-1, n, n), config)
  return x.reshape(a.shape)


def _tiles(n: int, config: _TriInverseConfig, kernel: str) -> kernels.TriInverseTiles:
  return kernels.tri_inverse_tiles(n, interpret=config.interpret, kernel=kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tri_inverse(a, config: _TriInverseConfig):
  """a: [B, n, n]; returns X: [B, n, n] float32."""
  return kernels.tri_inverse(a, method=config.method, precision=config.precision,
                             tiles=_tiles(a.shape[-1], config, config.method),
                             interpret=config.interpret)


def _tri_inverse_forward(a, config):
  x = _tri_inverse(a, config)
  return x, x


def _tri_inverse_backward(config, x, g):
  da = kernels.tri_inverse_backward(
      x, g.astype(jnp.float32), out_dtype=config.input_dtype, precision=config.precision,
      tiles=_tiles(x.shape[-1], config, "backward"), interpret=config.interpret)
  return (da,)


_tri_inverse = differentiable_once("tri_inverse", _tri_inverse, _tri_inverse_forward,
                                   _tri_inverse_backward)


def tri_inverse_reference(a):
  """``inv(I - tril(a, -1))`` by ``jax.scipy.linalg.solve_triangular`` in float32.

  a: ``[..., n, n]`` any float dtype; returns ``[..., n, n]`` float32. Not
  batch-invariant; differentiable with ``jax.grad``.
  """
  lower = jnp.tril(jnp.asarray(a, jnp.float32), -1)
  identity = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=jnp.float32), lower.shape)
  return jax.scipy.linalg.solve_triangular(identity - lower, identity, lower=True,
                                           unit_diagonal=True)


def gdn_chunk_matrices(key, batch: int, n: int, *, head_dim: int = 64,
                       key_overlap: float = 1.0, max_log_decay: float = 0.1):
  """Realistic inputs: the ``a`` whose ``tri_inverse`` is a GDN chunk's ``inv(I + A)``.

  Keys are L2-normalised and correlated like real ones (a direction shared by
  the chunk, weight ``key_overlap``, plus noise: cosines near
  ``key_overlap² / (1 + key_overlap²)``), ``beta`` is uniform in (0, 1), the
  per-step log-decay uniform in (-max_log_decay, 0] and ``g`` its running sum
  within the chunk, so ``A[i, j] = beta_i (k_i · k_j) exp(g_i - g_j)`` for i > j.
  Returns ``a = -tril(A, -1)``: ``[batch, n, n]`` float32 (also under
  ``jax_enable_x64``). An input builder, not an op: it is not batch-invariant
  and need not be.
  """
  key_shared, key_noise, key_beta, key_g = jax.random.split(key, 4)
  shared = jax.random.normal(key_shared, (batch, 1, head_dim), jnp.float32)
  shared = shared / jnp.linalg.norm(shared, axis=-1, keepdims=True)
  noise = jax.random.normal(key_noise, (batch, n, head_dim), jnp.float32) / math.sqrt(head_dim)
  keys = key_overlap * shared + noise
  keys = keys / jnp.linalg.norm(keys, axis=-1, keepdims=True)
  beta = jax.random.uniform(key_beta, (batch, n, 1), jnp.float32, 1e-3, 1.0)
  g = jnp.cumsum(-max_log_decay * jax.random.uniform(key_g, (batch, n), jnp.float32), axis=-1)
  similarity = jnp.einsum("bik,bjk->bij", keys, keys, precision=lax.Precision.HIGHEST)
  decay = jnp.exp(jnp.minimum(g[:, :, None] - g[:, None, :], 0.0))
  return -jnp.tril(beta * similarity * decay, -1).astype(jnp.float32)


def hostile_chunk_matrices(batch: int, n: int, *, beta: float = 0.99):
  """The ill-conditioned case: ``a = -beta * (strictly lower ones)``, [batch, n, n] float32.

  It is ``inv(I + A)`` for equal keys, ``beta`` near 1 and no decay; X's entries
  alternate in sign while the powers of a grow like binomial coefficients.
  """
  lower = jnp.tril(jnp.ones((n, n), jnp.float32), -1)
  return jnp.broadcast_to(-beta * lower, (batch, n, n))
