"""Unit-lower-triangular inverse kernels: ``X = inv(I - tril(A, -1))`` and its gradient.

Numerics contract (what makes a matrix's bits independent of the batch): each
matrix is handled by one pass of a program's loop, alone; its strictly lower
triangle is read, everything is computed in float32 on blocks of ``TILE``
rows, and every sum is taken in a fixed order written in this file. No
operation ever mixes two matrices, so the number of matrices, their position,
padding, the grid, ``matrices_per_program`` and the launch parameters never
change a result; NaN or inf in one matrix stays in that matrix.

Kernels:
  * :func:`tri_inverse_blocked_kernel` - block forward substitution: each
    16x16 diagonal block inverted by forward substitution, then each block
    row from the rows above it (accurate).
  * :func:`tri_inverse_doubling_kernel` - ``X = I, Y = A; X += X·Y, Y = Y·Y``
    over the whole matrix (fast to state, loses accuracy when ``I - A`` is
    ill-conditioned in f32; see ``jdet.tri_inverse``).
  * :func:`tri_inverse_backward_kernel` - ``dA = tril(Xᵀ · G · Xᵀ, -1)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import (compiler_params, counted_rows_call, dot_f32, launcher,
                                    lookup_tiles, pad_axis, store_block)

TILE = 16
SIZES = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class TriInverseTiles:
  """How many matrices one program loops over, and its Triton launch parameters."""
  matrices_per_program: int
  num_warps: int
  num_stages: int


# GPU tiles by the largest n they serve (never by the number of matrices).
# Every candidate gave the same bits; the sweep that chose them is in
# benchmarks/results/h100.md (`benchmarks/bench_tri_inverse.py --sweep`). One
# warp does best where the loops are short: the substitution has no cross-warp
# reductions, and stages pipeline the loads of the block loops.
GPU_FORWARD_TILES: tuple[tuple[int, TriInverseTiles], ...] = (
    (16, TriInverseTiles(4, 1, 1)),
    (32, TriInverseTiles(1, 1, 3)),
    (64, TriInverseTiles(1, 1, 3)),
    (128, TriInverseTiles(1, 2, 3)),
)
GPU_BACKWARD_TILES: tuple[tuple[int, TriInverseTiles], ...] = (
    (16, TriInverseTiles(4, 1, 1)),
    (32, TriInverseTiles(1, 2, 1)),
    (64, TriInverseTiles(1, 1, 3)),
    (128, TriInverseTiles(1, 2, 3)),
)
# The doubling kernel holds whole n x n matrices in registers: it needs more
# warps as n grows (with one warp at n = 64 it spilled and ran 20x slower).
GPU_DOUBLING_TILES: tuple[tuple[int, TriInverseTiles], ...] = (
    (16, TriInverseTiles(4, 1, 1)),
    (32, TriInverseTiles(1, 4, 1)),
    (64, TriInverseTiles(1, 8, 1)),
)
DOUBLING_SIZES = tuple(size for size, _ in GPU_DOUBLING_TILES)

# Interpret mode (CPU): one config for every n. Two matrices per program so
# that CI runs the in-program loop and the batch padding it needs.
INTERPRET_TILES = TriInverseTiles(2, 4, 1)


def tri_inverse_tiles(n: int, *, interpret: bool, kernel: str = "blocked") -> TriInverseTiles:
  """Tiles for ``kernel`` ("blocked", "doubling" or "backward") on n x n
  matrices; a function of n, the kernel and the backend only."""
  if interpret:
    return INTERPRET_TILES
  tables = {"blocked": GPU_FORWARD_TILES, "doubling": GPU_DOUBLING_TILES,
            "backward": GPU_BACKWARD_TILES}
  return lookup_tiles(tables[kernel], n)


def _iota(axis: int):
  return lax.broadcasted_iota(jnp.int32, (TILE, TILE), axis)


def _strictly_lower(block):
  """Zeroes the diagonal and upper part of a diagonal block."""
  return jnp.where(_iota(0) > _iota(1), block, 0.0)


def _lower(block):
  """Zeroes the upper part of a diagonal block. The substitution's upper
  entries are exact zeros for finite input, but NaN or inf in a row's
  multipliers reach them as 0 * inf."""
  return jnp.where(_iota(0) >= _iota(1), block, 0.0)


def _load_tile(ref, t, i: int, j: int):
  """Block (i, j) of matrix t of a [TB, n, n] ref, as float32."""
  rows, cols = pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)
  return ref[t, rows, cols].astype(jnp.float32)


def _store_tile(ref, t, i, j, value):
  ref[t, pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)] = value.astype(ref.dtype)


def _invert_diagonal_tile(lower):
  """``inv(I - L)`` for a strictly lower [16, 16] float32 block L.

  Column-oriented forward substitution: for k = 0..14, every row i > k gets
  ``L[i, k] * X[k, :]`` added (row k is final by then), so ``X[i, j]`` is the sum
  over ascending k. Rows and columns are picked with masks and sums, never by
  indexing registers.
  """
  rows, cols = _iota(0), _iota(1)

  def eliminate(k, inverse):
    column = jnp.sum(jnp.where(cols == k, lower, 0.0), axis=1)
    row = jnp.sum(jnp.where(rows == k, inverse, 0.0), axis=0)
    return inverse + (lax.broadcast_in_dim(column, (TILE, TILE), (0,))
                      * lax.broadcast_in_dim(row, (TILE, TILE), (1,)))

  identity = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)
  return lax.fori_loop(0, TILE - 1, eliminate, identity)


def _for_each_block_row(matrices: int, n: int, block_row) -> None:
  """Calls ``block_row(t, i, carry)`` for each matrix t of the program, then each of
  its block rows i in increasing order, as loops (the kernel's code stays one block
  row's, whatever n)."""
  lax.fori_loop(0, matrices, lambda t, carry: lax.fori_loop(
      0, n // TILE, functools.partial(block_row, t), carry), 0)


def tri_inverse_blocked_kernel(a_ref, x_ref, *, precision, native: bool):
  """``X = inv(I - tril(A, -1))`` for each of the TB matrices of the block.

  a_ref: [TB, n, n] any float dtype; x_ref: [TB, n, n] float32; n a multiple of
  ``TILE``. Block forward substitution over 16x16 blocks, one block row after
  another (loops, so that the kernel's code does not grow with n):
  ``X[i, i] = D = inv(I - A[i, i])`` by forward substitution, then for j < i
  ``X[i, j] = D · Σ_{k=j}^{i-1} A[i, k] · X[k, j]``, the sum in ascending k.
  The blocks of X already written are read back from ``x_ref`` (``native``:
  after a barrier, so that every thread of the program sees them). Blocks
  above the diagonal, and the diagonal blocks' upper parts, are stored as
  zeros whatever the input holds.
  """
  n = a_ref.shape[-1]
  dot = functools.partial(dot_f32, precision=precision)

  def block_row(t, i, carry):
    inverse = _invert_diagonal_tile(_strictly_lower(_load_tile(a_ref, t, i, i)))
    beyond = lax.broadcasted_iota(jnp.int32, (n,), 0) >= (i + 1) * TILE
    store_block(x_ref.at[t, pl.ds(i * TILE, TILE), :], jnp.zeros((TILE, n), jnp.float32),
                cols=beyond)
    _store_tile(x_ref, t, i, i, _lower(inverse))

    def block(j, carry):
      def accumulate(k, total):
        return total + dot(_load_tile(a_ref, t, i, k), _load_tile(x_ref, t, k, j))
      total = lax.fori_loop(j, i, accumulate, jnp.zeros((TILE, TILE), jnp.float32))
      _store_tile(x_ref, t, i, j, dot(inverse, total))
      return carry

    lax.fori_loop(0, i, block, 0)
    if native:
      pltriton.debug_barrier()
    return carry

  _for_each_block_row(a_ref.shape[0], n, block_row)


def tri_inverse_doubling_kernel(a_ref, x_ref, *, precision):
  """``X = inv(I - tril(A, -1))`` by doubling on the whole matrix.

  a_ref: [TB, n, n] any float dtype; x_ref: [TB, n, n] float32. X = I, Y = A;
  ceil(log2 n) times X = X + X·Y, then Y = Y·Y (skipped after the last step),
  each product one n x n dot: X = I + A + ... + A^(n-1), exact in exact
  arithmetic, with f32 cancellation when the powers of A are large. The upper
  triangle is stored as zeros (the products spread NaN/inf over the matrix).
  """
  n = a_ref.shape[-1]
  rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
  cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
  identity = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)
  dot = functools.partial(dot_f32, precision=precision)

  def double(_, xy):
    x, y = xy
    return x + dot(x, y), dot(y, y)

  def invert(t, carry):
    a = jnp.where(rows > cols, a_ref[t, :, :].astype(jnp.float32), 0.0)
    x, y = lax.fori_loop(0, math.ceil(math.log2(n)) - 1, double, (identity, a))
    x_ref[t, :, :] = jnp.where(rows >= cols, x + dot(x, y), 0.0)
    return carry

  lax.fori_loop(0, a_ref.shape[0], invert, 0)


def tri_inverse_backward_kernel(x_ref, g_ref, da_ref, *, precision):
  """``dA = tril(Xᵀ · G · Xᵀ, -1)`` for each of the TB matrices of the block.

  x_ref: [TB, n, n] float32 unit lower triangular (the forward's output);
  g_ref: [TB, n, n] float32 cotangent, of which only the strictly lower
  triangle is read (the rest cannot reach dA's strictly lower triangle);
  da_ref: [TB, n, n] in the input's dtype, zero on and above the diagonal.
  One block row i of dA after another (loops): for l = 0..i in ascending order,
  the 16x16 block ``P[i, l] = Σ_{k ≥ i} X[k, i]ᵀ · G[k, l]`` of P = Xᵀ · G (sum
  in ascending k), then ``dA[i, :] += P[i, l] · X[:, l]ᵀ``, a [16, 16] x [16, n]
  product.
  """
  n = x_ref.shape[-1]
  count = n // TILE
  dot = functools.partial(dot_f32, precision=precision)
  rows = lax.broadcasted_iota(jnp.int32, (TILE, n), 0)
  cols = lax.broadcasted_iota(jnp.int32, (TILE, n), 1)

  def block_row(t, i, carry):
    def add_column_block(l, total):
      def accumulate(k, p):
        g = _load_tile(g_ref, t, k, l)
        return p + dot(_load_tile(x_ref, t, k, i), jnp.where(k == l, _strictly_lower(g), g),
                       trans_a=True)
      p = lax.fori_loop(i, count, accumulate, jnp.zeros((TILE, TILE), jnp.float32))
      x_columns = x_ref[t, :, pl.ds(l * TILE, TILE)]
      return total + dot(p, x_columns, trans_b=True)

    da = lax.fori_loop(0, i + 1, add_column_block, jnp.zeros((TILE, n), jnp.float32))
    da_ref[t, pl.ds(i * TILE, TILE), :] = jnp.where(cols < i * TILE + rows, da,
                                                     0.0).astype(da_ref.dtype)
    return carry

  _for_each_block_row(x_ref.shape[0], n, block_row)


def _launch(kernel, inputs, *, out_dtype, tiles: TriInverseTiles, interpret: bool,
            name: str):
  """Runs ``kernel`` on [B, n, n] inputs, TB matrices per program; zero matrices
  pad B to a multiple of TB and are sliced off. B is an operand of the launch on a
  bucketed grid (:func:`counted_rows_call`): one compiled kernel serves every B of a
  bucket. The padding makes every matrix of a running program real, so the kernel
  needs no mask."""
  batch, n, _ = inputs[0].shape
  tb = tiles.matrices_per_program
  if n not in SIZES:
    raise ValueError(f"n must be one of {SIZES}, got {n}")
  inputs = [pad_axis(x, 0, tb) for x in inputs]
  spec = pl.BlockSpec((tb, n, n), lambda b: (b, 0, 0))
  return counted_rows_call(
      lambda *refs, valid: kernel(*refs), rows=batch, block_rows=tb,
      in_specs=[spec] * len(inputs), out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(inputs[0].shape, out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret, name=name,
  )(*inputs)[:batch]


@launcher
def tri_inverse(a, *, method: str, precision, tiles: TriInverseTiles, interpret: bool):
  """Launches the ``method`` ("blocked" or "doubling") forward kernel.

  a: [B, n, n] float dtype, n in ``SIZES``. Returns X: [B, n, n] float32.
  """
  if method == "blocked":
    kernel = functools.partial(tri_inverse_blocked_kernel, precision=precision,
                               native=not interpret)
  else:
    kernel = functools.partial(tri_inverse_doubling_kernel, precision=precision)
  return _launch(kernel, (a,), out_dtype=jnp.float32, tiles=tiles, interpret=interpret,
                 name=f"jdet_tri_inverse_{method}")


@launcher
def tri_inverse_backward(x, g, *, out_dtype, precision, tiles: TriInverseTiles,
                         interpret: bool):
  """Launches :func:`tri_inverse_backward_kernel`.

  x, g: [B, n, n] float32. Returns dA: [B, n, n] in ``out_dtype``.
  """
  kernel = functools.partial(tri_inverse_backward_kernel, precision=precision)
  return _launch(kernel, (x, g), out_dtype=out_dtype, tiles=tiles, interpret=interpret,
                 name="jdet_tri_inverse_backward")
