"""The batch-invariant GEMM on Hopper tensor cores through Mosaic GPU (TMA + wgmma).

Same numerics contract as :mod:`pallas_kernels.matmul`: each output element is
the sum over the contraction in ``BLOCK_K`` = 64 steps, in increasing order,
each step's product added to one float32 accumulator that starts at zero,
rounded to the output dtype once (or, with ``contraction_chunk``, each chunk of
steps so and the chunk sums added in order). A step is four k16 ``wgmma`` instructions
chained into that accumulator, which is what the Triton lowering of the Pallas
kernels emits on the H100 too, so the two give the same bits and
:func:`pallas_kernels.matmul_plan.plan` may send any row count to either
(``tests/test_matmul.py`` checks it on the GPU across every boundary).

One program per SM walks the output tiles (a persistent grid; with split
chunks, each chunk of each tile, into float32 partials that
``pallas_kernels.matmul.chunk_total`` adds in order). Each program
has a TMA producer warpgroup and two consumer warpgroups, each owning half of a
``block_m x 2 block_n`` tile (one, owning all of it, in the stream tiles:
:func:`stream_tiles`). The producer streams the contraction steps of all
the program's tiles through one ring of shared-memory stages, so it runs on
into the next tile's loads while the consumers store the last one. With enough
stages (``IN_FLIGHT_MIN_STAGES``) a consumer issues a step's wgmma before the
last step's has finished, and frees that step's stage once it has. The last row
and column of tiles are shifted back to end at the result's edge, overlapping
their neighbours (whose rows and columns they recompute to the same bits and
store again), so no tile reads zero-filled rows past an operand: at K = 13824
those made a 304-row GEMM 45% slower than a 384-row one with the same tiles. A
partial last contraction step needs no masking: TMA loads outside the operand
read zeros. No operand is padded or copied: a block whose array Mosaic GPU
cannot tile (a weight whose columns 64 does not divide, a token count that 8
does not divide) moves one 128-byte column tile at a time through an untiled
view of its shared memory, which takes any 16-byte row pitch
(:func:`_block_ring`, :func:`takes`). Where the rhs's rows do not start on
128-byte lines, the plan may run the programs in clusters of two that share each
rhs block by TMA multicast (``HopperTiles.multicast``), and where the lhs's rows
miss them too, in clusters of 2 x 2 that share the lhs blocks as well
(``HopperTiles.multicast_lhs``). The forward and dA
may run transposed tiles (``HopperTiles.transposed``), whose row count is
wgmma's N and so any multiple of 8; a transposed tile taller than the result
loads and stores only the result's rows (the plan runs only stream tiles so).
Only 16-bit operands (bfloat16, float16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, mosaic_gpu
from pallas_kernels.matmul import (BLOCK_K, CHUNK_ACCUMULATOR_REGISTERS, H100_SM_COUNT, Layout,
                                   chunk_total, fit_stages, holds_two_accumulators)

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
EPILOGUE_TILE = 64  # the output leaves in TMA stores of 64 rows
CLUSTER = "cluster"  # the cluster axis of a multicast tile's row pairs
CLUSTER_COLS = "cluster_cols"  # and of a multicast_lhs tile's column pairs


@dataclasses.dataclass(frozen=True)
class HopperTiles:
  """A program's output tile is ``block_m x 2 block_n``, one half per consumer
  warpgroup: ``block_m x block_n`` side by side, or with ``split_rows`` (for
  ``block_m`` = 128) ``block_m / 2 x 2 block_n`` one above the other, sharing
  the rhs block. ``num_stages`` TMA loads run ahead. Programs take the tiles in
  strips ``strip_width`` tiles wide across ``strip_dim`` (0: rows of tiles, 1:
  columns), the index across the strip changing fastest, every other strip
  walked backwards (L2 reuse). With ``multicast`` the programs run in
  clusters of two CTAs that take two neighbouring row blocks and receive each
  rhs block by one TMA multicast, so each SM reads half of it; an odd last row
  block is computed by both CTAs. With ``multicast_lhs`` the clusters also pair
  neighbouring column blocks, which share each lhs block the same way (with
  ``multicast``, clusters of 2 x 2 CTAs). None of it changes the sums. ``throughput``
  is the tile's measured throughput per SM relative to 128 x 128 with both
  operands' rows on 128-byte lines; :meth:`rate` is the one the tile rule
  (``matmul_plan.mosaic_row_tiles``) weighs.

  With ``transposed`` (forward and dA, 16-bit results) a program computes its
  tile transposed: the rhs's ``block_cols`` columns on wgmma's M side,
  ``block_n`` (a multiple of 64) per consumer warpgroup, and ``block_m`` result
  rows on its N side, which takes any multiple of 8 up to 256. The row tile can
  then follow the row count: 777 rows of a 4096-column result in 8 x 16 tiles of
  104 x 256, 128 programs on 132 SMs, rather than 7 x 16 of 128 x 256 with 119
  rows empty and 20 SMs idle. The epilogue transposes each piece back. The products
  are the same wgmma chains with the operands' roles swapped, so the sums and
  their bits are those of the plain tiles.

  ``consumers``: the consumer warpgroups, 2, or 1 in a transposed tile of
  ``block_n`` columns, a stream tile (:attr:`streams`, :func:`stream_tiles`)."""
  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4
  strip_dim: int = 0
  strip_width: int = 8
  split_rows: bool = False
  throughput: float = 1.0
  multicast: bool = False
  transposed: bool = False
  multicast_lhs: bool = False
  consumers: int = 2

  def __post_init__(self):
    if self.consumers not in (1, 2) or (self.consumers == 1 and not self.transposed):
      raise ValueError(f"consumers must be 2, or 1 in a transposed tile (a stream tile); "
                       f"got {self}")
    if self.split_rows and self.block_m != 128:
      raise ValueError(f"split_rows needs block_m = 128 (a wgmma takes 64 rows per "
                       f"warpgroup), got block_m = {self.block_m}")
    if self.transposed and (self.block_m % 8 or not 8 <= self.block_m <= 256
                            or self.block_n % 64 or self.split_rows):
      raise ValueError(f"transposed tiles need block_m a multiple of 8 up to 256, block_n "
                       f"a multiple of 64 and no split_rows; got {self}")
    if self.multicast_lhs and not self.multicast:
      raise ValueError(f"multicast_lhs needs multicast (clusters of 2 x 2 CTAs; column "
                       f"pairs alone are not a tile the plan runs); got {self}")

  @property
  def block_cols(self) -> int:
    """Columns of a program's output tile: its consumer warpgroups' parts."""
    return self.consumers * self.block_n

  @property
  def streams(self) -> bool:
    """Whether this is a stream tile (:func:`stream_tiles`): one consumer warpgroup."""
    return self.consumers == 1

  @property
  def accumulator_shape(self) -> tuple[int, int]:
    """A consumer warpgroup's float32 accumulator: [rows, cols] of its half of the
    tile (transposed: the rhs's columns x the result's rows)."""
    if self.transposed:
      return self.block_n, self.block_m
    return (self.block_m // 2, self.block_cols) if self.split_rows else (self.block_m,
                                                                          self.block_n)

  @property
  def accumulator_registers(self) -> int:
    """Registers a consumer thread holds for the accumulator (128 threads a warpgroup)."""
    acc_m, acc_n = self.accumulator_shape
    return acc_m * acc_n // 128

  @property
  def cluster_rows(self) -> int:
    """Row blocks per cluster of CTAs: 2 with ``multicast``, else 1."""
    return 2 if self.multicast else 1

  @property
  def cluster_cols(self) -> int:
    """Column blocks per cluster of CTAs: 2 with ``multicast_lhs``, else 1."""
    return 2 if self.multicast_lhs else 1

  @property
  def cluster_size(self) -> int:
    """CTAs per cluster: 1, 2 (``multicast``) or 4 (and ``multicast_lhs``)."""
    return self.cluster_rows * self.cluster_cols

  def concurrent_ctas(self, num_sms: int) -> int:
    """The CTAs of this tile's grid that a GPU of ``num_sms`` SMs runs at once:
    one per SM, but a cluster's CTAs share a GPC, and clusters of four leave
    SMs idle (``QUAD_CLUSTERS``)."""
    if self.cluster_size < 4:
      return num_sms
    return 4 * (num_sms * QUAD_CLUSTERS // H100_SM_COUNT)

  def rate(self, lhs_aligned: bool, rhs_aligned: bool) -> float:
    """Throughput per SM relative to 128 x 128: ``throughput``, capped by the
    operand lines a step takes in per FLOP (``LINE_BOUND``, for transposed tiles
    ``TRANSPOSED_LINE_BOUND``, for their multicast twins
    ``TRANSPOSED_MULTICAST_LINE_BOUND``). A 128-byte TMA box
    row costs one line where the operand's rows start on lines (``*_aligned``,
    :func:`lines_aligned`), two otherwise; multicast halves the rhs's share,
    multicast_lhs the lhs's."""
    lhs_lines = self.block_m * (1 if lhs_aligned else 2) / self.cluster_cols
    rhs_lines = self.block_cols * (1 if rhs_aligned else 2) / self.cluster_rows
    flop_per_line = self.block_m * self.block_cols / (lhs_lines + rhs_lines)
    if self.transposed:
      line_bound = TRANSPOSED_MULTICAST_LINE_BOUND if self.multicast else TRANSPOSED_LINE_BOUND
    else:
      line_bound = LINE_BOUND
    return min(self.throughput, line_bound * flop_per_line)

  def waves(self, rows: int, cols: int, num_sms: int, units: int = 1) -> int:
    """Waves of this tile's grid over a rows x cols result on ``num_sms`` SMs,
    ``units`` work units a tile (split chunks: one a chunk)."""
    return cdiv(self.tile_count(rows, cols) * units, self.concurrent_ctas(num_sms))

  def tile_count(self, rows: int, cols: int) -> int:
    """CTA tiles covering a rows x cols result, a repeated odd last row (column)
    block of a ``multicast`` (``multicast_lhs``) grid included."""
    clusters = (cdiv(cdiv(rows, self.block_m), self.cluster_rows)
                * cdiv(cdiv(cols, self.block_cols), self.cluster_cols))
    return clusters * self.cluster_size

  def fits(self, rows: int, cols: int) -> bool:
    """Whether the program tile lies inside a rows x cols result (edge tiles may
    overhang it), but for the rows of a stream tile (:func:`stream_tiles`): where
    the result has fewer, it loads and stores those alone. The kernel takes each
    tile as a slice of the result and the operands; a slice longer than its
    dimension gave wrong rows on the H100 (a 64-column result with a 128-column
    tile)."""
    return (self.block_m <= rows or self.streams) and self.block_cols <= cols

  def stage_bytes(self, dtype) -> int:
    return (self.block_m + self.block_cols) * BLOCK_K * jnp.dtype(dtype).itemsize

  def reserved_bytes(self, out_dtype) -> int:
    """The epilogue's output tiles, each a swizzled column tile of 128-byte rows
    of any ``out_dtype``: two per consumer warpgroup of EPILOGUE_TILE rows, or
    with ``transposed`` one per consumer warpgroup of ``block_m`` rows."""
    del out_dtype
    if self.transposed:
      return self.consumers * self.block_m * 128
    return 2 * self.consumers * EPILOGUE_TILE * 128


# With at least this many stages, a consumer leaves each step's wgmma in flight while
# it issues the next and frees the step's slot one step later, so the tensor cores
# get the chained steps back to back: the same wgmma sequence into the same
# accumulator, so the same bits. Freeing slots later costs the producer a stage, so
# a tile of fewer stages waits for each step instead. On an H200
# (benchmarks/results/h100.md, fifty-fourth section), at 18 GEMMs whose picks have
# 6-8 stages (few tiles, each over a long contraction: down projections at 100-384
# rows, dA over a wide weight) it ran 1.00-1.19x as fast, 1.08x in geometric mean;
# at 36 of 3-5 stages 0.91-1.10x, 0.99x.
IN_FLIGHT_MIN_STAGES = 6

# Clusters of 2 x 2 CTAs that an H100 (H100_SM_COUNT SMs) runs at once, measured:
# grids of 24-30 such clusters ran as one wave, grids of 32 1.3-1.6x slower than the
# paired tiles they would replace (eight tiles at four shapes; benchmarks/results/
# h100.md, thirty-seventh section). A cluster's CTAs must share a GPC, so not all 33
# groups of four SMs can take one.
QUAD_CLUSTERS = 30

# The 128 x 256 tile, the one for large results: strips 8 row-tiles wide,
# 4 stages, warpgroups split by rows
# (`benchmarks/tune_matmul.py --hopper-m`; notes/h100_notebook.md, "the Mosaic
# kernel's config sweep" and the eighth and ninth sessions' sections, which
# also record the schedules that were not adopted).
TILES = HopperTiles(split_rows=True, throughput=1.15)

# Program tiles of the forward, dA and dB, which ``matmul_plan.mosaic_row_tiles``
# picks by estimated time. Throughputs from `tune_matmul.py --row-tiles-m` and the scratch sweeps
# in notes/h100_notebook.md ("the Mosaic kernel's tile picked per result
# shape", "a 128 x 192 tile"); the rule's misses are listed there.
ROW_TILES: tuple[HopperTiles, ...] = (
    TILES,                                                        # 128 x 256
    HopperTiles(128, 96, split_rows=True, throughput=1.10),       # 128 x 192
    HopperTiles(128, 64, num_stages=6),                           # 128 x 128
    HopperTiles(64, 128, num_stages=4, throughput=0.90),          # 64 x 256
    HopperTiles(64, 64, num_stages=8, throughput=0.75),           # 64 x 128
)
# HopperTiles.rate's cap per unit of FLOP per operand line, fitted on the H100 where
# it starts to bind: 128 x 256 over an lhs whose rows miss the lines (64 units) ran
# at its aligned speed, narrower tiles slower in proportion to their units
# (benchmarks/results/h100.md, twenty-eighth session).
LINE_BOUND = TILES.throughput / 64
# The transposed tiles (forward and dA, 16-bit results): 128 columns with 6
# stages (4 cost the weight-streaming GEMMs of a few hundred rows up to 15%) and
# 256 columns with 4, fewer where shared memory runs out; every row count a
# multiple of 8 from 64 (a wgmma N of 64 or more) that no ROW_TILES entry of the
# same columns has, their accumulators at most 200 registers a thread. Their
# throughputs, and TRANSPOSED_LINE_BOUND below the cap, fit those timed at the
# grid's shapes (benchmarks/results/h100.md, thirty-fourth session): mostly grids
# of one wave, whose tiles pay their pipeline's fill and their epilogue once.
TRANSPOSED_TILES: tuple[HopperTiles, ...] = tuple(
    HopperTiles(block_m, block_n, num_stages, throughput=throughput, transposed=True)
    for block_n, num_stages, throughput, most_rows in ((64, 6, 1.08, 256), (128, 4, 1.12, 200))
    for block_m in range(64, most_rows + 1, 8)
    if (block_m, 2 * block_n) not in {(t.block_m, t.block_cols) for t in ROW_TILES})
TRANSPOSED_LINE_BOUND = 1 / 66
# Their multicast twins (an rhs off the lines): fitted on the three grid GEMMs where
# 1/66 picked a paired plain tile 6-7% slower than a twin (448 / 777 / 3000 rows of
# the unaligned weights), then timed at 14 random unaligned GEMMs whose pick it
# changes: 12 faster by 2-11%, two slower by 2% and 9% (h100.md, thirty-seventh
# section).
TRANSPOSED_MULTICAST_LINE_BOUND = 1 / 58
# Up to this contraction the tiles walk strips COLUMN_STRIP_WIDTH tile columns
# wide down the rows where the result has more tile columns than tile rows
# (matmul_plan.mosaic_strips). Timed on the H100 (benchmarks/results/h100.md,
# thirty-fifth session): dB over 300 tokens into the LM heads 7-9% faster and
# into 3584 x 37,888 6%, over 512 into 4096 x 28,672 3%, a forward over K = 256
# 3%; over 640 tokens even, over 1024-2048 column strips cost 2-9%. Width 4
# beat 8 at each of four shapes.
SHORT_CONTRACTION = 512
COLUMN_STRIP_WIDTH = 4
# Up to this many rows (one row of the ladder's 64-row tiles) the forward and dA
# run on the Triton ladder. Above, the Mosaic kernel streams long contractions
# faster: on an H200 at 100 and 128 rows its pick beat the ladder's at 10 of 18
# GEMMs by 5-60% (13824 x 5120 at 100 rows 0.63x -> 1.01x of cuBLAS) and lost
# 1-11% at 8, the two smallest weights among them; geometric mean 1.00x -> 1.09x
# (benchmarks/results/h100.md, forty-second section). The plan keeps the ladder
# above this where it streams the weight once (matmul_plan.ladder_keeps).
LADDER_ROWS = 64

# A forward or dA of few rows over a long contraction may stream the weight
# through tiles of one consumer warpgroup (matmul_plan.mosaic_stream_tiles):
# 64 weight columns a program, twice the programs of the two-consumer tiles, the
# rows on wgmma's N side, and STREAM_STAGES stages (fewer where shared memory runs
# out). On an H200 (benchmarks/results/h100.md, fifty-fifth section), at 1-31 rows
# of weights of 56-64 such tiles over 11,008-18,944 indices, 16 stages moved
# 3.4-4.0 TB/s, 8, 12, 20 and 24 stages 3.1-3.6; at 80 tiles (13824 x 5120) 16
# stages 3.8-4.1 TB/s, 12 stages 4.1-4.2.
STREAM_STAGES = 16


def stream_tiles(rows: int) -> HopperTiles:
  """The one-consumer transposed tiles for a forward or dA of ``rows`` rows (at
  most 256): ``rows`` rounded up to 8 result rows (wgmma's N) by 64 weight
  columns, STREAM_STAGES stages before ``fit_stages``."""
  return HopperTiles(cdiv(rows, 8) * 8, 64, STREAM_STAGES, transposed=True, consumers=1)


def _block_ring(block, dtype, slots: int, swizzle: int, *, tiled: bool):
  """Shared memory for ``slots`` [rows, cols] blocks of an operand or the result
  (``cols`` minor), as ``(copies, mma)``: two views of the same bytes, TMA's and
  wgmma's, S the swizzle's width.

  ``tiled``: each block is one [rows, cols] array tiled (8, S), which one wgmma
  reads whole and one TMA fills through that same view; Mosaic GPU then tiles
  the whole array in global memory, so its minor dimension must be a multiple
  of S and its major one of 8. Otherwise each block is ``cols / S`` column
  tiles [rows, S] one after another ([slots, cols / S, rows, S]); a column
  tile's (8, S) tiles lie in row order, so it is also plain swizzled rows, and
  TMA fills it through ``copies``, an untiled view, which asks nothing of the
  array but a 16-byte row pitch. That costs a TMA and a wgmma per column tile
  where one would do (1-3% slower at aligned weights on the H100,
  benchmarks/results/h100.md), so it is the choice only where the array cannot
  be tiled, or where the block is one column tile wide."""
  plgpu = mosaic_gpu()
  rows, cols = block
  width = swizzle // jnp.dtype(dtype).itemsize
  swizzled = plgpu.SwizzleTransform(swizzle)
  tiling = plgpu.TilingTransform((8, width))
  if tiled:
    mma = plgpu.SMEM((slots, rows, cols), dtype, transforms=(tiling, swizzled))
    return plgpu.RefUnion(mma, mma)
  shape = (slots, cols // width, rows, width)
  return plgpu.RefUnion(plgpu.SMEM(shape, dtype, transforms=(swizzled,)),
                        plgpu.SMEM(shape, dtype, transforms=(tiling, swizzled)))


def _copy_block(gmem, rows, first_col, copies, barrier, *, multicast: str | None = None):
  """TMA of the [rows, cols] block of ``gmem`` at ``rows`` and columns from
  ``first_col`` into ``copies`` (a slot of a :func:`_block_ring`'s copy view):
  one copy for a tiled block, one per column tile otherwise, all arriving on
  ``barrier``; with ``multicast`` (a cluster axis), into both CTAs of the
  cluster along it. Columns and rows past the array read zeros."""
  plgpu = mosaic_gpu()
  copy = functools.partial(plgpu.copy_gmem_to_smem, barrier=barrier, collective_axes=multicast)
  if copies.ndim == 2:
    copy(gmem.at[rows, pl.ds(first_col, copies.shape[1])], copies)
    return
  width = copies.shape[-1]
  for tile in range(copies.shape[0]):
    copy(gmem.at[rows, pl.ds(first_col + tile * width, width)], copies.at[tile])


def _kernel(lhs_gmem, rhs_gmem, out_gmem, *, layout: Layout, tiles: HopperTiles, rows: int,
            cols: int, k_steps: int, chunk_steps: int | None, split_chunks: bool,
            programs: int):
  """Program ``sm`` of ``programs`` takes work units sm, sm + programs, ...; its
  producer and consumers count the contraction steps they have passed
  (``steps_done``) to find each step's slot in the ring of stages. A unit is a
  tile over the whole contraction. With ``chunk_steps`` the consumers sum each
  run of that many steps from zero and add the sums in order
  (``pallas_kernels.matmul.contraction_loop``'s chunks); the producer streams
  the steps as ever. With ``split_chunks`` a unit is one chunk of one tile
  instead (every tile of chunk 0, then of chunk 1, ...), and its float32 sum
  goes to rows ``chunk * rows`` on of ``out_gmem``, [chunks * rows, cols]."""
  plgpu = mosaic_gpu()
  dtype, out_dtype = lhs_gmem.dtype, out_gmem.dtype
  bm, cta_n = tiles.block_m, tiles.block_cols
  swizzle = plgpu.find_swizzle(BLOCK_K * dtype.itemsize * 8)
  epi = EPILOGUE_TILE
  out_swizzle = plgpu.find_swizzle(epi * jnp.dtype(out_dtype).itemsize * 8)
  epi_cols = out_swizzle // jnp.dtype(out_dtype).itemsize
  lhs_t, rhs_t = layout is Layout.TN, layout is Layout.NT
  stages = min(tiles.num_stages, k_steps)
  in_flight = stages >= IN_FLIGHT_MIN_STAGES
  tile_rows = min(bm, rows)  # a transposed tile takes fewer where the result has fewer
  num_m, num_n = cdiv(rows, bm), cdiv(cols, cta_n)
  # A cluster's row (column) blocks count as one.
  num_groups_m, num_groups_n = cdiv(num_m, tiles.cluster_rows), cdiv(num_n, tiles.cluster_cols)
  num_tiles = num_groups_m * num_groups_n
  num_units = num_tiles * (cdiv(k_steps, chunk_steps) if split_chunks else 1)
  acc_m, acc_n = tiles.accumulator_shape
  program = lax.axis_index("sm")
  cta_row = lax.axis_index(CLUSTER) if tiles.multicast else 0
  cta_col = lax.axis_index(CLUSTER_COLS) if tiles.multicast_lhs else 0
  cluster_axes = ((CLUSTER,) if tiles.multicast else ()) + (
      (CLUSTER_COLS,) if tiles.multicast_lhs else ())

  def tile_slices(tile):
    """The tile's rows and columns of the result; edge tiles end at its edge."""
    i, j = plgpu.planar_snake(tile, (num_groups_m, num_groups_n), tiles.strip_dim,
                              tiles.strip_width)
    row_block = jnp.minimum(i * tiles.cluster_rows + cta_row, num_m - 1)
    col_block = jnp.minimum(j * tiles.cluster_cols + cta_col, num_n - 1)
    return (jnp.minimum(row_block * bm, rows - tile_rows),
            jnp.minimum(col_block * cta_n, cols - cta_n))

  def unit_work(unit):
    """A unit's tile, its first contraction step, its step count and the first
    row of ``out_gmem`` that its result goes to; no steps past the last unit."""
    if not split_chunks:
      return unit, 0, jnp.where(unit < num_units, k_steps, 0), 0
    chunk, tile = unit // num_tiles, unit % num_tiles
    first_step = chunk * chunk_steps
    count = jnp.clip(k_steps - first_step, 0, chunk_steps)
    return tile, first_step, count, chunk * rows

  lhs_block = (BLOCK_K, bm) if lhs_t else (bm, BLOCK_K)
  rhs_block = (cta_n, BLOCK_K) if rhs_t else (BLOCK_K, cta_n)
  width = swizzle // dtype.itemsize  # an operand block's column tile

  def tiled(gmem, block):
    """Whether ``block`` (several column tiles) copies in one TMA from ``gmem``."""
    return (block[1] > width and gmem.shape[0] % TMA_PITCH == 0
            and gmem.shape[1] % width == 0)

  lhs_tiled, rhs_tiled = tiled(lhs_gmem, lhs_block), tiled(rhs_gmem, rhs_block)
  rings = (_block_ring(lhs_block, dtype, stages, swizzle, tiled=lhs_tiled),
           _block_ring(rhs_block, dtype, stages, swizzle, tiled=rhs_tiled),
           _block_ring((bm, epi_cols) if tiles.transposed else (epi, epi_cols), out_dtype,
                       tiles.consumers * (1 if tiles.transposed else 2), out_swizzle,
                       tiled=False))
  # A slot's copies (lhs and rhs blocks, see _copy_block) arrive on its loaded
  # barrier; every consumer releases it.
  copies_per_stage = sum(1 if is_tiled else block[1] // width
                         for block, is_tiled in ((lhs_block, lhs_tiled), (rhs_block, rhs_tiled)))
  # In a cluster a slot is free once every CTA's consumers release it.
  barriers = (plgpu.Barrier(num_arrivals=copies_per_stage, num_barriers=stages),
              plgpu.ClusterBarrier(collective_axes=cluster_axes, num_arrivals=tiles.consumers,
                                   num_barriers=stages) if cluster_axes
              else plgpu.Barrier(num_arrivals=tiles.consumers, num_barriers=stages))
  # A consumer's accumulator takes one wgmma per column tile of an operand
  # block stored as column tiles (TN's lhs by rows, NN's and TN's rhs by columns).
  if tiles.transposed:
    piece_m = width if not (rhs_t or rhs_tiled) else acc_m
    piece_n = acc_n
  else:
    piece_m = width if lhs_t and not lhs_tiled else acc_m
    piece_n = width if not (rhs_t or rhs_tiled) else acc_n

  def body(lhs_smem, rhs_smem, out_smem, loaded, consumed):
    (lhs_copies, lhs_mma), (rhs_copies, rhs_mma), (out_copies, out_stage) = (
        lhs_smem, rhs_smem, out_smem)
    wg = lax.axis_index("wg")

    @pl.when(wg < tiles.consumers)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      if tiles.transposed:
        wg_row0, wg_col0 = 0, wg * tiles.block_n
      else:
        wg_row0, wg_col0 = ((wg * acc_m, 0) if tiles.split_rows else (0, wg * acc_n))

      def lhs_piece(slot, p):
        """Rows p * piece_m.. of this warpgroup's accumulator: [piece_m, BLOCK_K]."""
        if not lhs_t:
          return lhs_mma.at[slot, 0, pl.ds(wg_row0, acc_m)]
        if lhs_tiled:
          return lhs_mma.at[slot, :, pl.ds(wg_row0, acc_m)].transpose((1, 0))
        return lhs_mma.at[slot, wg_row0 // width + p].transpose((1, 0))

      def rhs_piece(slot, q):
        """Columns q * piece_n.. of this warpgroup's accumulator: [BLOCK_K, piece_n]."""
        if rhs_t:
          return rhs_mma.at[slot, 0, pl.ds(wg_col0, acc_n)].transpose((1, 0))
        if rhs_tiled:
          return rhs_mma.at[slot, :, pl.ds(wg_col0, acc_n)]
        return rhs_mma.at[slot, wg_col0 // width + q]

      def operands(slot, p, q):
        """wgmma's A [piece_m, BLOCK_K] and B [BLOCK_K, piece_n] for the
        accumulator's piece (p, q). A transposed tile swaps the roles: A is
        this warpgroup's rhs columns p * piece_m.., B all the block's rows."""
        if not tiles.transposed:
          return lhs_piece(slot, p), rhs_piece(slot, q)
        rows_t = lhs_mma.at[slot, 0].transpose((1, 0))
        if rhs_t:
          return rhs_mma.at[slot, 0, pl.ds(wg_col0, acc_m)], rows_t
        if rhs_tiled:
          return rhs_mma.at[slot, :, pl.ds(wg_col0, acc_m)].transpose((1, 0)), rows_t
        return rhs_mma.at[slot, wg_col0 // width + p].transpose((1, 0)), rows_t

      def consume(j, steps_done):
        tile, _, step_count, out_row0 = unit_work(program + j * programs)
        first_row, first_col = tile_slices(tile)

        @pl.when(step_count > 0)
        def _tile():
          zeros = plgpu.layout_cast(jnp.zeros((acc_m, acc_n), jnp.float32),
                                    plgpu.Layout.WGMMA)

          def steps_sum(first, count):
            """The sum from zero of ``count`` steps from the tile's step ``first``."""
            def mainloop(acc_ref):
              start = steps_done + first

              def free(c):
                """Frees the slot of the ring step ``c`` for the producer."""
                plgpu.barrier_arrive(consumed.at[lax.rem(c, stages)])

              def step(_, c):
                slot = lax.rem(c, stages)
                plgpu.barrier_wait(loaded.at[slot])
                for p in range(acc_m // piece_m):
                  for q in range(acc_n // piece_n):
                    plgpu.wgmma(acc_ref.at[pl.ds(p * piece_m, piece_m),
                                           pl.ds(q * piece_n, piece_n)],
                                *operands(slot, p, q))
                if in_flight:
                  plgpu.wgmma_wait(1)  # the step before is done
                  pl.when(c > start)(lambda: free(c - 1))
                else:
                  plgpu.wgmma_wait(0)
                  plgpu.barrier_arrive(consumed.at[slot])
                return c + 1

              end = lax.fori_loop(0, count, step, start)
              if in_flight:
                plgpu.wgmma_wait(0)
                pl.when(end > start)(lambda: free(end - 1))

            return pl.run_state(mainloop)(plgpu.ACC.init(zeros))

          if chunk_steps is None or split_chunks:
            total = steps_sum(0, step_count if split_chunks else k_steps)
          else:
            full_chunks, last = divmod(k_steps, chunk_steps)
            total = lax.fori_loop(
                0, full_chunks,
                lambda q, total: total + steps_sum(q * chunk_steps, chunk_steps), zeros)
            if last:
              total = total + steps_sum(full_chunks * chunk_steps, last)
          out = total.astype(out_dtype)
          if tiles.transposed:
            for e in range(acc_m // epi_cols):
              piece = plgpu.layout_cast(out[e * epi_cols:(e + 1) * epi_cols],
                                        plgpu.Layout.WGMMA_TRANSPOSED)
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              out_stage.at[wg, 0].transpose((1, 0))[...] = piece
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(
                  out_copies.at[wg, 0] if tile_rows == bm
                  else out_copies.at[wg, 0, pl.ds(0, tile_rows)],
                  out_gmem.at[pl.ds(first_row, tile_rows),
                              pl.ds(first_col + wg_col0 + e * epi_cols, epi_cols)])
            return
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for e in range((acc_m // epi) * (acc_n // epi_cols)):
            mi, ni = divmod(e, acc_n // epi_cols)
            buffer = 2 * wg + e % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_stage[buffer, 0] = out[mi * epi:(mi + 1) * epi, ni * epi_cols:(ni + 1) * epi_cols]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_copies.at[buffer, 0],
                out_gmem.at[pl.ds(out_row0 + first_row + wg_row0 + mi * epi, epi),
                            pl.ds(first_col + wg_col0 + ni * epi_cols, epi_cols)])

        return steps_done + step_count

      lax.fori_loop(0, cdiv(num_units, programs), consume, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == tiles.consumers)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def produce(j, steps_done):
        tile, first_step, step_count, _ = unit_work(program + j * programs)
        first_row, first_col = tile_slices(tile)
        m_slice, n_slice = pl.ds(first_row, tile_rows), pl.ds(first_col, cta_n)

        def step(k, c):
          slot = lax.rem(c, stages)
          pl.when(c >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
          ks, k0 = pl.ds(k * BLOCK_K, BLOCK_K), k * BLOCK_K
          lhs_rows, lhs_col = (ks, first_row) if lhs_t else (m_slice, k0)
          lhs_slot = (lhs_copies.at[slot] if tile_rows == bm
                      else lhs_copies.at[slot, :, pl.ds(0, tile_rows)])
          _copy_block(lhs_gmem, lhs_rows, lhs_col, lhs_slot, loaded.at[slot],
                      multicast=CLUSTER_COLS if tiles.multicast_lhs else None)
          rhs_rows, rhs_col = (n_slice, k0) if rhs_t else (ks, first_col)
          _copy_block(rhs_gmem, rhs_rows, rhs_col, rhs_copies.at[slot], loaded.at[slot],
                      multicast=CLUSTER if tiles.multicast else None)
          return c + 1

        return lax.fori_loop(first_step, first_step + step_count, step, steps_done)

      steps_done = lax.fori_loop(0, cdiv(num_units, programs), produce, jnp.int32(0))
      if cluster_axes:
        # The other CTAs' consumers arrive on this CTA's barriers: wait for the last
        # slots' arrivals so that none lands after this CTA has exited.
        def drain(c, carry):
          plgpu.barrier_wait(consumed.at[lax.rem(c, stages)])
          return carry

        lax.fori_loop(jnp.maximum(steps_done - stages, 0), steps_done, drain, jnp.int32(0))

  pl.run_scoped(lambda *refs: body(*refs[:3], *refs[3]), *rings, barriers,
                collective_axes="wg")


def transposed_takes(layout: Layout, out_dtype) -> bool:
  """Whether transposed tiles (``HopperTiles.transposed``) take a GEMM in
  ``layout`` with an ``out_dtype`` result: the forward and dA (NN, NT), 16-bit."""
  return layout is not Layout.TN and jnp.dtype(out_dtype).itemsize == 2


# TMA moves rows whose pitch is a multiple of 16 bytes: 8 elements of a 16-bit
# operand (and of the result, which is no wider).
TMA_PITCH = 8


def takes(layout: Layout, rows: int, cols: int, contraction: int) -> bool:
  """Whether :func:`matmul` takes a rows x cols result over ``contraction`` in
  ``layout``: every operand's and the result's minor dimension a multiple of
  ``TMA_PITCH``. Nothing is copied."""
  lhs_minor, _ = layout.minor_dims(rows, cols, contraction)
  return lhs_minor % TMA_PITCH == 0 and cols % TMA_PITCH == 0


# A 128-byte line holds this many 16-bit elements.
LINE_ELEMENTS = 64


def lines_aligned(layout: Layout, rows: int, cols: int, contraction: int) -> tuple[bool, bool]:
  """Whether each row of the 16-bit lhs, and of the rhs, starts on a 128-byte
  line: its minor dimension a multiple of ``LINE_ELEMENTS``."""
  lhs_minor, rhs_minor = layout.minor_dims(rows, cols, contraction)
  return lhs_minor % LINE_ELEMENTS == 0, rhs_minor % LINE_ELEMENTS == 0


@functools.partial(jax.jit, static_argnames=("layout", "out_dtype", "tiles",
                                             "contraction_chunk", "split_chunks"))
def matmul(lhs, rhs, *, layout: Layout, out_dtype, tiles: HopperTiles,
           contraction_chunk: int | None = None, split_chunks: bool = False):
  """One GEMM in ``layout`` on an sm_90 GPU; returns [rows, cols] in ``out_dtype``.

  lhs: [rows, K] (NN, NT) or [K, rows] (TN); rhs: [K, cols] (NN, TN) or
  [cols, K] (NT). Both share a 16-bit dtype; the sizes must be ones the kernel
  :func:`takes`; ``tiles``' stages must fit shared memory
  (``pallas_kernels.matmul.fit_stages``) and its program tile the result
  (``HopperTiles.fits``). No operand is copied. ``contraction_chunk`` (a
  multiple of ``BLOCK_K``; NN and NT, on tiles whose accumulator takes at most
  ``pallas_kernels.matmul.CHUNK_ACCUMULATOR_REGISTERS`` registers): the
  contraction summed in chunks (``pallas_kernels.matmul.contraction_loop``).
  With ``split_chunks`` (a chunked contraction, tiles that are not transposed)
  each chunk of each tile is a work unit of its own, which sums it from zero
  into a float32 partial, and ``pallas_kernels.matmul.chunk_total`` adds the
  partials in chunk order: the same bits, on up to as many programs as the
  chunks times the tiles, for results with too few tiles to fill the SMs. The
  tile may then be any (no second accumulator).
  """
  if lhs.dtype not in DTYPES or rhs.dtype != lhs.dtype:
    raise TypeError(f"operands must share a 16-bit dtype, got {lhs.dtype} and {rhs.dtype}")
  if fit_stages(tiles, lhs.dtype, out_dtype) != tiles:
    raise ValueError(f"{tiles} does not fit shared memory for {lhs.dtype} operands and a "
                     f"{jnp.dtype(out_dtype)} result: use fit_stages")
  if layout is Layout.TN:
    (contraction, rows), cols = lhs.shape, rhs.shape[1]
  else:
    (rows, contraction), cols = lhs.shape, rhs.shape[0 if layout is Layout.NT else 1]
  if not takes(layout, rows, cols, contraction):
    raise ValueError(f"the {layout.name} kernel does not take lhs {lhs.shape} and rhs "
                     f"{rhs.shape}: see hopper_matmul.takes")
  if not tiles.fits(rows, cols):
    raise ValueError(f"{tiles} does not fit a {rows} x {cols} result (HopperTiles.fits)")
  if tiles.transposed and not transposed_takes(layout, out_dtype):
    raise ValueError(f"transposed tiles take layouts NN and NT and a 16-bit result, got "
                     f"{layout.name} and {jnp.dtype(out_dtype)}")
  if contraction_chunk is not None and (
      layout is Layout.TN or contraction_chunk % BLOCK_K
      or not (split_chunks or holds_two_accumulators(tiles))):
    raise ValueError(f"contraction_chunk needs layout NN or NT, a multiple of {BLOCK_K} and, "
                     f"unless split_chunks, tiles whose accumulator takes at most "
                     f"{CHUNK_ACCUMULATOR_REGISTERS} registers; got {layout.name}, "
                     f"{contraction_chunk}, {tiles}")
  if split_chunks and (contraction_chunk is None or tiles.transposed):
    raise ValueError(f"split_chunks needs a contraction_chunk and tiles that are not "
                     f"transposed (the partials are float32); got {contraction_chunk}, {tiles}")
  k_steps = cdiv(contraction, BLOCK_K)
  chunk_steps = None if contraction_chunk is None else contraction_chunk // BLOCK_K
  if not split_chunks:
    return _launch(lhs, rhs, layout=layout, out_dtype=out_dtype, tiles=tiles, rows=rows,
                   cols=cols, k_steps=k_steps, chunk_steps=chunk_steps, split_chunks=False)
  chunks = cdiv(k_steps, chunk_steps)
  partials = _launch(lhs, rhs, layout=layout, out_dtype=jnp.float32, tiles=tiles, rows=rows,
                     cols=cols, k_steps=k_steps, chunk_steps=chunk_steps, split_chunks=True)
  return chunk_total(partials.reshape(chunks, rows, cols), out_dtype=out_dtype)


def _launch(lhs, rhs, *, layout: Layout, out_dtype, tiles: HopperTiles, rows: int, cols: int,
            k_steps: int, chunk_steps: int | None, split_chunks: bool):
  plgpu = mosaic_gpu()
  units = cdiv(k_steps, chunk_steps) if split_chunks else 1
  programs = min(tiles.concurrent_ctas(jax.devices()[0].core_count),
                 tiles.tile_count(rows, cols) * units)
  programs //= tiles.cluster_size  # grid counts clusters
  kernel = functools.partial(_kernel, layout=layout, tiles=tiles, rows=rows, cols=cols,
                             k_steps=k_steps, chunk_steps=chunk_steps,
                             split_chunks=split_chunks, programs=programs)
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((units * rows, cols), out_dtype),
      grid=(programs,),
      grid_names=("sm",),
      cluster=(tiles.cluster_rows, tiles.cluster_cols),
      cluster_names=(CLUSTER, CLUSTER_COLS),
      num_threads=tiles.consumers + 1,
      thread_name="wg",
  )(lhs, rhs)
