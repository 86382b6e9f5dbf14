"""Helpers shared by every kernel family: sizes, padding, masks, compiler params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """Zero-pads ``x`` along ``axis`` up to the next multiple of ``multiple``."""
  size = x.shape[axis]
  extra = cdiv(size, multiple) * multiple - size
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def lookup_tiles(table, size: int):
  """The tiles of the first ``(largest size served, tiles)`` entry of ``table``
  (sorted by size) that serves ``size``: the one shape of jdet's tile tables."""
  for largest, tiles in table:
    if size <= largest:
      return tiles
  raise ValueError(f"size {size} exceeds the largest this tile table serves ({table[-1][0]})")


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def run_as_own_program(kernel, result: jax.ShapeDtypeStruct, *args):
  """Runs a row-wise interpret-mode ``kernel(*args)`` as a separately compiled program.

  XLA:CPU decides per program whether ``a*b + c`` becomes one FMA, so a kernel
  inlined into different programs (``jit(grad)``, ``vmap``, aliased inputs) can
  round differently. Calling it through a host callback gives it one program of
  its own whatever surrounds it. ``kernel`` maps arrays whose leading axis is
  the row axis to a ``result``-shaped array, each row on its own; under
  ``vmap`` the (broadcast) extra leading axes are folded into the rows. CPU only.
  """
  rank = len(result.shape)

  def host(*arrays):
    lead = arrays[0].shape[:arrays[0].ndim - rank]
    rows = [np.asarray(a).reshape((-1,) + a.shape[len(lead) + 1:]) for a in arrays]
    return np.asarray(kernel(*rows)).reshape(lead + result.shape)

  return jax.pure_callback(host, result, *args, vmap_method="broadcast_all")


def dot_f32(a, b, *, trans_a: bool = False, trans_b: bool = False, precision=None):
  """2-D ``a @ b`` (optionally transposed operands) accumulated in float32, in-kernel.

  Use this instead of ``pl.dot`` (removed in jax 0.12). ``precision=HIGHEST`` makes
  float32 products IEEE on the GPU; the default lets Triton use TF32.
  """
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=jnp.float32)


def sum_in_order(terms):
  """Left-to-right sum of a non-empty sequence of arrays: the one fixed order
  every kernel uses for sums it unrolls."""
  total = terms[0]
  for term in terms[1:]:
    total = total + term
  return total


def _ptx_f32(instruction: str, *operands):
  """One PTX float32 instruction per element (``$0`` the result, ``$1``... the
  operands, which broadcast to one shape); GPU (Triton lowering) only."""
  shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in operands))
  [result] = pltriton.elementwise_inline_asm(
      instruction, args=[jnp.broadcast_to(v, shape) for v in operands],
      constraints=",".join(["=f"] + ["f"] * len(operands)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
  return result


def reciprocal(x, *, approx: bool):
  """Elementwise float32 ``1 / x``, inside a kernel.

  ``approx=True`` (GPU only) is one ``rcp.approx.ftz.f32`` (at most 1 ulp from
  the exact reciprocal, subnormal inputs and results flushed to zero) instead of
  the IEEE division's multi-instruction sequence; interpret mode needs
  ``approx=False``. Either way a value's bits depend on that value alone.
  """
  return _ptx_f32("rcp.approx.ftz.f32 $0, $1;", x) if approx else 1.0 / x


def multiply_add(a, b, c, *, fused: bool):
  """Elementwise float32 ``a * b + c``, inside a kernel; operands broadcast.

  ``fused=True`` (GPU only) is one ``fma.rn.f32``, a single rounding: jaxlib's
  Triton pipeline does not contract a multiply and an add on its own (Nsight
  Compute counted 2 fused of ~3,800 FP32 instructions per token in the Sinkhorn
  backward). Interpret mode needs ``fused=False``. Either way a value's bits
  depend on its operands alone.
  """
  return _ptx_f32("fma.rn.f32 $0, $1, $2, $3;", a, b, c) if fused else a * b + c


def block_mask(start, block: int, limit: int):
  """Boolean [block] vector: which of the indices start..start+block-1 are < limit."""
  return start + jnp.arange(block) < limit


def load_block(ref, rows=None, cols=None):
  """Loads a 2-D block, zero-filling the rows/columns whose mask is False.

  ``rows``/``cols`` are boolean vectors from :func:`block_mask`, or ``None`` when
  the block is statically known to lie inside the array (no mask, no cost).
  """
  if rows is None and cols is None:
    return ref[...]
  if rows is None:
    mask = cols[None, :]
  elif cols is None:
    mask = rows[:, None]
  else:
    mask = rows[:, None] & cols[None, :]
  return pltriton.load(ref, mask=mask, other=0)


def store_block(ref, value, rows=None, cols=None):
  """Stores a 2-D block, skipping the rows/columns whose mask is False."""
  if rows is None and cols is None:
    ref[...] = value
    return
  if rows is None:
    mask = cols[None, :]
  elif cols is None:
    mask = rows[:, None]
  else:
    mask = rows[:, None] & cols[None, :]
  pltriton.store(ref, value, mask=mask)


__all__ = [
    "block_mask",
    "cdiv",
    "compiler_params",
    "dot_f32",
    "load_block",
    "lookup_tiles",
    "multiply_add",
    "pad_axis",
    "reciprocal",
    "run_as_own_program",
    "store_block",
    "sum_in_order",
]
