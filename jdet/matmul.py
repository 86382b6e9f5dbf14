"""``jdet.matmul``: a GEMM whose every output row is bitwise independent of the batch."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet._backend import (FLOAT_DTYPES, as_array, check_float, check_ndim, check_precision,
                           differentiable_once, use_interpret)
from pallas_kernels import jax_triton_matmul
from pallas_kernels import matmul_plan
from pallas_kernels.matmul import Layout


@dataclasses.dataclass(frozen=True)
class _GemmConfig:
  precision: lax.Precision | None
  out_dtype: np.dtype
  interpret: bool
  backend: str


BACKENDS = matmul_plan.BACKENDS


def matmul(a, b, *, precision=None, preferred_element_type=None, interpret=None,
           backend="pallas"):
  """Batch-invariant ``a @ b`` with a fixed float32 reduction order.

  Args:
    a: ``[..., M, K]`` activations (rows are tokens). bfloat16, float16 or float32.
    b: ``[K, N]`` shared weight, or ``[..., K, N]`` whose leading dims broadcast
      with ``a``'s like :func:`jax.numpy.matmul`.
    precision: ``None``/``DEFAULT`` lets float32 inputs use TF32 on the GPU;
      ``jax.lax.Precision.HIGHEST`` gives IEEE float32 products. bf16/f16
      inputs always multiply exactly and accumulate in float32. CPU is always
      IEEE float32. Also taken: the names ("HIGHEST") and the strings
      ``jax.lax.Precision`` accepts ("highest", "float32", ...), or a pair of
      equal ones; anything else raises ValueError.
    preferred_element_type: output dtype, bfloat16, float16 or float32 (else
      TypeError); defaults to ``jnp.result_type(a, b)``.
    interpret: ``None`` picks by platform (native on GPU, interpret on CPU). Which
      kernel runs each GEMM (on an H100, bf16/f16 GEMMs whose sizes suit TMA run on
      a Mosaic GPU kernel, the rest on Triton) is decided in one place,
      :func:`pallas_kernels.matmul_plan.plan`; every kernel keeps the contract
      below and gives the same bits.
    backend: ``"pallas"`` (default) runs the Pallas kernels; ``"triton"`` runs
      the same GEMM written in Triton, launched by jax-triton (NVIDIA GPU only;
      install with ``pip install 'jdet[triton]'``). Both keep the contract below;
      ``notes/h100_notebook.md`` records that their bits agree.

  Returns:
    ``[..., M, N]``. Mixed input dtypes are cast to ``jnp.result_type(a, b)``;
    accumulation is always float32 and the result is rounded once.

  Invariance: row ``i`` of the result depends only on ``a``'s row ``i`` and on
  ``b``: not on M, on the row's position, on padding rows, on ``jit``/``vmap``,
  nor on the run. The contraction runs in fixed 64-wide steps in increasing
  order (zero-padding K does not change a row); where the result has fewer than
  2048 columns, in fixed chunks of them summed from zero and added in order,
  the chunk's length a function of N alone
  (:func:`pallas_kernels.matmul_plan.fixed_contraction_chunk`), so that a few
  rows still spread over the GPU. Under ``jax.grad``, ``dA`` has
  the same property and ``dB`` is reduced over rows in a fixed order: appending
  rows whose cotangent is zero leaves it bitwise unchanged.

  Differentiable once, in reverse mode (``jax.grad``, ``jax.vjp``): a second
  derivative (``jax.grad`` of ``jax.grad``, ``jax.hessian``) or forward mode
  (``jax.jvp``, ``jax.jacfwd``) raises NotImplementedError.
  """
  a = as_array("a", a)
  b = as_array("b", b)
  check_ndim("a", a, 2, "[..., M, K]")
  check_ndim("b", b, 2, "[K, N] or [..., K, N]")
  check_float("a", a)
  check_float("b", b)
  m, k = a.shape[-2:]
  if b.shape[-2] != k:
    raise ValueError(
        f"b must have K = {k} rows to match a's last dim (a: {a.shape}), got b: {b.shape}")
  n = b.shape[-1]
  if k < 1 or n < 1:
    raise ValueError(f"K and N must be >= 1, got a: {a.shape}, b: {b.shape}")
  try:
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
  except ValueError:
    raise ValueError(
        f"batch dims of a {a.shape[:-2]} and b {b.shape[:-2]} do not broadcast") from None
  compute_dtype = jnp.result_type(a.dtype, b.dtype)
  out_dtype = _check_out_dtype(preferred_element_type, compute_dtype)
  precision = check_precision("precision", precision, None)
  config = _GemmConfig(precision, out_dtype, _interpret_for(backend, interpret, a, b), backend)
  a = a.astype(compute_dtype)
  b = b.astype(compute_dtype)
  if a.size == 0 or b.size == 0:
    return jnp.zeros((*batch, m, n), out_dtype)
  if b.ndim == 2:
    out = _gemm(a.reshape(1, -1, k), b[None], config)
    return out.reshape(*a.shape[:-1], n)
  return _batched(a, b, batch, config)


def _check_out_dtype(preferred_element_type, compute_dtype) -> np.dtype:
  if preferred_element_type is None:
    return jnp.dtype(compute_dtype)
  try:
    out_dtype = jnp.dtype(preferred_element_type)
  except (TypeError, ValueError):
    out_dtype = None
  if out_dtype not in FLOAT_DTYPES:
    raise TypeError(f"preferred_element_type must be None, bfloat16, float16 or float32, "
                    f"got {preferred_element_type!r}")
  return out_dtype


def _interpret_for(backend: str, interpret, a, b) -> bool:
  """Checks ``backend`` (and that Triton can run here) and resolves ``interpret``."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "pallas":
    return use_interpret(interpret, a, b)
  jax_triton_matmul.load()
  if interpret or use_interpret(None, a, b):
    raise ValueError(
        "backend='triton' runs only on an NVIDIA GPU (it has no interpret mode); "
        "use backend='pallas' on CPU")
  return False


def gemm(config: _GemmConfig, layout: Layout, lhs, rhs, *, out_dtype,
         contraction_chunk: int | None = None):
  """Plans and runs ``G`` GEMMs; returns [G, rows, cols].

  NN: lhs [G, rows, K], rhs [Gb, K, cols]; NT: lhs [G, rows, K], rhs [Gb, cols, K]
  (Gb in {1, G}); TN: lhs [G, R, rows], rhs [G, R, cols], reduced over R.
  ``contraction_chunk``: K summed in chunks (``matmul_plan.plan``; None: the
  result's own, ``matmul_plan.fixed_contraction_chunk``).
  """
  return matmul_plan.run(layout, lhs, rhs, out_dtype=out_dtype, precision=config.precision,
                         backend=config.backend, interpret=config.interpret,
                         contraction_chunk=contraction_chunk)


def _batched(a, b, batch, config):
  """Folds the batch dims that ``b`` broadcasts over into rows, the rest into groups."""
  m, k = a.shape[-2:]
  n = b.shape[-1]
  nb = len(batch)
  a = a.reshape((1,) * (nb - a.ndim + 2) + a.shape)
  b = b.reshape((1,) * (nb - b.ndim + 2) + b.shape)
  group_axes = [i for i in range(nb) if b.shape[i] != 1]
  row_axes = [i for i in range(nb) if b.shape[i] == 1]
  a = _broadcast_fixed_order(a, tuple(batch) + (m, k))
  perm = group_axes + row_axes + [nb, nb + 1]
  groups = [batch[i] for i in group_axes]
  rows = [batch[i] for i in row_axes]
  a3 = a.transpose(perm).reshape(int(np.prod(groups)), -1, k)
  b3 = b.transpose(perm).reshape(int(np.prod(groups)), k, n)
  out = _gemm(a3, b3, config).reshape(*groups, *rows, m, n)
  return out.transpose(np.argsort(perm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _broadcast_fixed_order(x, shape):
  return jnp.broadcast_to(x, shape)


def _broadcast_forward(x, shape):
  return jnp.broadcast_to(x, shape), x.shape


def _broadcast_backward(shape, x_shape, g):
  """Sums the broadcast copies one at a time, in index order (never a tree)."""
  for axis, size in enumerate(x_shape):
    if size == 1 and g.shape[axis] != 1:
      moved = jnp.moveaxis(g, axis, 0)
      total = lax.fori_loop(1, moved.shape[0], lambda i, acc: acc + moved[i], moved[0])
      g = jnp.expand_dims(total, axis)
  return (g,)


_broadcast_fixed_order.defvjp(_broadcast_forward, _broadcast_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm(a, b, config: _GemmConfig):
  """a: [G, R, K]; b: [Gb, K, N] with Gb in {1, G}; returns [G, R, N]."""
  return gemm(config, Layout.NN, a, b, out_dtype=config.out_dtype)


def _gemm_forward(a, b, config):
  return _gemm(a, b, config), (a, b)


def _gemm_backward(config, residuals, dc):
  a, b = residuals
  g, r, k = a.shape
  n = b.shape[2]
  dtype = jnp.result_type(dc.dtype, a.dtype)
  dc = dc.astype(dtype)
  # dA = dC @ Bᵀ: the same invariant kernel, contracting over N in fixed steps.
  da = gemm(config, Layout.NT, dc, b.astype(dtype), out_dtype=a.dtype)
  # dB = Aᵀ @ dC: reduced over rows (all groups' rows when b is shared) in
  # fixed 64-row steps; the last step's missing rows count as zeros.
  if b.shape[0] == 1:
    a, dc = a.reshape(1, g * r, k), dc.reshape(1, g * r, n)
  db = gemm(config, Layout.TN, a.astype(dtype), dc, out_dtype=b.dtype)
  return da, db


_gemm = differentiable_once("matmul", _gemm, _gemm_forward, _gemm_backward)


def matmul_reference(a, b, *, precision=lax.Precision.HIGHEST, preferred_element_type=None):
  """Plain ``jnp.matmul`` with float32 accumulation (not batch-invariant)."""
  out_dtype = preferred_element_type or jnp.result_type(a, b)
  return jnp.matmul(a, b, precision=precision,
                    preferred_element_type=jnp.float32).astype(out_dtype)
