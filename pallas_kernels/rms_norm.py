"""Batch-invariant RMSNorm kernels, with a fused residual add.

Numerics contract (what makes a row's bits independent of the batch): rows are
handled in blocks of ``block_rows`` and each row is walked in ``chunk``-wide
column chunks in increasing order. The sum of squares (forward) and the sum of
``(g * w) * xhat`` (backward) are accumulated elementwise into one
[block_rows, chunk] float32 array, chunk after chunk, and that array is reduced
along its columns once at the end by ``_common.row_sum`` (a pairwise tree where
H is not a multiple of 8: the unpadded rows' register layout follows their
alignment in the array, and the sum must not). Rows never mix: a row's bits
depend on its own data, the weight and the tile, and the tile
(:func:`rms_norm_tiles`) is a function of H alone, never of the row count. Rows
past M (always masked, whatever M) and columns past H are read as 0 and not
stored. The forward and dx kernels read M from an operand on a bucketed grid
(``_common.counted_rows_call``), the dweight sum the number of partials: one
compiled kernel serves every M of a bucket.

Per row, in float32: ``mean = sum(h²) / H``, ``rstd = rsqrt(mean + eps)``,
``y = (h * rstd) * w`` rounded to the input dtype, where ``h = x`` or, with a
residual, ``h = round(x + r)`` (added in float32, rounded to x's dtype, and
also returned). Backward: ``xhat = h * rstd`` (the forward's bits),
``c = sum((g * w) * xhat) / H``, ``dh = rstd * (g * w - xhat * c)`` (+ the
cotangent of the returned sum, in float32, rounded once).

The weight gradient ``dw = sum over rows of g * xhat`` is reduced over rows in a
fixed order, inside the dx kernel, which reads each row once: a dx program owns
a fixed chunk of ``chunk_rows`` rows (by absolute row index) and walks it in
row blocks in increasing order, adding each block's ``g * xhat`` elementwise
into [block_rows, chunk] float32 arrays (one per column chunk); at the end it
reduces them over their rows into the chunk's partial row. Only this partial
mixes rows; a row's dh is the same whichever chunk holds it. A second kernel
adds the partials in chunk order: partial p goes into slot ``p % row_step`` of a
[row_step, block_cols] float32 array, the slots reduced once at the end. Missing
rows and partials read as zero and add exact zeros, so appending rows whose
cotangent is zero leaves ``dw`` bitwise unchanged.

Kernels:
  * :func:`rms_norm_forward_kernel` - y (and the sum h) and each row's rstd.
  * :func:`rms_norm_dx_kernel` - dh (= dx = dresidual) and the chunk's dw partial.
  * :func:`rms_norm_dweight_sum_kernel` - dw from the partials.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import (block_mask, bucketed_grid, cdiv, compiler_params,
                                    counted_call, counted_rows_call, launcher, load_block,
                                    pairwise_sums_for, product, row_sum, store_block)


@dataclasses.dataclass(frozen=True)
class RmsNormTiles:
  """Rows per row block, columns per chunk (a power of two) and Triton warps of the
  forward and dx kernels, and rows per dx program (``chunk_rows``, a multiple of
  ``block_rows``: the chunk whose dweight partial one program sums). A row of at
  most ``chunk`` columns is read once and kept in registers; a longer one is read
  twice (the second pass mostly from L2)."""
  block_rows: int
  chunk: int
  num_warps: int
  chunk_rows: int


@dataclasses.dataclass(frozen=True)
class DweightTiles:
  """Columns per program, partials per step (a power of two), Triton warps and
  pipeline stages (how many steps' loads are in flight; never the sums) of the
  kernel adding the dweight partials."""
  block_cols: int
  row_step: int
  num_warps: int
  num_stages: int


# GPU rule (written for the H100's memory-bound regime): a row of up to
# GPU_MAX_CHUNK columns sits in registers and is read once; a program covers
# about GPU_ROW_BLOCK_ELEMENTS elements (several rows when H is small, so small H
# still fills the GPU with few, full programs), with one warp per 512 elements
# (16 a thread, two 16-byte bf16 loads), at most 16. The H100 measured a resident
# 16384-column row (16 warps, 32 values a thread: one program per SM by
# registers) at 0.74x of XLA's forward while 8192 columns ran at 1.0x: longer
# rows go in 8192-column chunks, 16 values a thread, read twice.
GPU_MAX_CHUNK = 8192
GPU_ROW_BLOCK_ELEMENTS = 4096
GPU_ELEMENTS_PER_WARP = 512
GPU_MAX_WARPS = 16
# A dx program walks 8 row blocks: 8 rows at H >= 4096, so M = 256 still runs 32
# programs, and the partials (one float32 row per 8 rows) cost 1/6 of dx's bf16
# traffic, written once and read once.
GPU_DX_STEPS = 8
# The partial sum: 64 columns x 128-partial steps, so M = 8192 at H = 8192 (1024
# partials) is 128 programs of 8 steps.
GPU_DWEIGHT_TILES = DweightTiles(block_cols=64, row_step=128, num_warps=8, num_stages=3)

# Interpret mode (CPU): small chunks and row blocks so that the CPU tests walk
# rows in several chunks, row blocks and partial steps with tiny shapes.
INTERPRET_MAX_CHUNK = 128
INTERPRET_BLOCK_ROWS = 8
INTERPRET_DX_STEPS = 2
INTERPRET_DWEIGHT_TILES = DweightTiles(block_cols=32, row_step=2, num_warps=4, num_stages=1)


def rms_norm_tiles(h: int, *, interpret: bool) -> RmsNormTiles:
  """Forward/dx tiles for rows of ``h`` features; a function of ``h`` only."""
  width = pl.next_power_of_2(h)
  if interpret:
    return RmsNormTiles(INTERPRET_BLOCK_ROWS, min(width, INTERPRET_MAX_CHUNK), 4,
                        INTERPRET_DX_STEPS * INTERPRET_BLOCK_ROWS)
  chunk = min(width, GPU_MAX_CHUNK)
  block_rows = max(1, GPU_ROW_BLOCK_ELEMENTS // chunk)
  warps = min(GPU_MAX_WARPS, max(1, block_rows * chunk // GPU_ELEMENTS_PER_WARP))
  return RmsNormTiles(block_rows, chunk, warps, GPU_DX_STEPS * block_rows)


def dweight_tiles(h: int, *, interpret: bool) -> DweightTiles:
  """Tiles of the partials' sum for ``h`` features; a function of ``h`` only."""
  tiles = INTERPRET_DWEIGHT_TILES if interpret else GPU_DWEIGHT_TILES
  return dataclasses.replace(tiles, block_cols=min(tiles.block_cols, pl.next_power_of_2(h)))


# ---------------------------------------------------------------------------
# Row kernels. Refs are [block_rows, chunks * chunk] blocks of [M, H] arrays,
# the weight a [chunks * chunk] block of [H], rstd a [block_rows] block of [M].


def _load_vector(ref, mask=None):
  """A 1-D block in float32, zero where ``mask`` (or None: everywhere valid) is False."""
  value = ref[...] if mask is None else pltriton.load(ref, mask=mask, other=0)
  return value.astype(jnp.float32)


def _store_vector(ref, value, mask=None):
  if mask is None:
    ref[...] = value.astype(ref.dtype)
  else:
    pltriton.store(ref, value.astype(ref.dtype), mask=mask)


def _chunks(rows, h: int, chunk: int, row_span=slice(None)):
  """(read, write, read_vector, write_vector) for chunk k of the rows ``row_span``
  of a block, or of a 1-D block: float32 reads, zero outside the array; writes
  skip what lies outside."""

  def columns(k):
    start = k * chunk if isinstance(k, int) else pl.multiple_of(k * chunk, chunk)
    return pl.ds(start, chunk), block_mask(start, chunk, h) if h % chunk else None

  def read(ref, k):
    span, cols = columns(k)
    return load_block(ref.at[row_span, span], rows=rows, cols=cols).astype(jnp.float32)

  def write(ref, k, value):
    span, cols = columns(k)
    store_block(ref.at[row_span, span], value.astype(ref.dtype), rows=rows, cols=cols)

  def read_vector(ref, k):
    span, cols = columns(k)
    return _load_vector(ref.at[span], cols)

  def write_vector(ref, k, value):
    span, cols = columns(k)
    _store_vector(ref.at[span], value, cols)

  return read, write, read_vector, write_vector


def _row_sums(terms, count: int, block_rows: int, chunk: int, *, h: int, native: bool):
  """Sums ``terms(k)`` ([block_rows, chunk]) elementwise over k = 0..count-1 in
  order, then along the columns (``_common.row_sum`` for rows of ``h``): one
  [block_rows] value per row."""
  if count == 1:
    acc = terms(0)
  else:
    acc = lax.fori_loop(0, count, lambda k, acc: acc + terms(k),
                        jnp.zeros((block_rows, chunk), jnp.float32))
  return row_sum(acc, pairwise=pairwise_sums_for(h), native=native)[:, 0]


def _for_each_chunk(body, count: int):
  if count == 1:
    body(0)
  else:
    @pl.loop(0, count)
    def _(k):
      body(k)


def _resident(load, count: int):
  """``load`` itself for a multi-chunk row (each pass reads again); for a
  one-chunk row, the chunk loaded once and kept in registers."""
  if count > 1:
    return load
  value = load(0)
  return lambda k: value


def rms_norm_forward_kernel(*refs, valid, h: int, eps: float, chunk: int,
                            has_residual: bool, native: bool):
  """refs: x, weight, [residual,] then y, [sum,] rstd.

  x/residual/y/sum: [block_rows, chunks * chunk] blocks (x's dtype); weight:
  [chunks * chunk] (any float); rstd: [block_rows] float32; ``valid``: the block's
  row mask. ``native``: the GPU (products that sums consume are rounded on their
  own in interpret mode, :func:`pallas_kernels._common.product`).
  """
  if has_residual:
    x_ref, w_ref, r_ref, y_ref, s_ref, rstd_ref = refs
  else:
    x_ref, w_ref, y_ref, rstd_ref = refs
  block_rows = x_ref.shape[0]
  count = cdiv(h, chunk)
  read, write, read_vector, _ = _chunks(valid, h, chunk)

  def load_input(k):  # x, or x + r rounded to x's dtype
    x = read(x_ref, k)
    if has_residual:
      x = (x + read(r_ref, k)).astype(x_ref.dtype).astype(jnp.float32)
    return x

  chunk_input = _resident(load_input, count)

  def squares(k):
    x = chunk_input(k)
    if has_residual:
      write(s_ref, k, x)
    return product(x, x, native=native)

  rstd = lax.rsqrt(_row_sums(squares, count, block_rows, chunk, h=h, native=native) / h + eps)
  _store_vector(rstd_ref, rstd, valid)
  _for_each_chunk(
      lambda k: write(y_ref, k, (chunk_input(k) * rstd[:, None]) * read_vector(w_ref, k)[None, :]),
      count)


def rms_norm_dx_kernel(*refs, valid, h: int, block_rows: int, chunk: int,
                       has_sum_cotangent: bool, native: bool):
  """One chunk of rows: dh, row block by row block, and the chunk's dw partial.

  refs: h, weight, rstd, g, [g_sum,] then dh, partial. h (the normalised
  input), g (cotangent of y), g_sum (cotangent of the returned sum), dh:
  [chunk_rows, chunks * chunk] blocks; weight: [chunks * chunk]; rstd:
  [chunk_rows] float32; partial: [chunks * chunk] float32, the sum over the
  chunk's rows of ``g * xhat``; ``valid``: the chunk's [chunk_rows] row mask.
  ``native`` as in :func:`rms_norm_forward_kernel`.
  """
  if has_sum_cotangent:
    x_ref, w_ref, rstd_ref, g_ref, gs_ref, dx_ref, p_ref = refs
  else:
    x_ref, w_ref, rstd_ref, g_ref, dx_ref, p_ref = refs
  chunk_rows = x_ref.shape[0]
  count = cdiv(h, chunk)
  rows_here = jnp.sum(valid.astype(jnp.int32))  # the chunk's rows before the count

  def step(s, sums):  # sums: per column chunk, [block_rows, chunk] sums of g * xhat
    start = pl.multiple_of(s * block_rows, block_rows)
    rows = block_mask(start, block_rows, rows_here)
    read, write, read_vector, _ = _chunks(rows, h, chunk, pl.ds(start, block_rows))
    rstd = _load_vector(rstd_ref.at[pl.ds(start, block_rows)], rows)[:, None]

    def load_terms(k):  # (xhat, g, g * w) of chunk k
      g = read(g_ref, k)
      return read(x_ref, k) * rstd, g, product(g, read_vector(w_ref, k)[None, :], native=native)

    chunk_terms = _resident(load_terms, count)

    def products(k):
      xhat, _, gw = chunk_terms(k)
      return product(gw, xhat, native=native)

    c = (_row_sums(products, count, block_rows, chunk, h=h, native=native) / h)[:, None]
    updated = []
    for k in range(count):  # unrolled: sums[k] needs a static k
      xhat, g, gw = chunk_terms(k)
      dx = product(rstd, gw - product(xhat, c, native=native), native=native)
      if has_sum_cotangent:
        dx = dx + read(gs_ref, k)
      write(dx_ref, k, dx)
      updated.append(sums[k] + product(g, xhat, native=native))
    return tuple(updated)

  # Every program walks all its row blocks, even past the last row (they add exact
  # zeros): with a trip count that depended on M, XLA:CPU compiled the loop
  # differently (one trip is inlined) and rounded the partial differently.
  sums = lax.fori_loop(0, chunk_rows // block_rows, step,
                       (jnp.zeros((block_rows, chunk), jnp.float32),) * count)
  write_vector = _chunks(None, h, chunk)[3]
  for k, total in enumerate(sums):
    write_vector(p_ref, k, jnp.sum(total, axis=0))


def rms_norm_dweight_sum_kernel(count_ref, p_ref, dw_ref, *, h: int, row_step: int):
  """dw over ``block_cols`` columns from the chunks' partials: partial p added
  into slot ``p % row_step`` in chunk order, the slots added at the end.

  count_ref: [1] int32, the number of partials (an operand, as the row count is
  for the dx kernel); p_ref: [a multiple of row_step, block_cols] float32 (rows
  past the count are not read: they add exact zeros); dw_ref: [block_cols]
  (weight's dtype).
  """
  block_cols = p_ref.shape[1]
  cols = block_mask(pl.program_id(0) * block_cols, block_cols, h) if h % block_cols else None

  def step(s, acc):
    start = pl.multiple_of(s * row_step, row_step)
    rows = block_mask(start, row_step, count_ref[0])
    return acc + load_block(p_ref.at[pl.ds(start, row_step), :], rows=rows, cols=cols)

  acc = lax.fori_loop(0, p_ref.shape[0] // row_step, step,
                      jnp.zeros((row_step, block_cols), jnp.float32))
  _store_vector(dw_ref, jnp.sum(acc, axis=0), cols)


# ---------------------------------------------------------------------------
# Launchers: unpadded [M, H] rows and an [H] weight.


def _row_call(kernel, inputs, outputs, *, tiles: RmsNormTiles, rows: int, interpret: bool,
              name: str):
  """Runs a row kernel with one program per ``rows`` rows, the row count an operand
  (the kernel gets ``valid``: :func:`counted_rows_call`). ``inputs``/``outputs``
  are (kind, array or ShapeDtypeStruct) pairs; kind "rows" ([M, H], a row block),
  "weight" ([H], whole), "rstd" ([M], a row block) or "partial" ([programs, H],
  the program's row)."""
  m, h = inputs[0][1].shape
  width = cdiv(h, tiles.chunk) * tiles.chunk
  specs = {"rows": pl.BlockSpec((rows, width), lambda i: (i, 0)),
           "weight": pl.BlockSpec((width,), lambda i: (0,)),
           "rstd": pl.BlockSpec((rows,), lambda i: (i,)),
           "partial": pl.BlockSpec((None, width), lambda i: (i, 0))}
  return counted_rows_call(
      kernel, rows=m, block_rows=rows, in_specs=[specs[kind] for kind, _ in inputs],
      out_specs=[specs[kind] for kind, _ in outputs], out_shape=[o for _, o in outputs],
      compiler_params=compiler_params(tiles.num_warps, 1), interpret=interpret, name=name,
  )(*(x for _, x in inputs))


@launcher
def rms_norm_forward(x, weight, residual=None, *, eps: float, tiles: RmsNormTiles,
                     interpret: bool):
  """x, residual: [M, H] (one float dtype); weight: [H] (any float).

  Returns (y, sum, rstd): y [M, H] in x's dtype; sum = round(x + residual) [M, H]
  (None without a residual); rstd [M] float32.
  """
  m, h = x.shape
  has_residual = residual is not None
  inputs = [("rows", x), ("weight", weight)] + ([("rows", residual)] if has_residual else [])
  row = ("rows", jax.ShapeDtypeStruct((m, h), x.dtype))
  outputs = [row] * (2 if has_residual else 1) + [("rstd", jax.ShapeDtypeStruct((m,),
                                                                                jnp.float32))]
  kernel = functools.partial(rms_norm_forward_kernel, h=h, eps=eps, chunk=tiles.chunk,
                             has_residual=has_residual, native=not interpret)
  results = _row_call(kernel, inputs, outputs, tiles=tiles, rows=tiles.block_rows,
                      interpret=interpret,
                      name="jdet_add_rms_norm" if has_residual else "jdet_rms_norm")
  return results[0], results[1] if has_residual else None, results[-1]


@launcher
def rms_norm_backward(x, weight, rstd, g, g_sum=None, *, tiles: RmsNormTiles,
                      sum_tiles: DweightTiles, interpret: bool):
  """x: [M, H] the normalised input; weight: [H]; rstd: [M] float32; g, g_sum:
  [M, H] cotangents of y and of the returned sum (g_sum may be None).

  Returns (dx, dw): dx [M, H] in x's dtype; dw = sum over rows of g * (x * rstd),
  [H] in weight's dtype, reduced over rows in the fixed order of the module
  docstring.
  """
  m, h = x.shape
  has_sum = g_sum is not None
  chunks = cdiv(m, tiles.chunk_rows)
  bc, step = sum_tiles.block_cols, sum_tiles.row_step
  # One partial row per program of the dx kernel's bucketed grid, rounded up to
  # row_step: the rows past ``chunks`` are never written nor read.
  partial_rows = cdiv(bucketed_grid(chunks), step) * step
  inputs = [("rows", x), ("weight", weight), ("rstd", rstd), ("rows", g)]
  inputs += [("rows", g_sum)] if has_sum else []
  outputs = [("rows", jax.ShapeDtypeStruct((m, h), x.dtype)),
             ("partial", jax.ShapeDtypeStruct((partial_rows, h), jnp.float32))]
  kernel = functools.partial(rms_norm_dx_kernel, h=h, block_rows=tiles.block_rows,
                             chunk=tiles.chunk, has_sum_cotangent=has_sum,
                             native=not interpret)
  dx, partials = _row_call(kernel, inputs, outputs, tiles=tiles, rows=tiles.chunk_rows,
                           interpret=interpret, name="jdet_rms_norm_dx")
  dw = counted_call(
      functools.partial(rms_norm_dweight_sum_kernel, h=h, row_step=step),
      count=chunks,
      grid=(cdiv(h, bc),),
      in_specs=[pl.BlockSpec((partial_rows, bc), lambda j: (0, j))],
      out_specs=pl.BlockSpec((bc,), lambda j: (j,)),
      out_shape=jax.ShapeDtypeStruct((h,), weight.dtype),
      compiler_params=compiler_params(sum_tiles.num_warps, sum_tiles.num_stages),
      interpret=interpret,
      name="jdet_rms_norm_dweight",
  )(partials)
  return dx, dw
