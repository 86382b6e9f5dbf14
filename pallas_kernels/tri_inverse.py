"""Unit-lower-triangular inverse kernels: ``X = inv(I - tril(A, -1))`` and its gradient.

Numerics contract (what makes a matrix's bits independent of the batch): each
matrix is handled by one pass of a program's loop, alone; its strictly lower
triangle is read, everything is computed in float32 on ``TILE`` x ``TILE``
blocks, and every sum is taken in a fixed order written in this file. No
operation ever mixes two matrices, so the number of matrices, their position,
padding, the grid, ``matrices_per_program`` and the launch parameters never
change a result; NaN or inf in one matrix stays in that matrix.

Kernels:
  * :func:`tri_inverse_blocked_kernel` - forward substitution on the diagonal
    16x16 blocks, then block merges ``X21 = X22 · A21 · X11`` upward (accurate).
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

from pallas_kernels._common import (compiler_params, dot_f32, launcher, lookup_tiles,
                                    pad_axis, sum_in_order)

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
# notes/h100_notebook.md, "Triangular inverse tile sweep"
# (`benchmarks/bench_tri_inverse.py --sweep`). One warp is fastest up to n = 64
# forward: the substitution has no cross-warp reductions.
GPU_FORWARD_TILES: tuple[tuple[int, TriInverseTiles], ...] = (
    (16, TriInverseTiles(4, 1, 1)),    # 14 us for 8192 matrices
    (32, TriInverseTiles(2, 1, 1)),    # 41 us
    (64, TriInverseTiles(1, 1, 1)),    # 132 us
    (128, TriInverseTiles(1, 4, 1)),   # 1043 us
)
# Above PRELOAD_MAX_N the backward loads each block where it is used (one row
# of P at a time): 3.1 ms at n = 128 against 19.7 ms loading every block first.
GPU_BACKWARD_TILES: tuple[tuple[int, TriInverseTiles], ...] = (
    (16, TriInverseTiles(4, 1, 1)),    # 19 us
    (32, TriInverseTiles(2, 4, 1)),    # 66 us
    (64, TriInverseTiles(1, 4, 1)),    # 237 us
    (128, TriInverseTiles(1, 4, 1)),   # 3.1 ms
)
PRELOAD_MAX_N = 64  # the backward loads every block first up to this n

# Interpret mode (CPU): one config for every n. Two matrices per program so
# that CI runs the in-program loop and the batch padding it needs.
INTERPRET_TILES = TriInverseTiles(2, 4, 1)


def tri_inverse_tiles(n: int, *, interpret: bool, backward: bool = False) -> TriInverseTiles:
  """Tiles for the forward (or ``backward``) kernel on n x n matrices; a
  function of n, the pass and the backend only."""
  if interpret:
    return INTERPRET_TILES
  return lookup_tiles(GPU_BACKWARD_TILES if backward else GPU_FORWARD_TILES, n)


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


def _store_tile(ref, t, i: int, j: int, value):
  ref[t, pl.ds(i * TILE, TILE), pl.ds(j * TILE, TILE)] = value.astype(ref.dtype)


def _invert_diagonal_tiles(lowers):
  """``inv(I - L)`` for each strictly lower [16, 16] f32 block L, together.

  Column-oriented forward substitution: for k = 0..14, every row i > k gets
  ``L[i, k] * X[k, :]`` added (row k is final by then), so ``X[i, j]`` is the sum
  over ascending k. Rows and columns are picked with masks and sums, never by
  indexing registers. (Six masked [16, 16] products per tile, the blocked
  merge done inside the tile, measured slower on the H100: 192 vs 132 us at
  n = 64, 1 warp.)
  """
  rows, cols = _iota(0), _iota(1)
  identity = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)

  def eliminate(k, inverses):
    updated = []
    for lower, inverse in zip(lowers, inverses):
      column = jnp.sum(jnp.where(cols == k, lower, 0.0), axis=1)
      row = jnp.sum(jnp.where(rows == k, inverse, 0.0), axis=0)
      updated.append(inverse + lax.broadcast_in_dim(column, (TILE, TILE), (0,))
                     * lax.broadcast_in_dim(row, (TILE, TILE), (1,)))
    return tuple(updated)

  return lax.fori_loop(0, TILE - 1, eliminate, (identity,) * len(lowers))


def tri_inverse_blocked_kernel(a_ref, x_ref, *, precision):
  """``X = inv(I - tril(A, -1))`` for each of the TB matrices of the block.

  a_ref: [TB, n, n] any float dtype; x_ref: [TB, n, n] float32; n a multiple of
  ``TILE``. Diagonal blocks by forward substitution; then for block sizes
  s = 16, 32, ... < n and each diagonal pair of s-blocks,
  ``T = A21 · X11`` and ``X21 = X22 · T``, each 16x16 block a sum over the
  inner blocks in ascending order, skipping the blocks known to be zero.
  Blocks above the diagonal are stored as zeros, and so is the upper part of
  the diagonal blocks (whatever the input holds).
  """
  count = a_ref.shape[-1] // TILE
  dot = functools.partial(dot_f32, precision=precision)

  def invert(t, carry):
    lowers = [_strictly_lower(_load_tile(a_ref, t, i, i)) for i in range(count)]
    x = {(i, i): inverse for i, inverse in enumerate(_invert_diagonal_tiles(lowers))}
    size = 1
    while size < count:
      for start in range(0, count, 2 * size):
        top = range(start, start + size)
        bottom = range(start + size, start + 2 * size)
        a21 = {(p, r): _load_tile(a_ref, t, p, r) for p in bottom for r in top}
        t21 = {(p, q): sum_in_order([dot(a21[p, r], x[r, q])
                                      for r in top if r >= q])
               for p in bottom for q in top}
        for p in bottom:
          for q in top:
            x[p, q] = sum_in_order([dot(x[p, r], t21[r, q])
                                     for r in bottom if r <= p])
      size *= 2
    zeros = jnp.zeros((TILE, TILE), jnp.float32)
    for i in range(count):
      for j in range(count):
        _store_tile(x_ref, t, i, j, x[i, j] if j < i else _lower(x[i, j]) if j == i else zeros)
    return carry

  lax.fori_loop(0, a_ref.shape[0], invert, 0)


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
  One block row i of dA at a time, over 16x16 blocks: the row of P = Xᵀ · G,
  ``P[i, l] = Σ_{k ≥ i} X[k, i]ᵀ · G[k, l]`` for l ≤ i, then
  ``dA[i, j] = Σ_{l ≤ j} P[i, l] · X[j, l]ᵀ`` for j ≤ i, both sums in
  ascending order. Up to ``PRELOAD_MAX_N`` every block of X and G is loaded
  up front; above it each block is loaded where it is used, so that only one
  row of P and one block column of X are held (the same sums, the same bits).
  """
  count = x_ref.shape[-1] // TILE
  dot = functools.partial(dot_f32, precision=precision)

  def load_g(t, k, l):
    block = _load_tile(g_ref, t, k, l)
    return _strictly_lower(block) if k == l else block

  def differentiate(t, carry):
    if x_ref.shape[-1] <= PRELOAD_MAX_N:
      lower = [(i, j) for i in range(count) for j in range(i + 1)]
      x_blocks = {ij: _load_tile(x_ref, t, *ij) for ij in lower}
      g_blocks = {ij: load_g(t, *ij) for ij in lower}
      x_block, g_block = lambda *ij: x_blocks[ij], lambda *ij: g_blocks[ij]
    else:
      x_block = functools.partial(_load_tile, x_ref, t)
      g_block = functools.partial(load_g, t)
    zeros = jnp.zeros((TILE, TILE), jnp.float32)
    for i in range(count):
      x_column = {k: x_block(k, i) for k in range(i, count)}
      p_row = [sum_in_order([dot(x_column[k], g_block(k, l), trans_a=True)
                             for k in range(i, count)])
               for l in range(i + 1)]
      for j in range(count):
        if j > i:
          _store_tile(da_ref, t, i, j, zeros)
          continue
        block = sum_in_order([dot(p_row[l], x_block(j, l), trans_b=True)
                              for l in range(j + 1)])
        _store_tile(da_ref, t, i, j, _strictly_lower(block) if i == j else block)
    return carry

  lax.fori_loop(0, x_ref.shape[0], differentiate, 0)


def _launch(kernel, inputs, *, out_dtype, tiles: TriInverseTiles, interpret: bool,
            name: str):
  """Runs ``kernel`` on [B, n, n] inputs, TB matrices per program; zero matrices
  pad B to a multiple of TB and are sliced off."""
  batch, n, _ = inputs[0].shape
  tb = tiles.matrices_per_program
  if n not in SIZES:
    raise ValueError(f"n must be one of {SIZES}, got {n}")
  inputs = [pad_axis(x, 0, tb) for x in inputs]
  spec = pl.BlockSpec((tb, n, n), lambda b: (b, 0, 0))
  return pl.pallas_call(
      kernel,
      grid=(inputs[0].shape[0] // tb,),
      in_specs=[spec] * len(inputs),
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(inputs[0].shape, out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name=name,
  )(*inputs)[:batch]


@launcher
def tri_inverse(a, *, method: str, precision, tiles: TriInverseTiles, interpret: bool):
  """Launches the ``method`` ("blocked" or "doubling") forward kernel.

  a: [B, n, n] float dtype, n in ``SIZES``. Returns X: [B, n, n] float32.
  """
  kernels = {"blocked": tri_inverse_blocked_kernel,
             "doubling": tri_inverse_doubling_kernel}
  kernel = functools.partial(kernels[method], precision=precision)
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
