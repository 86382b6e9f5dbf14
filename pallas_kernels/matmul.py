"""Batch-invariant GEMM kernels.

Numerics contract (what makes a row's bits independent of the batch): every
output element is the sum over the contraction dimension taken in steps of
``BLOCK_K`` = 64, in increasing order, each step's product added to one float32
accumulator that starts at zero; the result is rounded to the output dtype once,
at the end. A contraction that is not a multiple of ``BLOCK_K`` ends in a
partial step whose missing terms are zeros (masked loads here, TMA's
out-of-bounds fill or zero padding in the other kernels): the same values, so
the same bits. A GEMM may instead sum fixed chunks of the contraction, each so,
and add the chunk sums in order (:func:`contraction_loop`); the chunk never
depends on M (``matmul_plan.fixed_contraction_chunk`` follows the result's
columns), and whether the chunks run in one program or in programs of their
own (:func:`matmul_chunks`) does not change the sums. Tile shape (``block_m``,
``block_n``), warps and stages only decide which program computes an element,
never that order, so the plan (:mod:`pallas_kernels.matmul_plan`) may pick them
from M. A GPU tile may load several steps at once (``MatmulTiles.step_k``): its
dot over them is the k16 MMA chain of those steps in order, into the same
accumulator, so the same bits. No launcher here copies an operand: edge tiles
and the last contraction step are masked. The forward/dA launcher reads M from
an operand and runs a bucketed grid of row tiles (``_common.counted_call``), so
every M of a bucket runs one compiled kernel; dB's contraction is the token
count, so it compiles per count.

Kernels:
  * :func:`matmul_kernel` - ``C[g] = A[g] @ B[g]`` or ``A[g] @ B[g]ᵀ`` (forward, dA).
  * :func:`matmul_at_b_kernel` - ``C[g] = A[g]ᵀ @ D[g]``, reduced over rows in
    ``BLOCK_K`` steps (dB): appending rows whose D is zero adds exact zeros.
  * :func:`matmul_chunk_kernel` and :func:`chunk_total_kernel` - a chunked
    contraction (:func:`contraction_loop`) with its chunks on programs of their
    own, then their float32 sums added in order (:func:`matmul_chunks`).

:func:`pallas_kernels.matmul_plan.plan` decides which kernel (these, the
Mosaic GPU kernel of :mod:`pallas_kernels.hopper_matmul` or the jax-triton
kernels of :mod:`pallas_kernels.triton_matmul`) runs a GEMM; all keep this
contract.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (block_mask, bucketed_grid, cdiv, compiler_params,
                                    counted_call, dot_f32, launcher, load_block, store_block)

BLOCK_K = 64


class Layout(enum.Enum):
  """How a GEMM's operands are stored; the result is always [rows, cols]."""
  NN = "a @ b"        # lhs [rows, K], rhs [K, cols] (forward)
  NT = "a @ b.T"      # lhs [rows, K], rhs [cols, K] (dA = dC @ Bᵀ)
  TN = "a.T @ b"      # lhs [K, rows], rhs [K, cols] (dB = Aᵀ @ dC; K is the token count)

  def minor_dims(self, rows: int, cols: int, contraction: int) -> tuple[int, int]:
    """The lhs's and the rhs's minor (contiguous) dimensions."""
    return (rows if self is Layout.TN else contraction,
            contraction if self is Layout.NT else cols)


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
  """Output tile of one program and its Triton launch parameters.

  ``group_m`` tiles of a column of tiles run next to each other (L2 reuse of the
  B tile). ``one_wave_stages``, when set, replaces ``num_stages`` for a grid of
  at most one program per SM: each SM then runs a single program, and only
  loads in flight hide memory latency. ``step_k`` (a multiple of ``BLOCK_K``)
  is the contraction each pipeline stage loads: a ``step_k`` step's dot is the
  k16 MMA chain of its ``BLOCK_K`` steps, into the same accumulator, so on the
  GPU it has their bits (a partial last step still runs ``BLOCK_K`` at a time).
  Like the rest, these move work between programs and change when blocks are
  loaded, never the sums. Interpret mode keeps ``step_k = BLOCK_K``: XLA:CPU
  rounds a dot's sum its own way.
  """
  block_m: int
  block_n: int
  num_warps: int
  num_stages: int
  group_m: int = 8
  one_wave_stages: int | None = None
  step_k: int = BLOCK_K

  def __post_init__(self):
    if self.step_k % BLOCK_K:
      raise ValueError(f"step_k must be a multiple of BLOCK_K = {BLOCK_K}, got {self.step_k}")

  def stage_bytes(self, dtype) -> int:
    return (self.block_m + self.block_n) * self.step_k * jnp.dtype(dtype).itemsize

  def reserved_bytes(self, out_dtype) -> int:
    del out_dtype  # the result leaves straight from registers
    return 0

  @property
  def accumulator_registers(self) -> int:
    """Registers a thread holds for the float32 accumulator."""
    return self.block_m * self.block_n // (32 * self.num_warps)


# Forward / dA tiles on the GPU, largest first. Up to GPU_ONE_ROW_OF_TILES rows
# the plan keeps to the smallest block_m that holds every row (one row of
# tiles, so B streams from memory once); above, it considers them all. Among
# those it takes the least estimated time (``matmul_plan.triton_tiles``), and
# gives the tile ``one_wave_stages`` when its grid is a single wave. Only tile
# shape and launch parameters change with M and N; BLOCK_K and the K order
# never do. Every entry gave the same bits as every other; the sweeps that chose
# them are in notes/h100_notebook.md, "GEMM tile sweep" and "deeper pipelines
# for one-wave grids" (`benchmarks/tune_matmul.py`), and in
# benchmarks/results/h100.md, twenty-eighth session ("the GEMV": 16 x 128),
# twenty-ninth ("the Triton ladder's rule": 64 x 32, 16 x 16 and the rule) and
# thirty-sixth (64 x 16, after 16 x 64 of the same area so that ties above 64
# rows, where it loses, go to 16 x 64).
GPU_MATMUL_LADDER: tuple[MatmulTiles, ...] = (
    MatmulTiles(128, 256, 8, 3),                        # M >= 1024
    MatmulTiles(128, 128, 8, 3, one_wave_stages=5),     # M = 256 with wide results
    MatmulTiles(64, 128, 4, 4, one_wave_stages=8),      # M = 64-256
    MatmulTiles(64, 64, 4, 4, one_wave_stages=10),      # M = 17-128
    MatmulTiles(64, 32, 4, 6, one_wave_stages=10),      # M = 17-128, narrow results
    MatmulTiles(16, 128, 4, 4, one_wave_stages=6),      # M <= 16, results >= 10240 wide
    MatmulTiles(16, 64, 4, 5, one_wave_stages=10),      # M <= 16, wide results
    MatmulTiles(64, 16, 4, 10),                         # M = 17-64, narrow results
    MatmulTiles(16, 32, 4, 6, one_wave_stages=12),      # M <= 16, 4096-column results
    MatmulTiles(16, 16, 2, 10),                         # M <= 16, narrow results
)
H100_SM_COUNT = 132  # the tile rule's SM count where the device reports none
GPU_ONE_ROW_OF_TILES = 64  # up to this many rows, one row of tiles holds them all
# What a program costs beyond its operand rows, in the rule's unit (one operand
# row per BLOCK_K step). Fitted on the H100 ladder sweep (twenty-ninth session):
# values from 16 to 64 make the same picks on every measured shape but a 16-row
# GEMM 18944 wide, where from 48 up the rule takes two waves of 16 x 128 over
# three of 16 x 64 (5% faster).
GPU_PROGRAM_OVERHEAD = 64
# The ladder's smallest stages (a 64-deep stage of at most DEEP_STEP_STAGE_BYTES:
# 16 x 16 in 16 bits), in a one-wave grid over a contraction of at least
# DEEP_STEP_MIN_CONTRACTION, load deeper steps (``matmul_plan.triton_tiles``): such
# a program waits on its many small loads, not on bandwidth. DEEP_STEP_K-deep
# where the stages hold the whole contraction (NN: with DEEP_STEP_SPARE_STAGES
# to spare, as its rhs steps are 256 rows of 32 bytes where NT's are 16 of 512),
# else STREAMED_STEP_K-deep where every row of the operands and the result is a
# multiple of 16 bytes (vector loads). On the H100 (benchmarks/results/h100.md, thirty-eighth and
# thirty-ninth sections), with the same bits: 256-deep over K = 2048 11-24%
# faster than 64-deep (NT over 2240 too), NN over K = 2112-2560 (9-10 steps in 10
# stages) 7-37% slower than 128-deep, over K = 704-1536 3-19% slower than 64-deep;
# 128-deep over K = 2112-14336 faster than 64-deep at 31 of 35 shapes (up to 39%),
# 2-6% slower at three NT ones and 11% at a 4100 x 2050 weight whose rows are not
# 16-byte multiples; 16 x 32 and 16 x 64 tiles 4-18% slower at 256-deep at 13 of
# 14 shapes.
DEEP_STEP_K = 256
STREAMED_STEP_K = 128
DEEP_STEP_STAGE_BYTES = 4096
DEEP_STEP_MIN_CONTRACTION = 2048
DEEP_STEP_SPARE_STAGES = 2
# A loop of deep steps runs only where it takes at least MIN_DEEP_STEPS trips
# (contraction_loop): on an H200 (jax 0.11.2, Triton 3.6) a last chunk of one
# 128- or 256-deep step, a loop of one trip, summed to other bits than its 64-deep
# steps at 90-95% of the elements of five chunked GEMMs, where loops of two or
# more deep steps gave their bits (benchmarks/results/h100.md, forty-fifth
# section).
MIN_DEEP_STEPS = 2

# A chunked contraction (``contraction_loop``'s ``chunk``) holds two float32
# accumulators at the end of each chunk, the chunk's sum and the running total:
# the plan runs it only on tiles (of any kernel) whose accumulator takes at most
# this many registers a thread, so that both fit beside the addresses (the
# 128 x 256 tiles of the Triton ladder and of the Mosaic GPU kernel take 128).
# On the H100, admitting 96 (the Mosaic GPU kernel's 128 x 192 and wider
# transposed tiles) made chunked GEMMs of 8192 rows 1-3% faster than a limit of
# 80 at three of four weights, 1% slower at the fourth (benchmarks/results/
# h100.md, fortieth section).
CHUNK_ACCUMULATOR_REGISTERS = 96


def holds_two_accumulators(tiles) -> bool:
  """Whether ``tiles`` (any GEMM kernel's: ``MatmulTiles``,
  ``hopper_matmul.HopperTiles``) may run a chunked contraction in each program:
  its accumulator takes at most CHUNK_ACCUMULATOR_REGISTERS registers a thread."""
  return tiles.accumulator_registers <= CHUNK_ACCUMULATOR_REGISTERS

# The tiles of the split chunks' sum (chunk_total), whatever the GEMM's tiles:
# small, so that the few-row results the split serves spread it over many
# programs (one warp, 16 float32 partials a thread per chunk). The sum is
# elementwise, so its tiles never change the bits. On an H200 (benchmarks/
# results/h100.md, fifty-first section), over 8-85 chunks of 32 x 768 to
# 512 x 1536 results, these ran 1.4-2.4x as fast as 16 x 64 tiles, which ran
# 1.8-22x as fast as the 64 x 128 the Triton split used to pass (171 against 13
# us at 33 chunks of 32 x 768); stages made no difference to 16 x 64.
CHUNK_TOTAL_TILES = MatmulTiles(8, 64, 1, 3)

# Interpret mode (CPU): one tile for every shape. XLA:CPU may pick a different
# dot algorithm per block shape, so the CPU path never varies the tile.
INTERPRET_TILES = MatmulTiles(32, 32, 4, 1)


# Shared memory a Triton program may use on the H100 (232,448 bytes reported by
# the driver), less headroom for the compiler's own scratch.
GPU_SHARED_MEMORY_BYTES = 224 * 1024
# Programs that run on one SM at once share its shared memory (233,472 bytes on
# the H100 and the H200), of which the driver keeps GPU_PROGRAM_RESERVED_SHARED_BYTES
# for each program.
GPU_SM_SHARED_MEMORY_BYTES = 228 * 1024
GPU_PROGRAM_RESERVED_SHARED_BYTES = 1024
# A forward or dA grid of more programs than SMs gives each SM its share of them
# at stages they fit at together, if at least RESIDENT_MIN_STAGES stages remain
# (``matmul_plan.triton_tiles``); a grid just past what fits at the tile's own
# stages runs a tail of programs after the rest. On an H200 at 31 and 64 rows
# (benchmarks/results/h100.md, forty-ninth section): 296 programs of 64 x 128 at 3
# stages (three to an SM) ran 1.00-1.04x of cuBLAS where 4 stages (two to an SM)
# ran 0.78-0.85x; 448 of 64 x 64 at 3 stages 0.96-0.97x against 0.71-0.76x at 4;
# where three stages fit them all, two took 1-49% longer.
RESIDENT_MIN_STAGES = 3


def stages_that_fit(wanted: int, stage_bytes: int, reserved_bytes: int = 0,
                    programs_per_sm: int = 1) -> int:
  """The most pipeline stages, at most ``wanted``, whose ``stage_bytes`` each fit in
  GPU_SHARED_MEMORY_BYTES beside ``reserved_bytes``, and, for ``programs_per_sm``
  programs sharing an SM, in their share of GPU_SM_SHARED_MEMORY_BYTES: the one
  shared-memory rule of every kernel. Stages only change how far ahead blocks
  load, never the sums."""
  budget = min(GPU_SHARED_MEMORY_BYTES,
               GPU_SM_SHARED_MEMORY_BYTES // programs_per_sm - GPU_PROGRAM_RESERVED_SHARED_BYTES)
  return max(1, min(wanted, (budget - reserved_bytes) // stage_bytes))


def fit_stages(tiles, dtype, out_dtype, programs_per_sm: int = 1):
  """``tiles`` (any GEMM kernel's: ``MatmulTiles``, ``hopper_matmul.HopperTiles``)
  with ``num_stages`` lowered until the pipelined operand blocks of ``dtype``
  fit in shared memory beside the kernel's ``out_dtype`` buffers, for
  ``programs_per_sm`` programs on one SM at once.

  The bf16 Triton tiles fit as they are, float32 needs fewer stages for
  128 x 256; the Mosaic GPU kernel fits 4 stages of its largest tile.
  """
  return dataclasses.replace(tiles, num_stages=stages_that_fit(
      tiles.num_stages, tiles.stage_bytes(dtype), tiles.reserved_bytes(out_dtype),
      programs_per_sm))


def tile_coords(t, num_m: int, num_n: int, group_m: int):
  """Maps a flat program index to its (row tile, column tile), ``group_m`` rows at a time."""
  per_group = group_m * num_n
  first_m = (t // per_group) * group_m
  rows_in_group = jnp.minimum(num_m - first_m, group_m)
  return first_m + (t % per_group) % rows_in_group, (t % per_group) // rows_in_group


def contraction_loop(k: int, step, acc, *, chunk: int | None = None, depth: int = BLOCK_K):
  """Runs ``acc = step(ks, k_mask, acc)`` over a contraction of ``k`` in
  BLOCK_K steps in increasing order: ``ks`` slices the step, ``k_mask`` is None
  for the full steps and masks the indices past ``k`` in a last, partial one
  (its own loop of one trip, so that its start stays a traced value). With
  ``depth`` (a multiple of BLOCK_K, ``MatmulTiles.step_k``) the full steps run
  ``depth / BLOCK_K`` at a time while that many remain, then one at a time; a
  run of full steps that holds a single deep step runs it one step at a time
  (``MIN_DEEP_STEPS``).

  With ``chunk`` (a multiple of BLOCK_K), each run of ``chunk`` contraction
  indices is summed by the same steps into an accumulator of its own that
  starts at zero, and the chunk sums are added to ``acc`` in increasing order:
  the bits of a loop of GEMMs over the chunks whose float32 results are added
  one after another (``jdet.token_logprobs``' dhidden). A ``chunk`` that covers
  the whole contraction gives the unchunked bits (a sum that starts at +0 is
  never -0, and +0 + x is x)."""
  full_steps = k // BLOCK_K
  per_deep = depth // BLOCK_K

  def body(masked, kk, acc):
    start = pl.multiple_of(kk * BLOCK_K, BLOCK_K)
    return step(pl.ds(start, BLOCK_K), block_mask(start, BLOCK_K, k) if masked else None, acc)

  def deep_body(first, j, acc):
    start = pl.multiple_of((first + j * per_deep) * BLOCK_K, BLOCK_K)
    return step(pl.ds(start, depth), None, acc)

  def steps(first, count: int, acc, *, last: bool):
    """``count`` full steps from step ``first``, then with ``last`` the partial
    step, if any."""
    deep_steps = count // per_deep if per_deep > 1 else 0
    if deep_steps < MIN_DEEP_STEPS:
      deep_steps = 0
    if deep_steps:
      acc = lax.fori_loop(0, deep_steps, functools.partial(deep_body, first), acc)
    if count > deep_steps * per_deep:
      acc = lax.fori_loop(first + deep_steps * per_deep, first + count,
                          functools.partial(body, False), acc)
    if last and k % BLOCK_K:
      acc = lax.fori_loop(full_steps, full_steps + 1, functools.partial(body, True), acc)
    return acc

  if chunk is None or chunk >= k:
    return steps(0, full_steps, acc, last=True)
  if chunk % BLOCK_K:
    raise ValueError(f"chunk must be a multiple of BLOCK_K = {BLOCK_K}, got {chunk}")
  per_chunk = chunk // BLOCK_K
  full_chunks = k // chunk

  def add_chunk(c, total):
    return add_chunk_sum(total, steps(c * per_chunk, per_chunk, jnp.zeros_like(total),
                                      last=False))

  acc = lax.fori_loop(0, full_chunks, add_chunk, acc)
  if k % chunk:
    acc = add_chunk_sum(acc, steps(full_chunks * per_chunk, full_steps - full_chunks * per_chunk,
                                   jnp.zeros_like(acc), last=True))
  return acc


def add_chunk_sum(total, chunk_sum):
  """``total + chunk_sum`` for a chunk summed from zero, written
  ``total - (0 - chunk_sum)`` (how Triton negates): Triton's combiner rewrites
  ``x + dot(a, b, 0)`` as ``dot(a, b, x)``, which for a chunk of a single step
  would sum the step into the running total instead of from zero (other bits
  than the Mosaic GPU kernel's and the split chunks'), and it leaves a
  subtraction alone. The two are equal unless ``total`` is -0, which a running
  total that starts at +0 never is (x + y is -0 only when both are)."""
  return total - (0 - chunk_sum)


def _on_output_tile(tile, rows_ref, o_ref, *, row_tiles: int, n: int, group_m: int):
  """Runs ``tile(rows, cols)`` for grid axis 0's [block_m, block_n] output tile
  of ``o_ref``'s shape (:func:`tile_coords` over ``row_tiles``, the bucketed row
  tiles, of an ``n``-column result) if it holds rows below M (``rows_ref[0]``);
  ``rows``/``cols`` mask its rows past M and, where ``n`` is not a multiple of
  the tile, its columns past ``n`` (None where none can be)."""
  block_m, block_n = o_ref.shape
  m = rows_ref[0]
  i, j = tile_coords(pl.program_id(0), row_tiles, cdiv(n, block_n), group_m)

  @pl.when(i * block_m < m)
  def _():
    tile(block_mask(i * block_m, block_m, m),
         block_mask(j * block_n, block_n, n) if n % block_n else None)


def _tile_sum(a_ref, b_ref, rows, cols, *, k: int, transpose_b: bool, precision,
              chunk: int | None, step_k: int):
  """The float32 [block_m, block_n] sum of a tile over the first ``k`` indices of
  its blocks' contraction (:func:`contraction_loop`; ``rows``/``cols``: masks of
  the edge tile's valid rows and columns, or None)."""
  block_m, block_n = a_ref.shape[0], b_ref.shape[0 if transpose_b else 1]

  def step(ks, k_mask, acc):
    a = load_block(a_ref.at[:, ks], rows=rows, cols=k_mask)
    if transpose_b:
      b = load_block(b_ref.at[:, ks], rows=cols, cols=k_mask)
    else:
      b = load_block(b_ref.at[ks, :], rows=k_mask, cols=cols)
    return acc + dot_f32(a, b, trans_b=transpose_b, precision=precision)

  return contraction_loop(k, step, jnp.zeros((block_m, block_n), jnp.float32), chunk=chunk,
                          depth=step_k)


def matmul_kernel(rows_ref, a_ref, b_ref, o_ref, *, row_tiles: int, n: int, group_m: int,
                  transpose_b: bool, precision, contraction_chunk: int | None = None,
                  step_k: int = BLOCK_K):
  """One [block_m, block_n] tile of ``A @ B`` (or ``A @ Bᵀ``).

  rows_ref: [1] int32, M (an operand, so that the kernel is the same for every M
  of ``row_tiles``, the bucketed count of row tiles: tiles past M return at
  once); a_ref: [block_m, K]; b_ref: [K, block_n] ([block_n, K] if
  transpose_b); o_ref: [block_m, block_n]. Rows >= M (every tile masks them,
  whatever M) and columns >= n of the edge tiles and the contraction past K in
  the last step are masked (loaded as zeros). ``contraction_chunk``: the
  contraction in chunks; ``step_k``: the contraction each step loads
  (:func:`contraction_loop`).
  """
  def tile(rows, cols):
    acc = _tile_sum(a_ref, b_ref, rows, cols, k=a_ref.shape[-1], transpose_b=transpose_b,
                    precision=precision, chunk=contraction_chunk, step_k=step_k)
    store_block(o_ref, acc.astype(o_ref.dtype), rows=rows, cols=cols)

  _on_output_tile(tile, rows_ref, o_ref, row_tiles=row_tiles, n=n, group_m=group_m)


def matmul_chunk_kernel(rows_ref, a_ref, b_ref, o_ref, *, row_tiles: int, n: int, k: int,
                        group_m: int, transpose_b: bool, precision, step_k: int):
  """One chunk's float32 sum over one [block_m, block_n] tile: program (t, c)
  sums chunk c of the contraction from zero, as :func:`contraction_loop` sums
  each chunk (:func:`matmul_chunks`).

  a_ref: [block_m, chunk]; b_ref: [chunk, block_n] ([block_n, chunk] if
  transpose_b); o_ref: [block_m, block_n] of chunk c's partial sums. The last
  chunk of a contraction ``k`` that the chunk does not divide sums its first
  ``k % chunk`` indices (the rest of its blocks lies past the operands).
  """
  chunk = a_ref.shape[-1]
  c = pl.program_id(1)
  full_chunks, last = divmod(k, chunk)

  def tile(rows, cols):
    def chunk_sum(length):
      acc = _tile_sum(a_ref, b_ref, rows, cols, k=length, transpose_b=transpose_b,
                      precision=precision, chunk=None, step_k=step_k)
      store_block(o_ref, acc, rows=rows, cols=cols)

    if not last:
      chunk_sum(chunk)
      return
    pl.when(c < full_chunks)(lambda: chunk_sum(chunk))
    pl.when(c == full_chunks)(lambda: chunk_sum(last))

  _on_output_tile(tile, rows_ref, o_ref, row_tiles=row_tiles, n=n, group_m=group_m)


def chunk_total_kernel(rows_ref, partials_ref, o_ref, *, row_tiles: int, n: int,
                       group_m: int):
  """One [block_m, block_n] tile of the chunks' partial sums added in chunk order,
  the first chunk's plus the second's plus the third's and so on, rounded once to
  the result's dtype. partials_ref: the [chunks, block_m, block_n] partial blocks,
  loaded one chunk at a time in a loop, so that the registers hold one block
  however many chunks there are."""
  chunks = partials_ref.shape[0]

  def tile(rows, cols):
    def add_chunk(c, total):
      return total + load_block(partials_ref.at[c], rows=rows, cols=cols)

    # An array index: interpret mode's load takes no Python int for a ref view.
    first = load_block(partials_ref.at[jnp.int32(0)], rows=rows, cols=cols)
    total = lax.fori_loop(1, chunks, add_chunk, first)
    store_block(o_ref, total.astype(o_ref.dtype), rows=rows, cols=cols)

  _on_output_tile(tile, rows_ref, o_ref, row_tiles=row_tiles, n=n, group_m=group_m)


def matmul_at_b_kernel(a_ref, d_ref, o_ref, *, k: int, n: int, precision):
  """One [block_k, block_n] tile of ``Aᵀ @ D``, reduced over rows.

  a_ref: [R, block_k]; d_ref: [R, block_n]; o_ref: [block_k, block_n]. The
  rows past R in the last step are masked (zeros), like the edge columns.
  """
  block_k, block_n = o_ref.shape
  a_cols = block_mask(pl.program_id(1) * block_k, block_k, k) if k % block_k else None
  d_cols = block_mask(pl.program_id(2) * block_n, block_n, n) if n % block_n else None

  def step(rs, r_mask, acc):
    a = load_block(a_ref.at[rs, :], rows=r_mask, cols=a_cols)
    d = load_block(d_ref.at[rs, :], rows=r_mask, cols=d_cols)
    return acc + dot_f32(a, d, trans_a=True, precision=precision)

  acc = contraction_loop(a_ref.shape[0], step, jnp.zeros((block_k, block_n), jnp.float32))
  store_block(o_ref, acc.astype(o_ref.dtype), rows=a_cols, cols=d_cols)


@launcher
def matmul(a, b, *, transpose_b: bool, out_dtype, precision, tiles: MatmulTiles,
           interpret: bool, contraction_chunk: int | None = None):
  """Launches :func:`matmul_kernel` over a batch of problems.

  a: [G, M, K]; b: [Gb, K, N] (or [Gb, N, K] if transpose_b) with Gb in {1, G}
  (Gb = 1 shares b across the batch). Returns [G, M, N] in ``out_dtype``.
  ``contraction_chunk`` (a multiple of BLOCK_K, or None): sum K in chunks
  added in order (:func:`contraction_loop`). M is an operand and the row tiles
  a :func:`~pallas_kernels._common.bucketed_grid`, so every M whose tiles share
  a bucket runs the same compiled kernel (a rollout's new batch sizes).
  """
  g, m, k = a.shape
  n = b.shape[1] if transpose_b else b.shape[2]
  shared_b = b.shape[0] == 1
  bm, bn = tiles.block_m, tiles.block_n
  row_tiles, num_n = bucketed_grid(cdiv(m, bm)), cdiv(n, bn)
  coords = functools.partial(tile_coords, num_m=row_tiles, num_n=num_n, group_m=tiles.group_m)
  # Grid axis 0 (the fastest-launched) walks the tiles; axis 1, if any, the groups.
  # One group runs on [M, K] views: the group axis's stride would be M K, a
  # constant that makes every M a kernel of its own.
  grouped = g > 1

  def a_index(t, *gi):
    return *gi, coords(t)[0], 0

  def b_index(t, *gi):
    j = coords(t)[1]
    group = (0,) if grouped and shared_b else gi
    return (*group, j, 0) if transpose_b else (*group, 0, j)

  def o_index(t, *gi):
    return *gi, *coords(t)

  group_block = (None,) if grouped else ()
  b_block = (*group_block, bn, k) if transpose_b else (*group_block, k, bn)
  kernel = functools.partial(matmul_kernel, row_tiles=row_tiles, n=n, group_m=tiles.group_m,
                             transpose_b=transpose_b, precision=precision,
                             contraction_chunk=contraction_chunk, step_k=tiles.step_k)
  out = counted_call(
      kernel,
      count=m,
      grid=(row_tiles * num_n, g) if grouped else (row_tiles * num_n,),
      in_specs=[pl.BlockSpec((*group_block, bm, k), a_index), pl.BlockSpec(b_block, b_index)],
      out_specs=pl.BlockSpec((*group_block, bm, bn), o_index),
      out_shape=jax.ShapeDtypeStruct((g, m, n) if grouped else (m, n), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name="jdet_matmul_t" if transpose_b else "jdet_matmul",
  )(*((a, b) if grouped else (a[0], b[0])))
  return out if grouped else out[None]


@launcher
def matmul_chunks(a, b, *, transpose_b: bool, out_dtype, precision, tiles: MatmulTiles,
                  interpret: bool, contraction_chunk: int):
  """:func:`matmul` of one problem with the contraction in chunks of
  ``contraction_chunk`` spread over programs: program (t, c) of
  :func:`matmul_chunk_kernel` sums chunk c of tile t into a float32 partial, and
  :func:`chunk_total_kernel` adds the partials in chunk order, so the bits are
  those of :func:`matmul` with the same ``contraction_chunk`` (each chunk from
  zero, the sums added in order). For GEMMs with too few output tiles to fill
  the SMs: the chunks multiply the programs.

  a: [1, M, K]; b: [1, K, N] (or [1, N, K] if transpose_b). Returns [1, M, N].
  """
  _, m, k = a.shape
  n = b.shape[1] if transpose_b else b.shape[2]
  chunks = cdiv(k, contraction_chunk)
  bm, bn = tiles.block_m, tiles.block_n
  row_tiles, num_n = bucketed_grid(cdiv(m, bm)), cdiv(n, bn)
  coords = functools.partial(tile_coords, num_m=row_tiles, num_n=num_n, group_m=tiles.group_m)
  counted = dict(row_tiles=row_tiles, n=n, group_m=tiles.group_m)
  if transpose_b:
    b_spec = pl.BlockSpec((bn, contraction_chunk), lambda t, c: (coords(t)[1], c))
  else:
    b_spec = pl.BlockSpec((contraction_chunk, bn), lambda t, c: (c, coords(t)[1]))
  partials = counted_call(
      functools.partial(matmul_chunk_kernel, k=k, transpose_b=transpose_b,
                        precision=precision, step_k=tiles.step_k, **counted),
      count=m,
      grid=(row_tiles * num_n, chunks),
      in_specs=[pl.BlockSpec((bm, contraction_chunk), lambda t, c: (coords(t)[0], c)), b_spec],
      out_specs=pl.BlockSpec((None, bm, bn), lambda t, c: (c, *coords(t))),
      out_shape=jax.ShapeDtypeStruct((chunks, m, n), jnp.float32),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name="jdet_matmul_chunks_t" if transpose_b else "jdet_matmul_chunks",
  )(a[0], b[0])
  return chunk_total(partials, out_dtype=out_dtype, interpret=interpret)[None]


def chunk_total(partials, *, out_dtype, interpret: bool = False):
  """The [M, N] result of a chunked contraction's [chunks, M, N] float32 partial
  sums (chunk c's sum from zero in ``partials[c]``): :func:`chunk_total_kernel`
  on CHUNK_TOTAL_TILES' [block_m, block_n] output tiles adds them in chunk order
  and rounds once to ``out_dtype``. Used by :func:`matmul_chunks` and the Mosaic
  GPU kernel's split chunks (``pallas_kernels.hopper_matmul.matmul``)."""
  tiles = CHUNK_TOTAL_TILES
  chunks, m, n = partials.shape
  bm, bn = tiles.block_m, tiles.block_n
  row_tiles, num_n = bucketed_grid(cdiv(m, bm)), cdiv(n, bn)
  coords = functools.partial(tile_coords, num_m=row_tiles, num_n=num_n, group_m=tiles.group_m)
  return counted_call(
      functools.partial(chunk_total_kernel, row_tiles=row_tiles, n=n, group_m=tiles.group_m),
      count=m,
      grid=(row_tiles * num_n,),
      in_specs=[pl.BlockSpec((chunks, bm, bn), lambda t: (0, *coords(t)))],
      out_specs=pl.BlockSpec((bm, bn), coords),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name="jdet_matmul_chunk_total",
  )(partials)


@launcher
def matmul_at_b(a, d, *, out_dtype, precision, tiles: MatmulTiles, interpret: bool):
  """Launches :func:`matmul_at_b_kernel`: ``Aᵀ @ D`` per batch entry.

  a: [G, R, K]; d: [G, R, N]: the sum runs over R. Returns [G, K, N].
  """
  g, r, k = a.shape
  n = d.shape[2]
  bk, bn = tiles.block_m, tiles.block_n
  kernel = functools.partial(matmul_at_b_kernel, k=k, n=n, precision=precision)
  return pl.pallas_call(
      kernel,
      grid=(g, cdiv(k, bk), cdiv(n, bn)),
      in_specs=[pl.BlockSpec((None, r, bk), lambda gi, i, j: (gi, 0, i)),
                pl.BlockSpec((None, r, bn), lambda gi, i, j: (gi, 0, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda gi, i, j: (gi, i, j)),
      out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, tiles.num_stages),
      interpret=interpret,
      name="jdet_matmul_at_b",
  )(a, d)
