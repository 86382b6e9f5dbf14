"""Batch-invariant RMSNorm kernels, with a fused residual add.

Numerics contract (what makes a row's bits independent of the batch): a program
owns ``block_rows`` rows and walks each row in ``chunk``-wide column chunks in
increasing order. The sum of squares (forward) and the sum of
``(g * w) * xhat`` (backward) are accumulated elementwise into one
[block_rows, chunk] float32 array, chunk after chunk, and that array is reduced
along its columns once at the end. Rows never mix: a row's bits depend on its
own data, the weight and the tile, and the tile (:func:`rms_norm_tiles`) is a
function of H alone, never of the row count. Rows past M (always masked,
whatever M) and columns past H are read as 0 and not stored.

Per row, in float32: ``mean = sum(h²) / H``, ``rstd = rsqrt(mean + eps)``,
``y = (h * rstd) * w`` rounded to the input dtype, where ``h = x`` or, with a
residual, ``h = round(x + r)`` (added in float32, rounded to x's dtype, and
also returned). Backward: ``xhat = h * rstd`` (the forward's bits),
``c = sum((g * w) * xhat) / H``, ``dh = rstd * (g * w - xhat * c)`` (+ the
cotangent of the returned sum, in float32, rounded once).

The weight gradient ``dw = sum over rows of g * xhat`` is reduced over rows in a
fixed order: rows are cut into fixed chunks of ``chunk_rows`` (by absolute row
index), each chunk is walked in ``row_step``-row steps accumulated elementwise
into a [row_step, block_cols] float32 array and reduced over its rows once; a
second kernel adds the chunks' partial sums in chunk order. Missing rows read
as zero and add exact zeros, so appending rows whose cotangent is zero leaves
``dw`` bitwise unchanged.

Kernels:
  * :func:`rms_norm_forward_kernel` - y (and the sum h) and each row's rstd.
  * :func:`rms_norm_dx_kernel` - dh (= dx = dresidual).
  * :func:`rms_norm_dweight_partial_kernel` / :func:`rms_norm_dweight_sum_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import (block_mask, cdiv, compiler_params, load_block,
                                    store_block)


@dataclasses.dataclass(frozen=True)
class RmsNormTiles:
  """Rows per program, columns per chunk (a power of two) and Triton warps of the
  forward and dx kernels. A row of at most ``chunk`` columns is read once and kept
  in registers; a longer one is read twice (the second pass mostly from L2)."""
  block_rows: int
  chunk: int
  num_warps: int


@dataclasses.dataclass(frozen=True)
class DweightTiles:
  """Columns per program, rows per step, rows per chunk (a multiple of
  ``row_step``), Triton warps and pipeline stages (how many steps' loads are in
  flight; never the sums) of the weight-gradient kernels."""
  block_cols: int
  row_step: int
  chunk_rows: int
  num_warps: int
  num_stages: int


# GPU rule (not measured yet; written for the H100's memory-bound regime): a row
# of up to GPU_MAX_CHUNK columns sits in registers and is read once; a program
# covers about GPU_ROW_BLOCK_ELEMENTS elements (several rows when H is small, so
# small H still fills the GPU with few, full programs), with one warp per 512
# elements (16 a thread, two 16-byte bf16 loads), at most 16.
GPU_MAX_CHUNK = 16384
GPU_ROW_BLOCK_ELEMENTS = 4096
GPU_ELEMENTS_PER_WARP = 512
GPU_MAX_WARPS = 16
# dw: 128 columns x 64-row steps, 1024-row chunks, so even small H with many rows
# gives cdiv(H, 128) * cdiv(M, 1024) programs.
GPU_DWEIGHT_TILES = DweightTiles(block_cols=128, row_step=64, chunk_rows=1024, num_warps=4,
                                 num_stages=3)

# Interpret mode (CPU): small chunks and row blocks so that the CPU tests walk
# rows in several chunks and several row blocks with tiny shapes.
INTERPRET_MAX_CHUNK = 128
INTERPRET_BLOCK_ROWS = 8
INTERPRET_DWEIGHT_TILES = DweightTiles(block_cols=32, row_step=8, chunk_rows=16, num_warps=4,
                                       num_stages=1)


def rms_norm_tiles(h: int, *, interpret: bool) -> RmsNormTiles:
  """Forward/dx tiles for rows of ``h`` features; a function of ``h`` only."""
  width = pl.next_power_of_2(h)
  if interpret:
    return RmsNormTiles(INTERPRET_BLOCK_ROWS, min(width, INTERPRET_MAX_CHUNK), 4)
  chunk = min(width, GPU_MAX_CHUNK)
  block_rows = max(1, GPU_ROW_BLOCK_ELEMENTS // chunk)
  warps = min(GPU_MAX_WARPS, max(1, block_rows * chunk // GPU_ELEMENTS_PER_WARP))
  return RmsNormTiles(block_rows, chunk, warps)


def dweight_tiles(h: int, *, interpret: bool) -> DweightTiles:
  """Weight-gradient tiles for ``h`` features; a function of ``h`` only."""
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


def _row_mask(block_rows: int, m: int):
  """Which rows of the block exist. Always applied, even where M is a multiple of
  ``block_rows``: a kernel whose code changed with M could round differently
  (interpret mode showed it: XLA:CPU contracted multiply-adds differently in the
  masked and unmasked dx kernels)."""
  return block_mask(pl.program_id(0) * block_rows, block_rows, m)


def _chunks(rows, h: int, chunk: int):
  """(read, read_weight, write) for chunk k of a row block: float32 reads,
  zero outside the array; writes skip what lies outside."""

  def columns(k):
    start = k * chunk if isinstance(k, int) else pl.multiple_of(k * chunk, chunk)
    return pl.ds(start, chunk), block_mask(start, chunk, h) if h % chunk else None

  def read(ref, k):
    span, cols = columns(k)
    return load_block(ref.at[:, span], rows=rows, cols=cols).astype(jnp.float32)

  def read_weight(ref, k):
    span, cols = columns(k)
    return _load_vector(ref.at[span], cols)[None, :]

  def write(ref, k, value):
    span, cols = columns(k)
    store_block(ref.at[:, span], value.astype(ref.dtype), rows=rows, cols=cols)

  return read, read_weight, write


def _row_sums(terms, count: int, block_rows: int, chunk: int):
  """Sums ``terms(k)`` ([block_rows, chunk]) elementwise over k = 0..count-1 in
  order, then along the columns: one [block_rows] value per row."""
  if count == 1:
    acc = terms(0)
  else:
    acc = lax.fori_loop(0, count, lambda k, acc: acc + terms(k),
                        jnp.zeros((block_rows, chunk), jnp.float32))
  return jnp.sum(acc, axis=1)


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


def rms_norm_forward_kernel(*refs, h: int, m: int, eps: float, chunk: int,
                            has_residual: bool):
  """refs: x, weight, [residual,] then y, [sum,] rstd.

  x/residual/y/sum: [block_rows, chunks * chunk] blocks (x's dtype); weight:
  [chunks * chunk] (any float); rstd: [block_rows] float32.
  """
  if has_residual:
    x_ref, w_ref, r_ref, y_ref, s_ref, rstd_ref = refs
  else:
    x_ref, w_ref, y_ref, rstd_ref = refs
  block_rows = x_ref.shape[0]
  count = cdiv(h, chunk)
  rows = _row_mask(block_rows, m)
  read, read_weight, write = _chunks(rows, h, chunk)

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
    return x * x

  rstd = lax.rsqrt(_row_sums(squares, count, block_rows, chunk) / h + eps)
  _store_vector(rstd_ref, rstd, rows)
  _for_each_chunk(
      lambda k: write(y_ref, k, (chunk_input(k) * rstd[:, None]) * read_weight(w_ref, k)),
      count)


def rms_norm_dx_kernel(*refs, h: int, m: int, chunk: int, has_sum_cotangent: bool):
  """refs: h, weight, rstd, g, [g_sum,] then dh.

  h (the normalised input), g (cotangent of y), g_sum (cotangent of the
  returned sum), dh: [block_rows, chunks * chunk] blocks; weight:
  [chunks * chunk]; rstd: [block_rows] float32.
  """
  if has_sum_cotangent:
    x_ref, w_ref, rstd_ref, g_ref, gs_ref, dx_ref = refs
  else:
    x_ref, w_ref, rstd_ref, g_ref, dx_ref = refs
  block_rows = x_ref.shape[0]
  count = cdiv(h, chunk)
  rows = _row_mask(block_rows, m)
  read, read_weight, write = _chunks(rows, h, chunk)
  rstd = _load_vector(rstd_ref, rows)[:, None]
  chunk_terms = _resident(  # (xhat, g * w) of chunk k
      lambda k: (read(x_ref, k) * rstd, read(g_ref, k) * read_weight(w_ref, k)), count)

  def products(k):
    xhat, gw = chunk_terms(k)
    return gw * xhat

  c = (_row_sums(products, count, block_rows, chunk) / h)[:, None]

  def out(k):
    xhat, gw = chunk_terms(k)
    dx = rstd * (gw - xhat * c)
    if has_sum_cotangent:
      dx = dx + read(gs_ref, k)
    write(dx_ref, k, dx)

  _for_each_chunk(out, count)


def rms_norm_dweight_partial_kernel(x_ref, rstd_ref, g_ref, p_ref, *, h: int, m: int,
                                    row_step: int):
  """One chunk of rows' ``sum g * xhat`` over ``block_cols`` columns.

  x_ref, g_ref: [chunk_rows, block_cols]; rstd_ref: [chunk_rows] float32;
  p_ref: [block_cols] float32, the chunk's partial sum.
  """
  chunk_rows, block_cols = x_ref.shape
  first_row = pl.program_id(1) * chunk_rows
  cols = block_mask(pl.program_id(0) * block_cols, block_cols, h) if h % block_cols else None
  # Steps past the last row would add exact zeros; skip them.
  steps = jnp.minimum(chunk_rows // row_step, cdiv(m - first_row, row_step))

  def step(s, acc):
    start = pl.multiple_of(s * row_step, row_step)
    rows = block_mask(first_row + start, row_step, m)
    x = load_block(x_ref.at[pl.ds(start, row_step), :], rows=rows, cols=cols)
    g = load_block(g_ref.at[pl.ds(start, row_step), :], rows=rows, cols=cols)
    rstd = _load_vector(rstd_ref.at[pl.ds(start, row_step)], rows)[:, None]
    return acc + g.astype(jnp.float32) * (x.astype(jnp.float32) * rstd)

  acc = lax.fori_loop(0, steps, step, jnp.zeros((row_step, block_cols), jnp.float32))
  _store_vector(p_ref, jnp.sum(acc, axis=0), cols)


def rms_norm_dweight_sum_kernel(p_ref, dw_ref, *, h: int):
  """dw over ``block_cols`` columns: the chunks' partial sums added in chunk order.

  p_ref: [chunks, block_cols] float32; dw_ref: [block_cols] (weight's dtype).
  """
  count, block_cols = p_ref.shape
  cols = block_mask(pl.program_id(0) * block_cols, block_cols, h) if h % block_cols else None
  total = lax.fori_loop(0, count, lambda c, acc: acc + _load_vector(p_ref.at[c], cols),
                        jnp.zeros((block_cols,), jnp.float32))
  _store_vector(dw_ref, total, cols)


# ---------------------------------------------------------------------------
# Launchers: unpadded [M, H] rows and an [H] weight.


def _row_call(kernel, inputs, outputs, *, tiles: RmsNormTiles, interpret: bool, name: str):
  """Runs a row kernel over row blocks. ``inputs``/``outputs`` are (kind, array or
  ShapeDtypeStruct) pairs; kind "rows" ([M, H], a row block), "weight" ([H],
  whole) or "rstd" ([M], a row block)."""
  m, h = inputs[0][1].shape
  width = cdiv(h, tiles.chunk) * tiles.chunk
  br = tiles.block_rows
  specs = {"rows": pl.BlockSpec((br, width), lambda i: (i, 0)),
           "weight": pl.BlockSpec((width,), lambda i: (0,)),
           "rstd": pl.BlockSpec((br,), lambda i: (i,))}
  return pl.pallas_call(
      kernel,
      grid=(cdiv(m, br),),
      in_specs=[specs[kind] for kind, _ in inputs],
      out_specs=[specs[kind] for kind, _ in outputs],
      out_shape=[o for _, o in outputs],
      compiler_params=compiler_params(tiles.num_warps, 1),
      interpret=interpret,
      name=name,
  )(*(x for _, x in inputs))


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
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
  kernel = functools.partial(rms_norm_forward_kernel, h=h, m=m, eps=eps, chunk=tiles.chunk,
                             has_residual=has_residual)
  results = _row_call(kernel, inputs, outputs, tiles=tiles, interpret=interpret,
                      name="jdet_add_rms_norm" if has_residual else "jdet_rms_norm")
  return results[0], results[1] if has_residual else None, results[-1]


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def rms_norm_dx(x, weight, rstd, g, g_sum=None, *, tiles: RmsNormTiles, interpret: bool):
  """x: [M, H] the normalised input; weight: [H]; rstd: [M] float32; g, g_sum:
  [M, H] cotangents of y and of the returned sum (g_sum may be None).
  Returns dx [M, H] in x's dtype."""
  m, h = x.shape
  has_sum = g_sum is not None
  inputs = [("rows", x), ("weight", weight), ("rstd", rstd), ("rows", g)]
  inputs += [("rows", g_sum)] if has_sum else []
  kernel = functools.partial(rms_norm_dx_kernel, h=h, m=m, chunk=tiles.chunk,
                             has_sum_cotangent=has_sum)
  (dx,) = _row_call(kernel, inputs, [("rows", jax.ShapeDtypeStruct((m, h), x.dtype))],
                    tiles=tiles, interpret=interpret, name="jdet_rms_norm_dx")
  return dx


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiles", "interpret"))
def rms_norm_dweight(x, rstd, g, *, out_dtype, tiles: DweightTiles, interpret: bool):
  """x, g: [M, H]; rstd: [M] float32. Returns dw = sum over rows of g * (x * rstd),
  [H] in ``out_dtype``, reduced over rows in the fixed order of the module docstring."""
  m, h = x.shape
  bc, rc = tiles.block_cols, tiles.chunk_rows
  col_blocks, chunks = cdiv(h, bc), cdiv(m, rc)
  params = compiler_params(tiles.num_warps, tiles.num_stages)
  partials = pl.pallas_call(
      functools.partial(rms_norm_dweight_partial_kernel, h=h, m=m, row_step=tiles.row_step),
      grid=(col_blocks, chunks),
      in_specs=[pl.BlockSpec((rc, bc), lambda j, c: (c, j)),
                pl.BlockSpec((rc,), lambda j, c: (c,)),
                pl.BlockSpec((rc, bc), lambda j, c: (c, j))],
      out_specs=pl.BlockSpec((None, bc), lambda j, c: (c, j)),
      out_shape=jax.ShapeDtypeStruct((chunks, h), jnp.float32),
      compiler_params=params,
      interpret=interpret,
      name="jdet_rms_norm_dweight_partial",
  )(x, rstd, g)
  return pl.pallas_call(
      functools.partial(rms_norm_dweight_sum_kernel, h=h),
      grid=(col_blocks,),
      in_specs=[pl.BlockSpec((chunks, bc), lambda j: (0, j))],
      out_specs=pl.BlockSpec((bc,), lambda j: (j,)),
      out_shape=jax.ShapeDtypeStruct((h,), out_dtype),
      compiler_params=params,
      interpret=interpret,
      name="jdet_rms_norm_dweight",
  )(partials)
