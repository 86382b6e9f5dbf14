"""Every routing decision of the batch-invariant GEMM: :func:`plan` picks the
kernel and its tiles, :func:`launch` runs a plan, :func:`run` does both.

Three kernels compute the GEMM, all under the numerics contract of
:mod:`pallas_kernels.matmul` (the contraction in ``BLOCK_K`` steps in increasing
order into one float32 accumulator, or fixed chunks of it so, added in order:
:func:`fixed_contraction_chunk`), so they give the same bits and the plan may
choose by any size, the token count included. It chooses speed, never bits:

* ``Kernel.MOSAIC_GPU`` (:mod:`pallas_kernels.hopper_matmul`): TMA + wgmma on a
  persistent grid. An H100, 16-bit operands, one problem (no groups), more than
  ``hopper_matmul.LADDER_ROWS`` rows for the forward and dA (but where the plan
  keeps the ladder: :func:`ladder_keeps`; up to ``LADDER_ROWS`` rows where it
  streams the weight through one-consumer tiles, whole up to ``STREAM_ROWS`` rows:
  :func:`mosaic_stream_tiles`, and above over shares of up to
  ``ROW_STREAM_MAX_ROWS`` rows: :func:`row_stream_tiles`), a
  result no smaller than a program tile, and 16-byte row pitches
  (``hopper_matmul.takes``: the minor dimension of each operand and of the result a
  multiple of 8). It copies no operand, whatever the token count; where an operand's
  rows miss 16 bytes, the plan may copy the operands to 16-byte pitches for it
  (:func:`pitch_padded_plan`). It runs chunked contractions too, in each tile's
  program or split (:func:`mosaic_split_tiles`).
* ``Kernel.PALLAS_TRITON`` (:mod:`pallas_kernels.matmul`): the Pallas Triton
  lowering, masked edges, no copies; every other GEMM, every other chunked
  contraction (``plan``'s ``contraction_chunk``), and every GEMM in interpret
  mode (CPU) with one fixed tile.
* ``Kernel.JAX_TRITON`` (:mod:`pallas_kernels.jax_triton_matmul`): the same
  GEMM written in Triton and launched by jax-triton; only for
  ``backend="triton"``, with the Pallas Triton tiles.

Operands of a [rows, cols] result, per :class:`~pallas_kernels.matmul.Layout`
(``G`` groups of independent problems; a shared rhs has ``Gb`` = 1):

* NN: lhs [G, rows, K], rhs [Gb, K, cols] (the forward);
* NT: lhs [G, rows, K], rhs [Gb, cols, K] (dA = dC Bᵀ);
* TN: lhs [G, K, rows], rhs [G, K, cols] (dB = Aᵀ dC, K the token count).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import hopper_matmul as mosaic
from pallas_kernels import matmul as pallas_triton
from pallas_kernels._common import cdiv, pad_axis
from pallas_kernels.matmul import BLOCK_K, Layout, MatmulTiles


class Kernel(enum.Enum):
  MOSAIC_GPU = "mosaic_gpu"
  PALLAS_TRITON = "pallas_triton"
  JAX_TRITON = "jax_triton"


BACKENDS = ("pallas", "triton")
# Relative difference under which two Mosaic tiles' estimated times tie
# (mosaic_row_tiles): the estimate's float rounding must not choose between
# tiles the model rates equal.
TIED_ESTIMATES = 1e-9


@dataclasses.dataclass(frozen=True)
class Device:
  """What the plan reads about the device: its platform, compute capability and SMs."""
  platform: str
  compute_capability: str = ""
  sm_count: int = 0

  @classmethod
  def current(cls) -> Device:
    device = jax.devices()[0]
    return cls(device.platform, str(getattr(device, "compute_capability", "")),
               int(getattr(device, "core_count", 0) or 0))

  @property
  def is_hopper(self) -> bool:
    return self.platform == "gpu" and self.compute_capability == "9.0"


# A forward or dA result narrower than this many of the Triton ladder's narrowest
# column tiles (CHUNK_COLUMN_TILE columns) sums its contraction in fixed chunks
# (fixed_contraction_chunk): at a few rows its column tiles alone leave most of
# the H100's 132 SMs idle, each walking the whole contraction. A chunk is
# CHUNK_PER_COLUMN_TILE indices per column tile (about 128 programs over a
# 4096-long contraction at a few rows), rounded up to CHUNK_GRANULE, and at least
# MIN_CHUNK (the Pallas Triton kernel refills its pipeline at each chunk of an
# in-program loop: 256-long chunks ran 23-48% slower than one sum). On the H100
# (benchmarks/results/h100.md, fortieth section) XLA ran such GEMMs 1.2-4.8x
# faster than one program per column tile at 1-64 rows (K/V projections among
# them); the chunks made those 1.3-2.6x faster, and GEMMs of 8192 rows 1-17%
# slower (tiles that hold two accumulators).
CHUNKED_BELOW_COLUMN_TILES = 128
CHUNK_COLUMN_TILE = min(t.block_n for t in pallas_triton.GPU_MATMUL_LADDER)
CHUNK_PER_COLUMN_TILE = 32
CHUNK_GRANULE = 256
MIN_CHUNK = 1024
# Up to SPLIT_CHUNK_ROWS rows, a chunked GEMM whose contraction holds at least
# SPLIT_MIN_CHUNKS chunks runs its chunks on programs of their own
# (Plan.split_chunks): a narrow result there is a few row tiles of fewer than 128
# sixteen-column tiles, so in-program chunks leave most SMs idle, and the split
# cuts each program's contraction to a chunk, at most two thirds of it. Below 1.5
# chunks the second kernel and the partials cost more than the shorter loop saves.
# Above SPLIT_CHUNK_ROWS the split runs only on the Mosaic GPU kernel, over at
# least MANY_ROWS_SPLIT_MIN_CHUNKS chunks, by its rows and how much of the SMs the
# in-program pick's tiles fill (splits_chunks). Measured in
# benchmarks/results/h100.md: on the H100 1.14-2.2x faster than in-program chunks
# at 65-256 rows, losing at 514 (forty-first section); on an H200 from 1.5 chunks
# faster at 121 of 133 GEMMs of 1-256 rows drawn before and after the rule, below
# it 0.98x, and above 256 rows over 1.5-2 chunks 0.90x / 0.97x (sixty-third
# section).
SPLIT_CHUNK_ROWS = 256
SPLIT_MIN_CHUNKS = 1.5
MANY_ROWS_SPLIT_MIN_CHUNKS = 2
# A split runs on the Mosaic GPU kernel where it takes the sizes and, up to
# SPLIT_CHUNK_ROWS rows, the work units of its pick (one chunk of one tile each:
# mosaic_split_tiles) fill at least MOSAIC_SPLIT_FILL of the SMs' CTA slots
# (fills_the_sms); on the Triton ladder otherwise, whose tiles go down to 16
# columns. On an H200 (benchmarks/results/h100.md,
# forty-fourth section), at 18 narrow GEMMs of 65-256 rows drawn after the rule
# was written, the Mosaic split ran 1.06-1.84x as fast as the Triton split at the
# 10 it takes (1.52x in geometric mean), and 0.92-1.28x at the 8 it leaves,
# whose units filled 15-36% of the SMs.
MOSAIC_SPLIT_FILL = 0.5
# Above SPLIT_CHUNK_ROWS rows a chunked GEMM splits at up to TALL_SPLIT_ROWS rows,
# but not where its in-program pick's tiles fill at least FULL_WAVE_FILL of the CTA
# slots over fewer than FULL_WAVE_SPLIT_MIN_CHUNKS chunks; above TALL_SPLIT_ROWS
# where those tiles fill less than IN_PROGRAM_SPLIT_FILL. On an H200, against
# in-program tiles mostly of 64 x 128 (two consumers) at eight stages (random GEMMs
# of 257-2048 rows over 2-40 chunks), the split won up to 512 rows from half to 85%
# full (1.09x, 33 of 42 faster) and from 0.91 full over 5 chunks or more (1.09x, 47
# of 58), lost there under 5 chunks (0.93x, 8 of 26 faster; 0.91x at 30 drawn
# after), and lost above 512 rows from 0.55 full (0.91x, 27 of 86 faster; 0.93x at
# 60 drawn after the rule) (benchmarks/results/h100.md, sixty-fourth section).
TALL_SPLIT_ROWS = 512
FULL_WAVE_FILL = 0.85
FULL_WAVE_SPLIT_MIN_CHUNKS = 5
IN_PROGRAM_SPLIT_FILL = 0.55
# Above hopper_matmul.LADDER_ROWS rows the forward and dA stay on the Triton ladder
# where its tiles stream the weight once and the Mosaic kernel's pick reads it
# twice, over a contraction of at least LADDER_MIN_CONTRACTION, on waves at least
# LADDER_WAVE_FILL full and at least as full as the pick's (ladder_keeps). On an
# H200 the ladder lost 4-14% where the pick filled more of its waves, and up to
# 10% over contractions of 1024-1280 (benchmarks/results/h100.md, forty-third
# section). Fitted on 50 GEMMs at 65-128 rows (Llama-3 weights and two random
# draws); on 18 drawn afterwards it ran 0.6% slower in geometric mean than the
# faster kernel of each, the Mosaic kernel everywhere 2.5%, a threshold of 3/4
# alone (the rule before) 1.8%.
LADDER_WAVE_FILL = 0.75
LADDER_MIN_CONTRACTION = 1536
# Where a row of the forward's or dA's lhs or rhs is not a whole number of
# WORD_BYTES-byte words (16-bit operands of odd length: rows_miss_words), the Triton
# tiles of at most GPU_ONE_ROW_OF_TILES rows in a single wave take DEEP_STEP_K-deep
# steps: Triton copies such rows synchronously, so each step waits out its loads'
# latency, and deeper steps wait fewer times. Over more waves, programs of 64-deep steps
# at resident stages share each SM and overlap their waits, which the deep steps' large
# stages leave no room for. On an H200 (benchmarks/results/h100.md, forty-fifth
# section), at 37 random odd-length GEMMs of 1-64 rows the 256-deep steps ran 1.33x as
# fast as 64-deep ones in geometric mean (0.88-2.14x, slower at one), at 15 of 65-2048
# rows on 64-row tiles 1.26x (0.96-1.70x); at 14 whose rows are whole words but not
# 16-byte multiples, 0.85x (the rule leaves them). Timed against the resident stages
# (fifty-second section): 1.36x at 26 single-wave GEMMs of 1-64 rows, 0.89x at 14 of
# more waves (GPT-2's 50,257-column head among them), and 1.03x / 1.08x at 15 / 27 of
# more waves drawn afterwards for 64-deep steps there. Those tiles also run at least
# SYNC_LOAD_MIN_WARPS warps: each thread issues its share of the 2-byte loads, and the
# ladder's 16 x 16 tile has 2 warps. On an H200 (fifty-ninth section), at two draws of
# such single-wave GEMMs of 1-15 rows, 4 warps ran 1.03-1.38x as fast as 2 (16 GEMMs) and
# 1.01-1.33x at those drawn afterwards (21); over rows of whole words, 0.87-1.01x (12), so
# the tile keeps 2 warps there. Tiles at least SYNC_LOAD_WIDE_ASPECT times as wide as tall
# (the ladder's 16 x 64 and 16 x 128) run SYNC_LOAD_WIDE_WARPS: on an H200 (fifty-ninth and
# sixtieth sections), 8 warps against 4 ran 1.20x / 1.17x as fast at 17 / 13 such GEMMs of
# 1-16 rows and 1.17x at 30 drawn afterwards; 16 warps against 8, 0.98x / 0.89x at two
# draws of 20. 16 x 32 lost at 8 (0.96x at 16) and 64 x 16 gained little (1.03x at 19), so
# they keep 4.
WORD_BYTES = 4
SYNC_LOAD_MIN_WARPS = 4
SYNC_LOAD_WIDE_ASPECT = 4
SYNC_LOAD_WIDE_WARPS = 8
# A single 16-bit GEMM whose lhs or rhs rows miss 16 bytes (no TMA, so no Mosaic
# GPU kernel) copies its operands zero-padded to 16-byte pitches (the result
# sliced back) where the plan of the padded sizes is the Mosaic GPU kernel's and
# the GEMM does at least PITCH_PAD_MIN_MACS multiply-adds (pitch_padded_plan):
# Triton loads such rows in 2- or 4-byte pieces. On an H200
# (benchmarks/results/h100.md, fiftieth section), at 50 random forward, dA and dB
# GEMMs of 71-14690 tokens that the rule pads, the copies and the Mosaic kernel ran
# 1.95x as fast as the Triton pick in geometric mean (45 faster, 0.85-7.4x); below
# the bound the copies' fixed cost lost at 4 of 6 (0.58-0.85x). A result whose
# rows alone miss (dA of a weight of unaligned width) stays on Triton, which
# stores it at speed: padded, two of four such GEMMs lost (0.47x, 0.64x). At 24
# GEMMs drawn after the rule, 1.68x (19 faster; 0.50-0.87x at five over short
# contractions, 288-512 indices or 104-128 tokens, not explained); padding would
# have slowed 7 of the 8 it declined. Toward the Mosaic kernel's stream tiles
# (mosaic_stream_tiles) it pads only above the rows of the Triton ladder's shortest
# tiles (SMALLEST_LADDER_TILE), whose deep steps keep pace with the copy, and only
# rows that are not whole words (rows_miss_words), which Triton cannot load
# asynchronously. Toward the Triton ladder it pads an unchunked NT GEMM of 17-64
# such rows, whose padded rows take the ladder's 64-deep asynchronous steps (NN
# was mixed). On an H200 (benchmarks/results/h100.md, sixty-first and
# sixty-second sections): copies and stream tiles 1.30x / 1.37x the unpadded ladder
# over 17-48 odd-length rows, the unpadded ladder 1.33x / 1.37x the copies over
# whole words, the NT ladder padded 1.65x at 30 drawn after the rule. At 49-64 rows,
# where the stream tiles run over shares of the rows, copies of odd-length rows for
# them ran 1.19x the unpadded NN ladder (11 drawn GEMMs, 4 slower, 0.64x over 1029
# indices) and 1.10x the padded NT ladder (4) (sixty-eighth section).
# Over rows of whole words, which Triton loads asynchronously, the copies pay only
# over a contraction of at least WHOLE_WORD_PAD_MIN_CONTRACTION (any layout; in TN
# the contraction is the tokens) and, in NN, above the rows of the ladder's tallest
# tiles (TALLEST_LADDER_TILE_ROWS), which stream the weight once. On an H200
# (h100.md, sixty-seventh section: 101 GEMMs of 65-1024 tokens timed both ways, four
# draws and the grid's 4100 x 2050), copies over shorter contractions lost at 24 of 25
# (0.826x in geometric mean, all 12 dB over 73-393 tokens) and NN at 65-128 rows at 6
# of 9 (0.876x); the 67 the rule pads won 1.228x (12 slower). At 44 GEMMs drawn after
# the rule, 1.037x the speed of copying them all.
# Over rows that are not whole words, the copies pay in NN and TN only over a
# contraction of at least SPLIT_WORD_PAD_MIN_CONTRACTION (TN: tokens): below it the
# padded GEMM is short beside the copies of its operands and of the sliced result,
# and Triton's waiting loads cost few steps. In NT both operands' rows run along the
# contraction and miss words, so Triton waits at every load of both, and the copies
# pay from the shortest. On an H200 (benchmarks/results/h100.md, seventy-first
# section), at 60 random such GEMMs over 67-974 indices that the copies took, they
# ran 0.761x the unpadded Triton pick's speed in geometric mean in NN and TN under 512
# indices (34 GEMMs, 28 slower; NN 0.898x, TN 0.686x), 1.32x from 512 up (11, one
# slower), and in NT 1.94x (15, two slower); the bound makes the 45 NN and TN GEMMs
# 1.23x as fast (the worst it declines: NN 2248 x 451 x 15712, copies 2.12x). At 24
# drawn after the rule, 1.16x the speed of copying them all (the 12 it declines 1.35x,
# one slower).
PITCH_PAD_MIN_MACS = 1 << 28
WHOLE_WORD_PAD_MIN_CONTRACTION = 1024
SPLIT_WORD_PAD_MIN_CONTRACTION = 512
# Up to STREAM_ROWS rows a single forward or dA over a contraction of at least
# STREAM_MIN_CONTRACTION runs on the Mosaic GPU kernel's stream tiles
# (hopper_matmul.stream_tiles) where their programs fit in one wave
# (mosaic_stream_tiles): TMA streams a weight faster than the Triton ladder's
# 16-32-column programs, whose rate stays near 26-48 GB/s each; over two or more waves
# the ladder stays faster. On an H200, against the ladder's pick (h100.md, fifty-fifth
# and fifty-sixth sections, draws made after each bound): 1.12x at 29 GEMMs over 4096+
# indices, 1.15x at 18 over 2048-2496. Whole tiles of 49-64 rows fit only 13-14 stages
# and lost over long contractions (0.89-0.98x); above STREAM_ROWS, up to
# hopper_matmul.LADDER_ROWS, the stream tiles run over a share of the rows instead
# (row_stream_tiles: the most CTAs one wave holds, shares of 8-32 rows under results
# of at most 4,224 columns, whole tiles above). On an H200 (h100.md, sixty-eighth
# section) 1.20x the ladder's speed at 40 random GEMMs over 1056-16216 indices (37
# faster), 1.01-1.27x at 14 forward and dA GEMMs over 8192-152,064 (grid weights among
# them); at 40 drawn after the rule (aligned or not, chunked or not) 1.27x (36
# faster). Below 49 rows whole tiles stay: shares there ran 0.975x at 30 random GEMMs
# (0.76x at the worst). Where the ladder's pick is its smallest tile
# (SMALLEST_LADDER_TILE: at most 16 rows of a result its 16-column programs fill in
# one wave), those programs outnumber the stream tiles four to one, and the stream
# tiles run only over SMALLEST_TILE_STREAM_MIN_CONTRACTION indices or more, longer in
# NT, where each such program reads whole 128-byte lines of the weight; but in NT
# where those programs fill at most half the SMs (results of at most 1,056 columns on
# 132 SMs), from HALF_WAVE_NT_STREAM_MIN_CONTRACTION. Over 1024-4095 indices at 1-48
# rows (h100.md, fifty-seventh section: four draws, 169 one-wave GEMMs, then 28 of the
# smallest pick drawn after the bounds), against the ladder: other picks 1.22x (112, 2
# slower); the smallest pick NN over 1536+ 1.11x (22) and 1.14x after (9), NT over
# 2560+ 1.10x (7) and 1.07x after (11, 3 slower), and below the bounds 0.97x (28, 23
# slower) and 0.99x after (8, 6 slower). NT on half-wave grids (h100.md, fifty-seventh
# section, 5, and fifty-eighth: three draws, 88 GEMMs, two made after the bound): from
# 1664 indices 1.10x (48, 18 slower, none below 0.91x), below 0.975x (44, 26 slower).
STREAM_ROWS = 48
STREAM_MIN_CONTRACTION = 1024
SMALLEST_LADDER_TILE = min((t.block_m, t.block_n) for t in pallas_triton.GPU_MATMUL_LADDER)
TALLEST_LADDER_TILE_ROWS = max(t.block_m for t in pallas_triton.GPU_MATMUL_LADDER)
SMALLEST_TILE_STREAM_MIN_CONTRACTION = {Layout.NN: 1536, Layout.NT: 2560}
HALF_WAVE_NT_STREAM_MIN_CONTRACTION = 1664
# Above LADDER_ROWS rows, up to ROW_STREAM_MAX_ROWS (the rows one stream tile holds:
# wgmma's N), a single forward or dA whose Mosaic pick's tiles fill less than
# ROW_STREAM_FILL of the CTA slots runs on stream tiles over a share of the rows
# (row_stream_tiles): one consumer warpgroup and 64 weight columns a CTA, so that a
# narrow result spreads over as many CTAs as one wave holds. The pick's 64 x 128
# tiles leave most SMs idle under results of about 4,000 columns, each streaming
# its long column of the weight alone. On an H200 (benchmarks/results/h100.md,
# sixty-fifth section), at 100 random GEMMs of 65-256 rows that the pick ran in
# program, the row shares ran 1.23x as fast where the pick filled less than half
# the slots (40 GEMMs, 39 faster), 1.02x from half to three quarters (22, 15
# faster) and 0.81x above (38, 6 faster); at 75 drawn after the rule 1.19x (68
# faster, none below 0.95x), at the 54 grid plans it moves 1.10x (44 faster).
ROW_STREAM_MAX_ROWS = 256
ROW_STREAM_FILL = 0.5


def fixed_contraction_chunk(layout: Layout, cols: int, contraction: int) -> int | None:
  """The chunk length in which a GEMM of a ``cols``-column result sums its
  ``contraction`` (each chunk from zero, the chunk sums added in order:
  ``pallas_kernels.matmul.contraction_loop``), or None for one sum. Part of the
  numerics contract: it depends on the result's columns alone, never on the
  rows (the token count) nor on the device, so every kernel, every row count
  and interpret mode sum alike. The chunk does not depend on the contraction
  either, so zero-padding the contraction adds zero chunks and keeps the bits.
  NN and NT only (dB, TN, reduces over the tokens)."""
  column_tiles = cdiv(cols, CHUNK_COLUMN_TILE)
  if layout is Layout.TN or column_tiles >= CHUNKED_BELOW_COLUMN_TILES:
    return None
  chunk = max(MIN_CHUNK, cdiv(column_tiles * CHUNK_PER_COLUMN_TILE, CHUNK_GRANULE)
              * CHUNK_GRANULE)
  return chunk if chunk < contraction else None


@dataclasses.dataclass(frozen=True)
class Plan:
  """A kernel and its tiles (:class:`~pallas_kernels.matmul.MatmulTiles` for the
  Triton kernels, :class:`~pallas_kernels.hopper_matmul.HopperTiles` for Mosaic GPU),
  the chunks of a chunked contraction, and whether the chunks run on programs of
  their own (``split_chunks``, Pallas Triton: ``pallas_kernels.matmul.matmul_chunks``;
  Mosaic GPU: ``pallas_kernels.hopper_matmul.matmul``'s) or one after another in
  each tile's program; ``pitch_padded``: the kernel runs on the operands copied
  to 16-byte row pitches (:func:`pitch_padded_plan`), its tiles and chunks those
  of the padded sizes."""
  kernel: Kernel
  tiles: MatmulTiles | mosaic.HopperTiles
  interpret: bool = False
  contraction_chunk: int | None = None
  split_chunks: bool = False
  pitch_padded: bool = False


def plan(layout: Layout, rows: int, cols: int, contraction: int, *, dtype, out_dtype,
         groups: int = 1, backend: str = "pallas", interpret: bool = False,
         device: Device | None = None, contraction_chunk: int | None = None,
         split_chunks: bool | None = None) -> Plan:
  """The kernel and tiles for ``groups`` GEMMs of a [rows, cols] result over
  ``contraction`` in ``layout``, with ``dtype`` operands and an ``out_dtype``
  result, on ``device`` (default: the first jax device). A pure function of its
  arguments.

  ``contraction_chunk`` (NN or NT): the contraction summed in chunks of that
  many indices, each from zero, the chunk sums added in order
  (``pallas_kernels.matmul.contraction_loop``): the bits of a loop of GEMMs over
  the chunks whose float32 results are added one after another. None (the
  default) takes :func:`fixed_contraction_chunk`'s, the contract of
  ``jdet.matmul``; a chunk that covers the contraction (of any size) is no
  chunking. Every kernel runs chunks: the Triton kernels and the Mosaic GPU
  kernel on tiles whose accumulator fits twice
  (``pallas_kernels.matmul.holds_two_accumulators``); a single problem of
  at most ``SPLIT_CHUNK_ROWS`` rows over at least ``SPLIT_MIN_CHUNKS`` chunks
  runs its chunks on programs of their own (``Plan.split_chunks``), on
  the Mosaic GPU kernel where :func:`mosaic_split_tiles` gives tiles, else on
  the Triton ladder's; above SPLIT_CHUNK_ROWS rows on the Mosaic GPU kernel
  where :func:`splits_chunks` says.
  ``split_chunks`` (True or False) overrides that rule for a chunked single
  problem on the "pallas" backend (``benchmarks/tune_matmul.py --split-m``
  times both); the bits are the same either way.
  """
  dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if contraction_chunk is None:
    contraction_chunk = fixed_contraction_chunk(layout, cols, contraction)
  if contraction_chunk is not None and contraction_chunk >= contraction:
    contraction_chunk = None
  if contraction_chunk is not None and (layout is Layout.TN or contraction_chunk % BLOCK_K):
    raise ValueError(f"contraction_chunk needs layout NN or NT and a multiple of {BLOCK_K}; "
                     f"got {layout.name}, {contraction_chunk}")
  chunked = contraction_chunk is not None
  if split_chunks and not (chunked and groups == 1 and backend == "pallas"):
    raise ValueError(f"split_chunks needs a chunked contraction of one problem on the pallas "
                     f"backend; got contraction {contraction} in chunks of {contraction_chunk}, "
                     f"{groups} groups, backend {backend!r}")
  if interpret:
    return Plan(Kernel.PALLAS_TRITON, pallas_triton.INTERPRET_TILES, interpret=True,
                contraction_chunk=contraction_chunk, split_chunks=bool(split_chunks))
  device = device or Device.current()
  num_sms = device.sm_count or pallas_triton.H100_SM_COUNT
  if backend == "triton":
    return Plan(Kernel.JAX_TRITON, triton_tiles(layout, rows, cols, dtype, out_dtype, groups,
                                                num_sms, chunked=chunked),
                contraction_chunk=contraction_chunk)
  if groups == 1 and operand_rows_miss_pitch(layout, rows, cols, contraction):
    padded = pitch_padded_plan(layout, rows, cols, contraction, dtype=dtype,
                               out_dtype=out_dtype, device=device,
                               contraction_chunk=contraction_chunk, split_chunks=split_chunks)
    if padded:
      return padded
  mosaic_split = (mosaic_split_tiles(layout, rows, cols, contraction, contraction_chunk,
                                     dtype, device, num_sms) if chunked and groups == 1 else None)
  if split_chunks is None:
    split_chunks = chunked and groups == 1 and splits_chunks(
        layout, rows, cols, contraction, contraction_chunk, out_dtype, num_sms, mosaic_split)
  if split_chunks:
    if mosaic_split:
      return Plan(Kernel.MOSAIC_GPU, mosaic_split, contraction_chunk=contraction_chunk,
                  split_chunks=True)
    split_tiles = triton_tiles(layout, rows, cols, dtype, jnp.float32, num_sms=num_sms,
                               contraction=contraction, split_chunk=contraction_chunk)
    return Plan(Kernel.PALLAS_TRITON, split_tiles, contraction_chunk=contraction_chunk,
                split_chunks=True)
  ladder = triton_tiles(layout, rows, cols, dtype, out_dtype, groups, num_sms,
                        contraction=contraction, chunked=chunked)
  mosaic_tiles = _mosaic_tiles(layout, rows, cols, contraction, dtype, out_dtype, groups,
                               device, num_sms, ladder, chunked=chunked)
  if mosaic_tiles:
    return Plan(Kernel.MOSAIC_GPU, mosaic_tiles, contraction_chunk=contraction_chunk)
  return Plan(Kernel.PALLAS_TRITON, ladder, contraction_chunk=contraction_chunk)


def operand_rows_miss_pitch(layout: Layout, rows: int, cols: int, contraction: int) -> bool:
  """Whether a row of the lhs or of the rhs (their minor dimensions in
  ``layout``) is not a multiple of ``hopper_matmul.TMA_PITCH`` elements."""
  return any(minor % mosaic.TMA_PITCH for minor in layout.minor_dims(rows, cols, contraction))


def pitch_padded_sizes(layout: Layout, rows: int, cols: int,
                       contraction: int) -> tuple[int, int, int]:
  """(rows, cols, contraction) once :func:`pad_to_pitch` has padded the operands:
  each operand's minor dimension and the result's columns rounded up to
  ``hopper_matmul.TMA_PITCH``."""
  def up(size):
    return cdiv(size, mosaic.TMA_PITCH) * mosaic.TMA_PITCH
  if layout is Layout.TN:
    return up(rows), up(cols), contraction
  return rows, up(cols), up(contraction)


def pitch_padded_plan(layout: Layout, rows: int, cols: int, contraction: int, *, dtype,
                      out_dtype, device: Device, contraction_chunk: int | None,
                      split_chunks: bool | None = None) -> Plan | None:
  """The plan of a single GEMM whose operands' rows miss 16 bytes
  (:func:`operand_rows_miss_pitch`) run on copies padded to 16-byte pitches, or None
  where it is not taken: at least ``PITCH_PAD_MIN_MACS`` multiply-adds, in NN and TN
  over rows that are not whole words (:func:`rows_miss_words`) at least
  ``SPLIT_WORD_PAD_MIN_CONTRACTION`` indices, and the plan
  of the padded sizes (:func:`pitch_padded_sizes`, the same ``contraction_chunk``) is
  the Mosaic GPU kernel's (so a Hopper GPU and 16-bit operands), its stream tiles of
  at most ``hopper_matmul.LADDER_ROWS`` rows (:func:`mosaic_stream_tiles`) only above
  the rows of the Triton ladder's shortest tiles (``SMALLEST_LADDER_TILE``: up to
  those rows the ladder streams the unpadded weight about as fast as the copy costs)
  and where operand rows are not whole words (:func:`rows_miss_words`: Triton loads
  rows of whole words asynchronously, faster than the copy and the stream tiles), and
  for rows of whole words only over ``WHOLE_WORD_PAD_MIN_CONTRACTION`` indices or more
  and, in NN, above ``TALLEST_LADDER_TILE_ROWS`` rows; or, on a Hopper GPU, the Triton
  ladder's for an unchunked NT GEMM of rows not whole words, more rows than those
  tiles' and at most GPU_ONE_ROW_OF_TILES. Zero padding adds zero products in the
  contraction's last step and columns that are sliced off, so the bits are those of
  the unpadded GEMM on any kernel."""
  words_missed = rows_miss_words(layout, rows, cols, contraction, dtype)
  if rows * cols * contraction < PITCH_PAD_MIN_MACS or (
      words_missed and layout is not Layout.NT
      and contraction < SPLIT_WORD_PAD_MIN_CONTRACTION):
    return None
  sizes = pitch_padded_sizes(layout, rows, cols, contraction)
  padded = plan(layout, *sizes, dtype=dtype, out_dtype=out_dtype, device=device,
                contraction_chunk=contraction_chunk or sizes[2], split_chunks=split_chunks)
  sync_loads_above_shortest_tiles = rows > SMALLEST_LADDER_TILE[0] and words_missed
  if padded.kernel is Kernel.MOSAIC_GPU:
    # mosaic_stream_tiles' tiles (whole, or shares of 49-64 rows); stream tiles of more
    # rows are row_stream_tiles' shares, which the copies pay for like any other Mosaic
    # GPU tile.
    few_row_streams = padded.tiles.streams and rows <= mosaic.LADDER_ROWS
    copies_beat_async_loads = words_missed or (
        contraction >= WHOLE_WORD_PAD_MIN_CONTRACTION
        and (layout is not Layout.NN or rows > TALLEST_LADDER_TILE_ROWS))
    takes = sync_loads_above_shortest_tiles or (not few_row_streams and copies_beat_async_loads)
  else:
    takes = (layout is Layout.NT and contraction_chunk is None and device.is_hopper
             and sync_loads_above_shortest_tiles
             and rows <= pallas_triton.GPU_ONE_ROW_OF_TILES)
  return dataclasses.replace(padded, pitch_padded=True) if takes else None


def pad_to_pitch(layout: Layout, lhs, rhs):
  """``lhs`` and ``rhs`` (shaped as the module docstring says) zero-padded to the
  sizes of :func:`pitch_padded_sizes`: every axis of the result's columns, of the
  contraction (NN, NT) and of the result's rows (TN) a multiple of
  ``hopper_matmul.TMA_PITCH``."""
  lhs = pad_axis(lhs, 2, mosaic.TMA_PITCH)
  rhs = pad_axis(rhs, 2, mosaic.TMA_PITCH)
  if layout is not Layout.TN:
    rhs = pad_axis(rhs, 1, mosaic.TMA_PITCH)
  return lhs, rhs


def ladder_programs(tiles: MatmulTiles, rows: int, cols: int, groups: int = 1) -> int:
  """Programs of a Triton ladder grid: ``groups`` [rows, cols] results in ``tiles``."""
  return groups * cdiv(rows, tiles.block_m) * cdiv(cols, tiles.block_n)


def ladder_keeps(ladder: MatmulTiles, mosaic_tiles: mosaic.HopperTiles, rows: int,
                 cols: int, contraction: int, num_sms: int) -> bool:
  """Whether a single forward or dA of a [rows, cols] result over ``contraction``
  above ``hopper_matmul.LADDER_ROWS`` rows stays on the Triton ladder's tiles
  ``ladder`` rather than the Mosaic GPU kernel's pick ``mosaic_tiles``, on a GPU
  of ``num_sms`` SMs: where the ladder's tiles hold every row in one row of
  tiles, so that they stream the weight once, and the pick's are shorter than
  the rows and read it twice; the contraction is at least
  ``LADDER_MIN_CONTRACTION`` (over shorter ones the programs' fixed costs
  outweigh the second read); and the ladder's waves are at least
  ``LADDER_WAVE_FILL`` full and at least as full as the pick's."""
  if (ladder.block_m < rows or mosaic_tiles.block_m >= rows
      or contraction < LADDER_MIN_CONTRACTION):
    return False
  programs = ladder_programs(ladder, rows, cols)
  ladder_slots = cdiv(programs, num_sms) * num_sms
  mosaic_slots = (mosaic_tiles.waves(rows, cols, num_sms)
                  * mosaic_tiles.concurrent_ctas(num_sms))
  return (programs >= LADDER_WAVE_FILL * ladder_slots
          and programs * mosaic_slots >= mosaic_tiles.tile_count(rows, cols) * ladder_slots)


def triton_tiles(layout: Layout, rows: int, cols: int, dtype, out_dtype, groups: int = 1,
                 num_sms: int = pallas_triton.H100_SM_COUNT, *,
                 contraction: int | None = None, chunked: bool = False,
                 split_chunk: int | None = None) -> MatmulTiles:
  """The Triton kernels' GPU tiles (pallas_kernels.matmul's tables) for ``groups``
  GEMMs of a [rows, cols] result on a GPU of ``num_sms`` SMs, over ``contraction``
  if known; ``chunked`` (a chunked contraction in each program) keeps to the
  tiles whose accumulator fits twice (``holds_two_accumulators``);
  ``split_chunk``: the contraction in chunks of that length on programs of their
  own (``Plan.split_chunks``), each chunk a problem of its own.

  Up to GPU_ONE_ROW_OF_TILES rows, the smallest block_m that holds every row
  (for the forward and dA one row of tiles, so the weight streams from memory
  once); above, any ladder tile. Of those, the least estimated time:
  waves x (block_m + block_n + GPU_PROGRAM_OVERHEAD), where waves = ceil(the
  programs of all groups / num_sms) and a program's time is its operand
  rows per contraction step (the few-row GEMMs these tiles serve stream their
  operands; ties go to the larger tile). dB (TN) takes that tile for its
  [K, N] result with the tile's own stages: its contraction is the token count,
  which its tile never sees, so nothing else applies. The forward and dA take
  the tile's ``one_wave_stages`` when the grid is a single wave; over more
  waves, stages at which each SM's share of the programs (``waves``) fit its
  shared memory together, where at least ``RESIDENT_MIN_STAGES`` remain;
  stages are fitted to shared memory. In a single wave, tiles of at most
  GPU_ONE_ROW_OF_TILES rows over operand rows that are not whole words
  (:func:`rows_miss_words`) take ``DEEP_STEP_K``-deep steps on
  :func:`sync_load_warps`' warps; otherwise the smallest stages
  (``DEEP_STEP_STAGE_BYTES``) over a long ``contraction`` take deeper steps (the
  Pallas Triton kernel's ``step_k``):
  ``DEEP_STEP_K`` where their stages hold it whole (NN: with
  ``DEEP_STEP_SPARE_STAGES`` to spare), else ``STREAMED_STEP_K`` where every
  row of the operands and the result is a multiple of 16 bytes
  (``hopper_matmul.takes``; see pallas_kernels.matmul's constants;
  the jax-triton kernel and the PyTorch interop plan without ``contraction``, so
  with ``BLOCK_K`` steps).
  """
  program_contraction = contraction
  if split_chunk is not None:
    groups *= cdiv(contraction, split_chunk)
    program_contraction = split_chunk
  candidates = tuple(t for t in pallas_triton.GPU_MATMUL_LADDER
                     if not chunked or pallas_triton.holds_two_accumulators(t))
  if rows <= pallas_triton.GPU_ONE_ROW_OF_TILES:
    block_m = min(t.block_m for t in candidates if t.block_m >= rows)
    candidates = tuple(t for t in candidates if t.block_m == block_m)

  def waves(tiles):
    return cdiv(ladder_programs(tiles, rows, cols, groups), num_sms)

  def estimated_time(tiles):
    return waves(tiles) * (tiles.block_m + tiles.block_n + pallas_triton.GPU_PROGRAM_OVERHEAD)

  tiles = min(candidates, key=estimated_time)
  if layout is Layout.TN:
    return pallas_triton.fit_stages(tiles, dtype, out_dtype)
  if waves(tiles) == 1:
    tiles = dataclasses.replace(tiles, num_stages=tiles.one_wave_stages or tiles.num_stages)

  def stepped(step_k):
    return pallas_triton.fit_stages(dataclasses.replace(tiles, step_k=step_k), dtype, out_dtype)

  if waves(tiles) > 1:
    resident = pallas_triton.fit_stages(tiles, dtype, out_dtype, programs_per_sm=waves(tiles))
    if resident.num_stages >= pallas_triton.RESIDENT_MIN_STAGES:
      return resident
    return pallas_triton.fit_stages(tiles, dtype, out_dtype)
  if (contraction is not None and tiles.block_m <= pallas_triton.GPU_ONE_ROW_OF_TILES
      and rows_miss_words(layout, rows, cols, contraction, dtype)):
    tiles = dataclasses.replace(tiles, num_warps=sync_load_warps(tiles))
    return stepped(pallas_triton.DEEP_STEP_K)
  tiles = pallas_triton.fit_stages(tiles, dtype, out_dtype)
  if (program_contraction is None or program_contraction < pallas_triton.DEEP_STEP_MIN_CONTRACTION
      or tiles.stage_bytes(dtype) > pallas_triton.DEEP_STEP_STAGE_BYTES):
    return tiles

  deep = stepped(pallas_triton.DEEP_STEP_K)
  spare = 0 if layout is Layout.NT else pallas_triton.DEEP_STEP_SPARE_STAGES
  if cdiv(program_contraction, pallas_triton.DEEP_STEP_K) <= deep.num_stages - spare:
    return deep
  if mosaic.takes(layout, rows, cols, contraction):  # 16-byte rows: vector loads
    return stepped(pallas_triton.STREAMED_STEP_K)
  return tiles


def sync_load_warps(tiles: MatmulTiles) -> int:
  """The warps a Triton tile runs where operand rows are not whole words
  (:func:`rows_miss_words`) and each thread issues its share of the synchronous
  2-byte loads: at least SYNC_LOAD_MIN_WARPS, SYNC_LOAD_WIDE_WARPS on tiles at
  least SYNC_LOAD_WIDE_ASPECT times as wide as tall."""
  wide = tiles.block_n >= SYNC_LOAD_WIDE_ASPECT * tiles.block_m
  return max(tiles.num_warps, SYNC_LOAD_WIDE_WARPS if wide else SYNC_LOAD_MIN_WARPS)


def rows_miss_words(layout: Layout, rows: int, cols: int, contraction: int, dtype) -> bool:
  """Whether a row of the lhs or the rhs (``dtype`` elements, ``layout``'s
  minor dimensions) is not a whole number of WORD_BYTES-byte words: Triton
  copies no such row asynchronously, so its loads wait out their latency at
  each step."""
  itemsize = jnp.dtype(dtype).itemsize
  return any(minor * itemsize % WORD_BYTES
             for minor in layout.minor_dims(rows, cols, contraction))


def _mosaic_tiles(layout: Layout, rows: int, cols: int, contraction: int, dtype, out_dtype,
                  groups: int, device: Device, num_sms: int, ladder: MatmulTiles, *,
                  chunked: bool = False) -> mosaic.HopperTiles | None:
  """The Mosaic GPU kernel's tiles, or None where it does not run (see the module
  docstring): sizes it takes (``hopper_matmul.takes``) and a program tile that
  fits the result (``HopperTiles.fits``); the forward and dA above LADDER_ROWS
  rows but where the plan keeps the ``ladder``'s tiles (:func:`ladder_keeps`);
  ``chunked``: see :func:`triton_tiles`; the forward and dA of at most
  LADDER_ROWS rows only on :func:`mosaic_stream_tiles`' tiles, and up to
  ROW_STREAM_MAX_ROWS rows on :func:`row_stream_tiles`' where the pick's tiles fill
  less than ROW_STREAM_FILL of the SMs (:func:`fills_the_sms`)."""
  if groups != 1 or not _mosaic_takes(layout, rows, cols, contraction, dtype, device):
    return None
  rows_are_tokens = layout is not Layout.TN  # the forward and dA
  if rows_are_tokens and rows <= mosaic.LADDER_ROWS:
    return mosaic_stream_tiles(layout, rows, cols, contraction, dtype, out_dtype, num_sms,
                               ladder)
  tiles = mosaic_pick(layout, rows, cols, contraction, out_dtype, num_sms, chunked=chunked)
  if not tiles or (rows_are_tokens and ladder_keeps(ladder, tiles, rows, cols, contraction,
                                                    num_sms)):
    return None
  if (rows_are_tokens and rows <= ROW_STREAM_MAX_ROWS
      and mosaic.transposed_takes(layout, out_dtype)
      and not fills_the_sms(tiles, tiles.tile_count(rows, cols), num_sms, fill=ROW_STREAM_FILL)):
    shares = row_stream_tiles(rows, cols, num_sms, chunked=chunked)
    if shares:
      return pallas_triton.fit_stages(shares, dtype, out_dtype)
  return pallas_triton.fit_stages(mosaic_strips(tiles, rows, cols, contraction),
                                  dtype, out_dtype)


def row_stream_tiles(rows: int, cols: int, num_sms: int, *, chunked: bool = False
                     ) -> mosaic.HopperTiles | None:
  """The stream tiles (``hopper_matmul.stream_tiles``) of a share of ``rows``
  (rows / s rounded up to 8, s = 1, 2, ...) that cover a [rows, cols] result in
  the most CTAs one wave of ``num_sms`` SMs holds; ``chunked``: only tiles whose
  accumulator fits twice (``holds_two_accumulators``). None where no such tile fits
  in one wave."""
  best, most = None, 0
  for share in range(1, cdiv(rows, 8) + 1):
    tiles = mosaic.stream_tiles(cdiv(rows, share))
    ctas = tiles.tile_count(rows, cols)
    if most < ctas <= num_sms and (not chunked or pallas_triton.holds_two_accumulators(tiles)):
      best, most = tiles, ctas
  return best


def mosaic_stream_tiles(layout: Layout, rows: int, cols: int, contraction: int, dtype,
                        out_dtype, num_sms: int, ladder: MatmulTiles
                        ) -> mosaic.HopperTiles | None:
  """The stream tiles (``hopper_matmul.stream_tiles``) for a single forward or
  dA of a [rows, cols] result, at most ``hopper_matmul.LADDER_ROWS`` rows (above
  ``STREAM_ROWS`` over a share of the rows: :func:`row_stream_tiles`), over
  ``contraction`` that the Mosaic GPU kernel takes (:func:`_mosaic_takes`), with
  its stages fitted; or None where the Triton ladder runs it (``ladder``, its
  pick): a contraction shorter than STREAM_MIN_CONTRACTION (where the pick is the
  ladder's smallest tile, SMALLEST_LADDER_TILE: than the layout's
  SMALLEST_TILE_STREAM_MIN_CONTRACTION, or in NT where the ladder's programs
  fill at most half of ``num_sms``, than HALF_WAVE_NT_STREAM_MIN_CONTRACTION), a
  result narrower than a tile, or more tiles than ``num_sms`` (one wave)."""
  if (ladder.block_m, ladder.block_n) == SMALLEST_LADDER_TILE:
    least = SMALLEST_TILE_STREAM_MIN_CONTRACTION[layout]
    if layout is Layout.NT and 2 * ladder_programs(ladder, rows, cols) <= num_sms:
      least = HALF_WAVE_NT_STREAM_MIN_CONTRACTION
  else:
    least = STREAM_MIN_CONTRACTION
  if (rows > mosaic.LADDER_ROWS or contraction < least
      or not mosaic.transposed_takes(layout, out_dtype)):
    return None
  tiles = (row_stream_tiles(rows, cols, num_sms) if rows > STREAM_ROWS
           else mosaic.stream_tiles(rows))
  if not tiles or not tiles.fits(rows, cols) or tiles.tile_count(rows, cols) > num_sms:
    return None
  return pallas_triton.fit_stages(tiles, dtype, out_dtype)


def _mosaic_takes(layout: Layout, rows: int, cols: int, contraction: int, dtype,
                  device: Device) -> bool:
  """Whether the Mosaic GPU kernel runs on ``device`` with ``dtype`` operands and
  takes these sizes (``hopper_matmul.takes``)."""
  return (device.is_hopper and dtype in mosaic.DTYPES
          and mosaic.takes(layout, rows, cols, contraction))


def mosaic_pick(layout: Layout, rows: int, cols: int, contraction: int, out_dtype,
                num_sms: int, *, chunked: bool = False, units: int = 1
                ) -> mosaic.HopperTiles | None:
  """The tile :func:`mosaic_row_tiles` picks for a GEMM of a [rows, cols] result
  over ``contraction`` in ``layout`` with an ``out_dtype`` result (``units``
  work units a tile): with the operands' line alignment
  (``hopper_matmul.lines_aligned``) and the transposed tiles where they run
  (``hopper_matmul.transposed_takes``); before its strip order and stages."""
  lhs_aligned, rhs_aligned = mosaic.lines_aligned(layout, rows, cols, contraction)
  return mosaic_row_tiles(rows, cols, num_sms, lhs_aligned=lhs_aligned,
                          rhs_aligned=rhs_aligned,
                          transposed=mosaic.transposed_takes(layout, out_dtype),
                          chunked=chunked, units=units)


def splits_chunks(layout: Layout, rows: int, cols: int, contraction: int,
                  contraction_chunk: int, out_dtype, num_sms: int,
                  mosaic_split: mosaic.HopperTiles | None) -> bool:
  """Whether a single forward or dA of a [rows, cols] result whose
  ``contraction`` is summed in chunks of ``contraction_chunk`` runs its chunks on
  programs of their own: up to SPLIT_CHUNK_ROWS rows over at least
  SPLIT_MIN_CHUNKS chunks, on any kernel; above, over at least
  MANY_ROWS_SPLIT_MIN_CHUNKS chunks, only on the Mosaic GPU kernel
  (``mosaic_split``, :func:`mosaic_split_tiles`'s); up to TALL_SPLIT_ROWS rows
  unless the tiles of its in-program pick (:func:`mosaic_pick`) fill at least
  FULL_WAVE_FILL of the SMs over fewer than FULL_WAVE_SPLIT_MIN_CHUNKS chunks,
  above them only where those tiles fill less than IN_PROGRAM_SPLIT_FILL of the
  SMs (:func:`fills_the_sms`)."""
  chunks = contraction / contraction_chunk
  if rows <= SPLIT_CHUNK_ROWS:
    return chunks >= SPLIT_MIN_CHUNKS
  if chunks < MANY_ROWS_SPLIT_MIN_CHUNKS or not mosaic_split:
    return False
  if rows <= TALL_SPLIT_ROWS and chunks >= FULL_WAVE_SPLIT_MIN_CHUNKS:
    return True
  in_program = mosaic_pick(layout, rows, cols, contraction, out_dtype, num_sms, chunked=True)
  fill = FULL_WAVE_FILL if rows <= TALL_SPLIT_ROWS else IN_PROGRAM_SPLIT_FILL
  return in_program is not None and not fills_the_sms(
      in_program, in_program.tile_count(rows, cols), num_sms, fill=fill)


def fills_the_sms(tiles: mosaic.HopperTiles, ctas: int, num_sms: int, fill: float) -> bool:
  """Whether ``ctas`` CTAs of ``tiles`` fill at least ``fill`` of the CTA slots
  that a GPU of ``num_sms`` SMs runs at once."""
  return ctas >= fill * tiles.concurrent_ctas(num_sms)


def mosaic_split_tiles(layout: Layout, rows: int, cols: int, contraction: int,
                       contraction_chunk: int, dtype, device: Device, num_sms: int
                       ) -> mosaic.HopperTiles | None:
  """The Mosaic GPU kernel's tiles for a single chunked contraction whose chunks
  run on programs of their own (each chunk of each tile a work unit, float32
  partials: ``hopper_matmul.matmul``'s ``split_chunks``), or None where such a
  split runs on the Triton ladder instead: a device, dtype or sizes the kernel
  does not take (module docstring), no tile that fits, or, up to
  SPLIT_CHUNK_ROWS rows, units of the pick that fill less than MOSAIC_SPLIT_FILL
  of the SMs (:func:`fills_the_sms`). The pick is :func:`mosaic_pick`'s over the units
  (``units`` = the chunks) for the float32 partials, so among tiles that are not
  transposed, whatever their accumulator."""
  if not _mosaic_takes(layout, rows, cols, contraction, dtype, device):
    return None
  units = cdiv(contraction, contraction_chunk)
  tiles = mosaic_pick(layout, rows, cols, contraction, jnp.float32, num_sms, units=units)
  if not tiles or (rows <= SPLIT_CHUNK_ROWS
                   and not fills_the_sms(tiles, tiles.tile_count(rows, cols) * units, num_sms,
                                         fill=MOSAIC_SPLIT_FILL)):
    return None
  return pallas_triton.fit_stages(tiles, dtype, jnp.float32)


def mosaic_strips(tiles: mosaic.HopperTiles, rows: int, cols: int, contraction: int
                  ) -> mosaic.HopperTiles:
  """``tiles`` with the order its programs take a rows x cols result's tiles in
  (``HopperTiles.strip_dim`` and ``strip_width``; the order changes no sum).

  The tiles' own order, strips of row tiles walked across the columns, suits a
  contraction long enough to keep the tensor cores busy. Over a short one (at
  most ``hopper_matmul.SHORT_CONTRACTION``: dB over a few hundred tokens) a
  program's work is a few steps, and the kernel is bound by moving the rhs and
  the result. Where the result has more tile columns than tile rows, row strips
  re-read the whole rhs once per strip; strips ``COLUMN_STRIP_WIDTH`` tile
  columns wide, walked down the rows, read each rhs block about once while it
  is hot in L2."""
  short = contraction <= mosaic.SHORT_CONTRACTION
  if short and cdiv(cols, tiles.block_cols) > cdiv(rows, tiles.block_m):
    return dataclasses.replace(tiles, strip_dim=1, strip_width=mosaic.COLUMN_STRIP_WIDTH)
  return tiles


def mosaic_tile_candidates(rhs_aligned: bool, transposed: bool = False,
                           lhs_aligned: bool = True, chunked: bool = False
                           ) -> tuple[mosaic.HopperTiles, ...]:
  """The Mosaic GPU tiles the plan chooses among: the ROW_TILES entries; with
  ``transposed`` (the forward and dA with a 16-bit result) also the
  TRANSPOSED_TILES; where the rhs's rows do not start on 128-byte lines (not
  ``rhs_aligned``, see ``hopper_matmul.lines_aligned``) also the ``multicast``
  twins of all of these. A transposed twin both fills the last wave and halves
  the rhs lines each SM reads: on the H100 it made 26 unaligned GEMMs, forward
  and dA, 1-36% faster than the plain twins (benchmarks/results/h100.md,
  thirty-seventh section). Where the lhs's rows miss the lines too (not
  ``lhs_aligned``), also their 2 x 2 twins (``multicast_lhs`` as well), which
  share the lhs blocks too: on the H100 14 of 15 such GEMMs ran 2-32% faster
  than the pairs' picks, one 6% slower (same section). ``chunked``: only the
  tiles whose accumulator fits twice (``holds_two_accumulators``)."""
  base = tuple(t for t in mosaic.ROW_TILES + (mosaic.TRANSPOSED_TILES if transposed else ())
               if not chunked or pallas_triton.holds_two_accumulators(t))
  candidates = base
  if not rhs_aligned:
    candidates += tuple(dataclasses.replace(t, multicast=True) for t in base)
  if not (rhs_aligned or lhs_aligned):
    candidates += tuple(dataclasses.replace(t, multicast=True, multicast_lhs=True)
                        for t in base)
  return candidates


def mosaic_row_tiles(rows: int, cols: int, num_sms: int, *, lhs_aligned: bool = True,
                     rhs_aligned: bool = True, transposed: bool = False, chunked: bool = False,
                     units: int = 1) -> mosaic.HopperTiles | None:
  """The tile of :func:`mosaic_tile_candidates` that fits a rows x cols result
  (``HopperTiles.fits``) with the least estimated time, or None if none fits
  (``*_aligned``: ``hopper_matmul.lines_aligned``; ``transposed``: whether the
  transposed tiles may run; ``chunked``: see :func:`mosaic_tile_candidates`;
  ``units``: work units a tile, the chunks of a split).
  Estimated time: waves x tile area / ``HopperTiles.rate``, where waves =
  ceil(CTA tiles x units / the CTAs that run at once,
  ``HopperTiles.concurrent_ctas``).
  No program takes part of another's contraction, so the choice is
  about filling the last wave: the transposed tiles' row counts, any multiple
  of 8, let the tiles fill it closely.

  Estimates equal to within ``TIED_ESTIMATES`` tie (as 112 and 168 rows of
  1000 do in 3 and 2 waves). A tie goes to the tile with the smallest cluster
  (a cluster's CTAs wait on each other, which the estimate leaves out), then to
  the largest tile: fewer tiles fill and drain their pipelines fewer times and
  read fewer operand lines per FLOP (200 x 256 over 120 x 256 on 3000 rows of
  a 128,256-column LM head was 8% faster), then to the earlier candidate."""
  estimates = mosaic_tile_estimates(rows, cols, num_sms, lhs_aligned=lhs_aligned,
                                    rhs_aligned=rhs_aligned, transposed=transposed,
                                    chunked=chunked, units=units)
  if not estimates:
    return None
  least = min(estimates.values())
  tied = [t for t, time in estimates.items() if time <= least * (1 + TIED_ESTIMATES)]
  return min(tied, key=lambda t: (t.cluster_size, -t.block_m * t.block_cols))


def mosaic_tile_estimates(rows: int, cols: int, num_sms: int, *, lhs_aligned: bool = True,
                          rhs_aligned: bool = True, transposed: bool = False,
                          chunked: bool = False, units: int = 1
                          ) -> dict[mosaic.HopperTiles, float]:
  """Each tile of :func:`mosaic_tile_candidates` that fits a rows x cols result,
  with its estimated time (:func:`mosaic_row_tiles`, which takes the least)."""
  def estimated_time(tiles):
    return (tiles.waves(rows, cols, num_sms, units) * tiles.block_m * tiles.block_cols
            / tiles.rate(lhs_aligned, rhs_aligned))

  return {t: estimated_time(t)
          for t in mosaic_tile_candidates(rhs_aligned, transposed, lhs_aligned, chunked)
          if t.fits(rows, cols)}


def launch(plan_: Plan, lhs, rhs, *, layout: Layout, out_dtype, precision=None):
  """Runs ``plan_`` on operands shaped as the module docstring says; returns
  [G, rows, cols] in ``out_dtype``. ``precision`` applies to float32 operands
  (the Mosaic GPU kernel takes only 16-bit ones). Under ``vmap`` the Mosaic GPU
  kernel re-plans: a shared rhs folds the mapped axis into rows, anything else
  becomes groups (Triton). A ``pitch_padded`` plan runs on the operands padded
  by :func:`pad_to_pitch` and returns the result sliced to the unpadded size."""
  out_dtype = jnp.dtype(out_dtype)
  if plan_.pitch_padded:
    rows = lhs.shape[2] if layout is Layout.TN else lhs.shape[1]
    cols = rhs.shape[1] if layout is Layout.NT else rhs.shape[2]
    out = launch(dataclasses.replace(plan_, pitch_padded=False), *pad_to_pitch(layout, lhs, rhs),
                 layout=layout, out_dtype=out_dtype, precision=precision)
    return out[:, :rows, :cols]
  if plan_.kernel is Kernel.MOSAIC_GPU:
    return _mosaic_launcher(layout, out_dtype, plan_.tiles, plan_.contraction_chunk,
                            plan_.split_chunks)(lhs, rhs)
  if plan_.kernel is Kernel.JAX_TRITON:
    from pallas_kernels import jax_triton_matmul
    if layout is Layout.TN:
      return jax_triton_matmul.matmul_at_b(lhs, rhs, out_dtype=out_dtype, precision=precision,
                                           tiles=plan_.tiles)
    return jax_triton_matmul.matmul(lhs, rhs, transpose_b=layout is Layout.NT,
                                    out_dtype=out_dtype, precision=precision, tiles=plan_.tiles,
                                    contraction_chunk=plan_.contraction_chunk)
  if layout is Layout.TN:
    return pallas_triton.matmul_at_b(lhs, rhs, out_dtype=out_dtype, precision=precision,
                                     tiles=plan_.tiles, interpret=plan_.interpret)
  gemm = pallas_triton.matmul_chunks if plan_.split_chunks else pallas_triton.matmul
  return gemm(lhs, rhs, transpose_b=layout is Layout.NT, out_dtype=out_dtype,
              precision=precision, tiles=plan_.tiles, interpret=plan_.interpret,
              contraction_chunk=plan_.contraction_chunk)


@functools.cache
def _mosaic_launcher(layout: Layout, out_dtype, tiles: mosaic.HopperTiles,
                     contraction_chunk: int | None, split_chunks: bool):
  """The Mosaic GPU kernel on [1, ...] operands, with a vmap rule that re-plans
  with the same chunks (a chunk as long as the contraction: none)."""

  @jax.custom_batching.custom_vmap
  def mosaic_gemm(lhs, rhs):
    return mosaic.matmul(lhs[0], rhs[0], layout=layout, out_dtype=out_dtype, tiles=tiles,
                         contraction_chunk=contraction_chunk, split_chunks=split_chunks)[None]

  @mosaic_gemm.def_vmap
  def mosaic_gemm_batched(axis_size, in_batched, lhs, rhs):
    lhs_batched, rhs_batched = in_batched
    lhs = lhs if lhs_batched else jnp.broadcast_to(lhs, (axis_size, *lhs.shape))
    chunk = contraction_chunk or lhs.shape[2 if layout is Layout.TN else 3]
    if layout is not Layout.TN and not rhs_batched:
      rows = lhs.shape[2]
      folded = lhs.reshape(1, axis_size * rows, lhs.shape[3])
      out = run(layout, folded, rhs, out_dtype=out_dtype, contraction_chunk=chunk)
      return out.reshape(axis_size, 1, rows, -1), True
    rhs = rhs if rhs_batched else jnp.broadcast_to(rhs, (axis_size, *rhs.shape))
    grouped = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in (lhs, rhs)]
    out = run(layout, *grouped, out_dtype=out_dtype, contraction_chunk=chunk)
    return out.reshape(axis_size, 1, *out.shape[1:]), True

  return mosaic_gemm


def run(layout: Layout, lhs, rhs, *, out_dtype, precision=None, backend: str = "pallas",
        interpret: bool = False, contraction_chunk: int | None = None):
  """Plans and runs the ``G`` GEMMs of operands shaped as the module docstring
  says (their shapes give rows, cols, contraction and groups); returns
  [G, rows, cols] in ``out_dtype``. ``contraction_chunk``: see :func:`plan`."""
  if layout is Layout.TN:
    contraction, rows = lhs.shape[1:]
  else:
    rows, contraction = lhs.shape[1:]
  cols = rhs.shape[1] if layout is Layout.NT else rhs.shape[2]
  chosen = plan(layout, rows, cols, contraction, dtype=lhs.dtype, out_dtype=out_dtype,
                groups=lhs.shape[0], backend=backend, interpret=interpret,
                contraction_chunk=contraction_chunk)
  return launch(chosen, lhs, rhs, layout=layout, out_dtype=out_dtype, precision=precision)
