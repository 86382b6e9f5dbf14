"""The batch-invariant GEMM written in Triton (``triton.jit``), for jax-triton and PyTorch.

Same numerics contract as :mod:`pallas_kernels.matmul`: every output element is
the sum over the contraction dimension in ``BLOCK_K`` = 64 steps, in increasing
order, each step's float32 product added to one float32 accumulator that starts
at zero, rounded to the output dtype once at the end. The kernels below mirror
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
                  M: tl.constexpr, N: tl.constexpr, KP: tl.constexpr,
                  SHARED_B: tl.constexpr, TRANSPOSE_B: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
  """One [BLOCK_M, BLOCK_N] tile of ``C[g] = A[g] @ B[g]`` (``A[g] @ B[g]ᵀ`` if TRANSPOSE_B).

  Grid: (tiles, G). A: [G, M, KP]; B: [Gb, KP, N] ([Gb, N, KP] if TRANSPOSE_B),
  Gb = 1 when SHARED_B; C: [G, M, N]; all contiguous. KP is a multiple of BLOCK_K.
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
  a_ptrs = a_ptr + g * (M * KP) + rows[:, None] * KP + ks[None, :]
  if SHARED_B:
    b_base = b_ptr
  else:
    b_base = b_ptr + g * (N * KP)
  if TRANSPOSE_B:
    b_ptrs = b_base + cols[:, None] * KP + ks[None, :]
  else:
    b_ptrs = b_base + ks[:, None] * N + cols[None, :]
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  for _ in range(0, KP // BLOCK_K):
    if M % BLOCK_M == 0:
      a = tl.load(a_ptrs)
    else:
      a = tl.load(a_ptrs, mask=row_ok[:, None], other=0)
    if N % BLOCK_N == 0:
      b = tl.load(b_ptrs)
    elif TRANSPOSE_B:
      b = tl.load(b_ptrs, mask=col_ok[:, None], other=0)
    else:
      b = tl.load(b_ptrs, mask=col_ok[None, :], other=0)
    a = _dot_operand(a, INPUT_PRECISION)
    b = _dot_operand(b, INPUT_PRECISION)
    if TRANSPOSE_B:
      acc = acc + tl.dot(a, tl.trans(b), input_precision=INPUT_PRECISION)
    else:
      acc = acc + tl.dot(a, b, input_precision=INPUT_PRECISION)
    a_ptrs += BLOCK_K
    if TRANSPOSE_B:
      b_ptrs += BLOCK_K
    else:
      b_ptrs += BLOCK_K * N
  c_ptrs = c_ptr + g * (M * N) + rows[:, None] * N + cols[None, :]
  tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def matmul_at_b_kernel(a_ptr, d_ptr, c_ptr,
                       RP: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr):
  """One [BLOCK_M, BLOCK_N] tile of ``C[g] = A[g]ᵀ @ D[g]``, reduced over rows in BLOCK_K steps.

  Grid: (G, cdiv(K, BLOCK_M), cdiv(N, BLOCK_N)). A: [G, RP, K]; D: [G, RP, N];
  C: [G, K, N]; RP is a multiple of BLOCK_K (zero rows appended by the caller).
  """
  g = tl.program_id(0).to(tl.int64)
  a_cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
  d_cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
  rs = tl.arange(0, BLOCK_K)
  a_ok = a_cols < K
  d_ok = d_cols < N
  a_ptrs = a_ptr + g * (RP * K) + rs[:, None] * K + a_cols[None, :]
  d_ptrs = d_ptr + g * (RP * N) + rs[:, None] * N + d_cols[None, :]
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  for _ in range(0, RP // BLOCK_K):
    if K % BLOCK_M == 0:
      a = tl.load(a_ptrs)
    else:
      a = tl.load(a_ptrs, mask=a_ok[None, :], other=0)
    if N % BLOCK_N == 0:
      d = tl.load(d_ptrs)
    else:
      d = tl.load(d_ptrs, mask=d_ok[None, :], other=0)
    a = _dot_operand(a, INPUT_PRECISION)
    d = _dot_operand(d, INPUT_PRECISION)
    acc = acc + tl.dot(tl.trans(a), d, input_precision=INPUT_PRECISION)
    a_ptrs += BLOCK_K * K
    d_ptrs += BLOCK_K * N
  c_ptrs = c_ptr + g * (K * N) + a_cols[:, None] * N + d_cols[None, :]
  tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=a_ok[:, None] & d_ok[None, :])


def matmul_launch(g: int, m: int, n: int, kp: int, *, transpose_b: bool, shared_b: bool,
                  tiles: MatmulTiles, precision) -> tuple[tuple[int, int], dict]:
  """Grid and constexpr arguments of :func:`matmul_kernel` (JAX and PyTorch launch alike)."""
  if kp % BLOCK_K:
    raise ValueError(f"contraction size {kp} is not a multiple of {BLOCK_K}")
  grid = (cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n), g)
  return grid, dict(
      M=m, N=n, KP=kp, SHARED_B=shared_b, TRANSPOSE_B=transpose_b,
      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K,
      GROUP_M=tiles.group_m, INPUT_PRECISION=input_precision(precision))


def matmul_at_b_launch(g: int, rp: int, k: int, n: int, *, tiles: MatmulTiles,
                       precision) -> tuple[tuple[int, int, int], dict]:
  """Grid and constexpr arguments of :func:`matmul_at_b_kernel`."""
  if rp % BLOCK_K:
    raise ValueError(f"row count {rp} is not a multiple of {BLOCK_K}")
  grid = (g, cdiv(k, tiles.block_m), cdiv(n, tiles.block_n))
  return grid, dict(RP=rp, K=k, N=n, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                    BLOCK_K=BLOCK_K, INPUT_PRECISION=input_precision(precision))
