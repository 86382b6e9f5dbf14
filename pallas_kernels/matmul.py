"""Batch-invariant GEMM kernels.

Numerics contract (what makes a row's bits independent of the batch): every
output element is the sum over the contraction dimension taken in steps of
``BLOCK_K`` = 64, in increasing order, each step's product added to one float32
accumulator that starts at zero; the result is rounded to the output dtype once,
at the end. Tile shape (``block_m``, ``block_n``), warps and stages only decide
which program computes an element, never that order, so the dispatcher may pick
them from M. The launchers zero-pad the contraction to a multiple of
``BLOCK_K`` (:func:`pad_contraction`; zeros add nothing to a finite sum).

Kernels:
  * :func:`matmul_kernel` - ``C[g] = A[g] @ B[g]`` or ``A[g] @ B[g]ᵀ`` (forward, dA).
  * :func:`matmul_at_b_kernel` - ``C[g] = A[g]ᵀ @ D[g]``, reduced over rows in
    ``BLOCK_K`` steps (dB): appending rows whose D is zero adds exact zeros.

On an H100, ``jdet.matmul`` sends bf16/f16 GEMMs that suit TMA (dB, and the
forward and dA above ``hopper_matmul.LADDER_ROWS`` rows) to the Mosaic GPU
kernel of :mod:`pallas_kernels.hopper_matmul` instead; it keeps this contract.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (block_mask, cdiv, compiler_params, dot_f32,
                                    launcher, load_block, pad_axis, store_block)

BLOCK_K = 64


def pad_contraction(x: jax.Array, axis: int) -> jax.Array:
  """Zero-pads ``x``'s contraction ``axis`` to a multiple of ``BLOCK_K``: the
  one padding every GEMM launcher (Triton, Mosaic GPU, jax-triton) applies."""
  return pad_axis(x, axis, BLOCK_K)


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
  """Output tile of one program and its Triton launch parameters.

  ``group_m`` tiles of a column of tiles run next to each other (L2 reuse of the
  B tile). ``one_wave_stages``, when set, replaces ``num_stages`` for a grid of
  at most GPU_ONE_WAVE programs: each SM then runs a single program, and only
  loads in flight hide memory latency. Like the rest, these move work between
  programs and change when blocks are loaded, never the sums.
  """
  block_m: int
  block_n: int
  num_warps: int
  num_stages: int
  group_m: int = 8
  one_wave_stages: int | None = None


# Forward / dA tiles on the GPU, largest first. Up to GPU_ONE_ROW_OF_TILES rows
# the dispatcher keeps to the smallest block_m that holds every row (one row of
# tiles, so B streams from memory once); above, it considers them all. It takes
# the first tile whose grid has at least GPU_MIN_PROGRAMS programs (about one
# wave on the H100's 132 SMs), else the last candidate, and gives it
# ``one_wave_stages`` when the grid is a single wave. Only tile shape and
# launch parameters change with M and N; BLOCK_K and the K order never do.
# Every entry gave the same bits as every other; the sweeps that chose them are
# in notes/h100_notebook.md, "GEMM tile sweep" and "deeper pipelines for
# one-wave grids" (`benchmarks/tune_matmul.py`).
GPU_MATMUL_LADDER: tuple[MatmulTiles, ...] = (
    MatmulTiles(128, 256, 8, 3),                        # M >= 1024
    MatmulTiles(128, 128, 8, 3, one_wave_stages=5),     # M = 256 with wide results
    MatmulTiles(64, 128, 4, 4, one_wave_stages=8),      # M = 64-256
    MatmulTiles(64, 64, 4, 4, one_wave_stages=10),      # M = 17-64
    MatmulTiles(16, 64, 4, 5, one_wave_stages=10),      # M <= 16, wide results
    MatmulTiles(16, 32, 4, 6, one_wave_stages=12),      # M <= 16, 4096-column results
)
GPU_MIN_PROGRAMS = 128
GPU_ONE_WAVE = 132  # the H100's SM count
GPU_ONE_ROW_OF_TILES = 64  # up to this many rows, one row of tiles holds them all

# dB = Aᵀ @ D tiles on the GPU: the output is [K, N], so they never depend on the
# row count (`tune_matmul.py --at-b`; notes/h100_notebook.md, "GEMM tile sweep").
GPU_AT_B_TILES = MatmulTiles(128, 256, 8, 3)

# Interpret mode (CPU): one tile for every shape. XLA:CPU may pick a different
# dot algorithm per block shape, so the CPU path never varies the tile.
INTERPRET_TILES = MatmulTiles(32, 32, 4, 1)


# Shared memory a Triton program may use on the H100 (232,448 bytes reported by
# the driver), less headroom for the compiler's own scratch.
GPU_SHARED_MEMORY_BYTES = 224 * 1024


def stages_that_fit(wanted: int, stage_bytes: int, reserved_bytes: int = 0) -> int:
  """The most pipeline stages, at most ``wanted``, whose ``stage_bytes`` each fit in
  GPU_SHARED_MEMORY_BYTES beside ``reserved_bytes``: the one shared-memory rule of
  every GEMM kernel. Stages only change how far ahead blocks load, never the sums."""
  return max(1, min(wanted, (GPU_SHARED_MEMORY_BYTES - reserved_bytes) // stage_bytes))


def fit_stages(tiles: MatmulTiles, itemsize: int) -> MatmulTiles:
  """Lowers num_stages until the pipelined A and B blocks fit in shared memory.

  The bf16 tiles above fit as they are; float32 needs fewer stages for 128 x 256.
  """
  stage_bytes = (tiles.block_m + tiles.block_n) * BLOCK_K * itemsize
  return dataclasses.replace(tiles, num_stages=stages_that_fit(tiles.num_stages, stage_bytes))


def matmul_tiles(m: int, n: int, itemsize: int, *, interpret: bool) -> MatmulTiles:
  """Forward/dA tiles for an [m, n] result (any K) of ``itemsize``-byte operands."""
  if interpret:
    return INTERPRET_TILES
  candidates = GPU_MATMUL_LADDER
  if m <= GPU_ONE_ROW_OF_TILES:
    rows = min(t.block_m for t in candidates if t.block_m >= m)
    candidates = tuple(t for t in candidates if t.block_m == rows)

  def programs(tiles):
    return cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n)

  tiles = next((t for t in candidates if programs(t) >= GPU_MIN_PROGRAMS), candidates[-1])
  if tiles.one_wave_stages and programs(tiles) <= GPU_ONE_WAVE:
    tiles = dataclasses.replace(tiles, num_stages=tiles.one_wave_stages)
  return fit_stages(tiles, itemsize)


def at_b_tiles(k: int, n: int, itemsize: int, *, interpret: bool) -> MatmulTiles:
  """dB tiles for a [k, n] result; never a function of the row count."""
  del k, n
  return INTERPRET_TILES if interpret else fit_stages(GPU_AT_B_TILES, itemsize)


def tile_coords(t, num_m: int, num_n: int, group_m: int):
  """Maps a flat program index to its (row tile, column tile), ``group_m`` rows at a time."""
  per_group = group_m * num_n
  first_m = (t // per_group) * group_m
  rows_in_group = jnp.minimum(num_m - first_m, group_m)
  return first_m + (t % per_group) % rows_in_group, (t % per_group) // rows_in_group


def matmul_kernel(a_ref, b_ref, o_ref, *, m: int, n: int, group_m: int,
                  transpose_b: bool, precision):
  """One [block_m, block_n] tile of ``A @ B`` (or ``A @ Bᵀ``).

  a_ref: [block_m, Kp]; b_ref: [Kp, block_n] ([block_n, Kp] if transpose_b);
  o_ref: [block_m, block_n]. Kp is a multiple of BLOCK_K. Rows >= m and
  columns >= n of the edge tiles are masked.
  """
  block_m, block_n = o_ref.shape
  k_steps = a_ref.shape[-1] // BLOCK_K
  i, j = tile_coords(pl.program_id(0), cdiv(m, block_m), cdiv(n, block_n), group_m)
  rows = block_mask(i * block_m, block_m, m) if m % block_m else None
  cols = block_mask(j * block_n, block_n, n) if n % block_n else None

  def step(kk, acc):
    ks = pl.ds(pl.multiple_of(kk * BLOCK_K, BLOCK_K), BLOCK_K)
    a = load_block(a_ref.at[:, ks], rows=rows)
    if transpose_b:
      b = load_block(b_ref.at[:, ks], rows=cols)
    else:
      b = load_block(b_ref.at[ks, :], cols=cols)
    return acc + dot_f32(a, b, trans_b=transpose_b, precision=precision)

  acc = lax.fori_loop(0, k_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
  store_block(o_ref, acc.astype(o_ref.dtype), rows=rows, cols=cols)


def matmul_at_b_kernel(a_ref, d_ref, o_ref, *, k: int, n: int, precision):
  """One [block_k, block_n] tile of ``Aᵀ @ D``, reduced over rows.

  a_ref: [Rp, block_k]; d_ref: [Rp, block_n]; o_ref: [block_k, block_n]; Rp is a
  multiple of BLOCK_K (zero rows appended by the launcher).
  """
  block_k, block_n = o_ref.shape
  r_steps = a_ref.shape[0] // BLOCK_K
  a_cols = block_mask(pl.program_id(1) * block_k, block_k, k) if k % block_k else None
  d_cols = block_mask(pl.program_id(2) * block_n, block_n, n) if n % block_n else None

  def step(rr, acc):
    rs = pl.ds(pl.multiple_of(rr * BLOCK_K, BLOCK_K), BLOCK_K)
    a = load_block(a_ref.at[rs, :], cols=a_cols)
    d = load_block(d_ref.at[rs, :], cols=d_cols)
    return acc + dot_f32(a, d, trans_a=True, precision=precision)

  acc = lax.fori_loop(0, r_steps, step, jnp.zeros((block_k, block_n), jnp.float32))
  store_block(o_ref, acc.astype(o_ref.dtype), rows=a_cols, cols=d_cols)


@launcher
def matmul(a, b, *, transpose_b: bool, out_dtype, precision, tiles: MatmulTiles,
           interpret: bool):
  """Launches :func:`matmul_kernel` over a batch of problems.

  a: [G, M, K]; b: [Gb, K, N] (or [Gb, N, K] if transpose_b) with Gb in {1, G}
  (Gb = 1 shares b across the batch). Returns [G, M, N] in ``out_dtype``.
  """
  a = pad_contraction(a, 2)
  b = pad_contraction(b, 2 if transpose_b else 1)
  g, m, kp = a.shape
  n = b.shape[1] if transpose_b else b.shape[2]
  shared_b = b.shape[0] == 1
  bm, bn = tiles.block_m, tiles.block_n
  num_m, num_n = cdiv(m, bm), cdiv(n, bn)
  coords = functools.partial(tile_coords, num_m=num_m, num_n=num_n, group_m=tiles.group_m)

  # Grid axis 0 (the fastest-launched) walks the tiles; axis 1 the batch.
  def a_index(t, gi):
    return gi, coords(t)[0], 0

  def b_index(t, gi):
    j = coords(t)[1]
    return (0 if shared_b else gi, j, 0) if transpose_b else (0 if shared_b else gi, 0, j)

  def o_index(t, gi):
    return (gi, *coords(t))

  b_block = (None, bn, kp) if transpose_b else (None, kp, bn)
  kernel = functools.partial(matmul_kernel, m=m, n=n, group_m=tiles.group_m,
                             transpose_b=transpose_b, precision=precision)
  return pl.pallas_call(
      kernel,
      grid=(num_m * num_n, g),
      in_specs=[pl.BlockSpec((None, bm, kp), a_index), pl.BlockSpec(b_block, b_index)],
      out_specs=pl.BlockSpec((None, bm, bn), o_index),
      out_shape=jax.ShapeDtypeStruct((g, m, n), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name="jdet_matmul_t" if transpose_b else "jdet_matmul",
  )(a, b)


@launcher
def matmul_at_b(a, d, *, out_dtype, precision, tiles: MatmulTiles, interpret: bool):
  """Launches :func:`matmul_at_b_kernel`: ``Aᵀ @ D`` per batch entry.

  a: [G, R, K]; d: [G, R, N]: the sum runs over R, zero rows appended to a
  multiple of BLOCK_K. Returns [G, K, N].
  """
  a, d = pad_contraction(a, 1), pad_contraction(d, 1)
  g, rp, k = a.shape
  n = d.shape[2]
  bk, bn = tiles.block_m, tiles.block_n
  kernel = functools.partial(matmul_at_b_kernel, k=k, n=n, precision=precision)
  return pl.pallas_call(
      kernel,
      grid=(g, cdiv(k, bk), cdiv(n, bn)),
      in_specs=[pl.BlockSpec((None, rp, bk), lambda gi, i, j: (gi, 0, i)),
                pl.BlockSpec((None, rp, bn), lambda gi, i, j: (gi, 0, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda gi, i, j: (gi, i, j)),
      out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name="jdet_matmul_at_b",
  )(a, d)
