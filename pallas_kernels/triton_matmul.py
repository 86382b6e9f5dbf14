"""The batch-invariant GEMM written in Triton (``triton.jit``), for jax-triton and PyTorch.

Same numerics contract as :mod:`pallas_kernels.matmul`: every output element is
the sum over the contraction dimension in ``BLOCK_K`` = 64 steps, in increasing
order, each step's float32 product added to one float32 accumulator that starts
at zero (or fixed chunks of the contraction so, their sums added in order),
rounded to the output dtype once at the end. The kernels below mirror
the Pallas ones op for op (masked loads that fill zeros, ``acc + dot(a, b)``
with a fresh float32 dot per step, the same input precision, the same grouped
tile order; float32 operands of TF32 dots rounded to TF32 as that lowering
rounds them), so a launch from JAX (``jax_triton.triton_call``) and one from
PyTorch compile the same Triton program and give the same bits.

Importing this module needs ``triton``; nothing else in jdet imports it unless
the Triton backend or the PyTorch entry point is asked for.
"""

from __future__ import annotations

import triton
import triton.language as tl
from jax import lax

from pallas_kernels._common import cdiv
from pallas_kernels.matmul import BLOCK_K, MatmulTiles


def input_precision(precision: lax.Precision | None) -> str:
  """Triton's ``input_precision`` for a jax precision, as the Pallas lowering maps it.

  ``HIGHEST`` gives IEEE float32 products; ``None``/``DEFAULT``/``HIGH`` let float32
  inputs use TF32. bf16/f16 inputs multiply exactly either way.
  """
  return "ieee" if precision == lax.Precision.HIGHEST else "tf32"


@triton.jit
def _dot_operand(x, INPUT_PRECISION: tl.constexpr):
  """``x`` as the Pallas lowering feeds it to a dot: float32 operands of a TF32 dot
  rounded to TF32 to nearest, ties away from zero (``cvt.rna.tf32.f32``), where
  Triton itself would let the tensor cores truncate. Other operands unchanged."""
  if INPUT_PRECISION == "tf32":
    if x.dtype == tl.float32:
      return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x],
                                       dtype=tl.float32, is_pure=True, pack=1)
  return x


@triton.jit
def _tile_coords(t, num_m, num_n, GROUP_M: tl.constexpr):
  """Flat program index -> (row tile, column tile), ``GROUP_M`` row tiles at a time."""
  per_group = GROUP_M * num_n
  first_m = (t // per_group) * GROUP_M
  rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
  return first_m + (t % per_group) % rows_in_group, (t % per_group) // rows_in_group


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr,
                  M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  SHARED_B: tl.constexpr, TRANSPOSE_B: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                  CHUNK: tl.constexpr):
  """One [BLOCK_M, BLOCK_N] tile of ``C[g] = A[g] @ B[g]`` (``A[g] @ B[g]ᵀ`` if TRANSPOSE_B).

  Grid: (tiles, G). A: [G, M, K]; B: [Gb, K, N] ([Gb, N, K] if TRANSPOSE_B),
  Gb = 1 when SHARED_B; C: [G, M, N]; all contiguous. A last partial BLOCK_K
  step loads the contraction past K as zeros. ``CHUNK`` (a multiple of
  BLOCK_K, or K for none): each run of CHUNK contraction indices summed from
  zero, the sums added in order (``pallas_kernels.matmul.contraction_loop``).
  """
  num_m = tl.cdiv(M, BLOCK_M)
  num_n = tl.cdiv(N, BLOCK_N)
  i, j = _tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)
  g = tl.program_id(1).to(tl.int64)
  rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
  cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
  ks = tl.arange(0, BLOCK_K)
  row_ok = rows < M
  col_ok = cols < N
  a_ptrs = a_ptr + g * (M * K) + rows[:, None] * K + ks[None, :]
  if SHARED_B:
    b_base = b_ptr
  else:
    b_base = b_ptr + g * (N * K)
  if TRANSPOSE_B:
    b_ptrs = b_base + cols[:, None] * K + ks[None, :]
  else:
    b_ptrs = b_base + ks[:, None] * N + cols[None, :]
  if CHUNK >= K:
    acc = _steps(a_ptrs, b_ptrs, row_ok, col_ok, ks, M % BLOCK_M != 0, N % BLOCK_N != 0, N,
                 BLOCK_M, BLOCK_N, BLOCK_K, K // BLOCK_K, K % BLOCK_K, TRANSPOSE_B,
                 INPUT_PRECISION)
  else:
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K // CHUNK):
      # acc + chunk, as pallas_kernels.matmul.add_chunk_sum writes it (not folded
      # into the dot of a chunk of one step).
      acc -= 0 - _steps(a_ptrs, b_ptrs, row_ok, col_ok, ks, M % BLOCK_M != 0, N % BLOCK_N != 0,
                        N, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK // BLOCK_K, 0, TRANSPOSE_B,
                        INPUT_PRECISION)
      a_ptrs += CHUNK
      if TRANSPOSE_B:
        b_ptrs += CHUNK
      else:
        b_ptrs += CHUNK * N
    if K % CHUNK:
      acc -= 0 - _steps(a_ptrs, b_ptrs, row_ok, col_ok, ks, M % BLOCK_M != 0, N % BLOCK_N != 0,
                        N, BLOCK_M, BLOCK_N, BLOCK_K, K % CHUNK // BLOCK_K, K % BLOCK_K,
                        TRANSPOSE_B, INPUT_PRECISION)
  c_ptrs = c_ptr + g * (M * N) + rows[:, None] * N + cols[None, :]
  tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _steps(a_ptrs, b_ptrs, row_ok, col_ok, ks, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr,
           N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           FULL_STEPS: tl.constexpr, PARTIAL: tl.constexpr, TRANSPOSE_B: tl.constexpr,
           INPUT_PRECISION: tl.constexpr):
  """The float32 sum from zero of ``FULL_STEPS`` BLOCK_K steps from the pointers,
  then, if ``PARTIAL``, of a last step over its first ``PARTIAL`` indices."""
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  for _ in range(0, FULL_STEPS):
    acc = _matmul_step(acc, a_ptrs, b_ptrs, row_ok, col_ok, ks < BLOCK_K, MASK_ROWS, MASK_COLS,
                       False, TRANSPOSE_B, INPUT_PRECISION)
    a_ptrs += BLOCK_K
    if TRANSPOSE_B:
      b_ptrs += BLOCK_K
    else:
      b_ptrs += BLOCK_K * N
  if PARTIAL:
    acc = _matmul_step(acc, a_ptrs, b_ptrs, row_ok, col_ok, ks < PARTIAL, MASK_ROWS, MASK_COLS,
                       True, TRANSPOSE_B, INPUT_PRECISION)
  return acc


@triton.jit
def _masked_load(ptrs, major_ok, minor_ok, MASK_MAJOR: tl.constexpr, MASK_MINOR: tl.constexpr):
  """Loads a 2-D block, the positions whose ``major_ok``/``minor_ok`` is False as zeros
  (each mask applied only where its flag says it can be False)."""
  if MASK_MAJOR and MASK_MINOR:
    block = tl.load(ptrs, mask=major_ok[:, None] & minor_ok[None, :], other=0)
  elif MASK_MAJOR:
    block = tl.load(ptrs, mask=major_ok[:, None], other=0)
  elif MASK_MINOR:
    block = tl.load(ptrs, mask=minor_ok[None, :], other=0)
  else:
    block = tl.load(ptrs)
  return block


@triton.jit
def _matmul_step(acc, a_ptrs, b_ptrs, row_ok, col_ok, k_ok, MASK_ROWS: tl.constexpr,
                 MASK_COLS: tl.constexpr, MASK_K: tl.constexpr, TRANSPOSE_B: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
  """``acc + A_step @ B_step``, loading masked rows, columns and contraction as zeros."""
  a = _dot_operand(_masked_load(a_ptrs, row_ok, k_ok, MASK_ROWS, MASK_K), INPUT_PRECISION)
  if TRANSPOSE_B:
    b = tl.trans(_dot_operand(_masked_load(b_ptrs, col_ok, k_ok, MASK_COLS, MASK_K),
                              INPUT_PRECISION))
  else:
    b = _dot_operand(_masked_load(b_ptrs, k_ok, col_ok, MASK_K, MASK_COLS), INPUT_PRECISION)
  return acc + tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def matmul_at_b_kernel(a_ptr, d_ptr, c_ptr,
                       R: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr):
  """One [BLOCK_M, BLOCK_N] tile of ``C[g] = A[g]ᵀ @ D[g]``, reduced over rows in BLOCK_K steps.

  Grid: (G, cdiv(K, BLOCK_M), cdiv(N, BLOCK_N)). A: [G, R, K]; D: [G, R, N];
  C: [G, K, N]. A last partial step loads the rows past R as zeros.
  """
  g = tl.program_id(0).to(tl.int64)
  a_cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
  d_cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
  rs = tl.arange(0, BLOCK_K)
  a_ok = a_cols < K
  d_ok = d_cols < N
  a_ptrs = a_ptr + g * (R * K) + rs[:, None] * K + a_cols[None, :]
  d_ptrs = d_ptr + g * (R * N) + rs[:, None] * N + d_cols[None, :]
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  for _ in range(0, R // BLOCK_K):
    acc = _at_b_step(acc, a_ptrs, d_ptrs, a_ok, d_ok, rs < BLOCK_K, K % BLOCK_M != 0,
                     N % BLOCK_N != 0, False, INPUT_PRECISION)
    a_ptrs += BLOCK_K * K
    d_ptrs += BLOCK_K * N
  if R % BLOCK_K:
    acc = _at_b_step(acc, a_ptrs, d_ptrs, a_ok, d_ok, rs < R % BLOCK_K, K % BLOCK_M != 0,
                     N % BLOCK_N != 0, True, INPUT_PRECISION)
  c_ptrs = c_ptr + g * (K * N) + a_cols[:, None] * N + d_cols[None, :]
  tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=a_ok[:, None] & d_ok[None, :])


@triton.jit
def _at_b_step(acc, a_ptrs, d_ptrs, a_ok, d_ok, r_ok, MASK_A: tl.constexpr,
               MASK_D: tl.constexpr, MASK_R: tl.constexpr, INPUT_PRECISION: tl.constexpr):
  """``acc + A_stepᵀ @ D_step``, loading masked columns and rows as zeros."""
  a = _dot_operand(_masked_load(a_ptrs, r_ok, a_ok, MASK_R, MASK_A), INPUT_PRECISION)
  d = _dot_operand(_masked_load(d_ptrs, r_ok, d_ok, MASK_R, MASK_D), INPUT_PRECISION)
  return acc + tl.dot(tl.trans(a), d, input_precision=INPUT_PRECISION)


def matmul_launch(g: int, m: int, n: int, k: int, *, transpose_b: bool, shared_b: bool,
                  tiles: MatmulTiles, precision, contraction_chunk: int | None = None
                  ) -> tuple[tuple[int, int], dict]:
  """Grid and constexpr arguments of :func:`matmul_kernel` (JAX and PyTorch launch
  alike); ``contraction_chunk``: the plan's (None: no chunks)."""
  grid = (cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n), g)
  chunk = k if contraction_chunk is None else min(contraction_chunk, k)
  return grid, dict(
      M=m, N=n, K=k, SHARED_B=shared_b, TRANSPOSE_B=transpose_b,
      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K,
      GROUP_M=tiles.group_m, INPUT_PRECISION=input_precision(precision), CHUNK=chunk)


def matmul_at_b_launch(g: int, r: int, k: int, n: int, *, tiles: MatmulTiles,
                       precision) -> tuple[tuple[int, int, int], dict]:
  """Grid and constexpr arguments of :func:`matmul_at_b_kernel`."""
  grid = (g, cdiv(k, tiles.block_m), cdiv(n, tiles.block_n))
  return grid, dict(R=r, K=k, N=n, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                    BLOCK_K=BLOCK_K, INPUT_PRECISION=input_precision(precision))
