"""Flash attention whose every query row is bitwise the same in prefill, chunked
prefill and decode.

Layout: the queries of one kv head are *packed rows*: query ``[B, T, N, H]`` with
N = K * G (G query heads share a kv head) becomes ``[B, K, T * G, H]``, row
``r = t * G + g`` (:func:`pack_rows`). A program owns ``block_q`` rows of one
(sequence, kv head); a decode step (T = 1) fills G of them, the rest are
masked. Key and value stay in their ``[B, S, K, H]`` layout.

Numerics contract (what makes a row's bits independent of T, B, S and of where
the row sits in its tile):
  * Logits are ``s = (q . k) * scale * log2(e)`` in float32 (exponentials are
    base 2). A masked key (position >= the sequence's valid length, or, with
    ``causal``, position > ``query_offset + t``) has ``s = -inf`` and
    contributes exactly zero; its key/value are never loaded, so garbage (NaN)
    there changes nothing.
  * Keys are visited in blocks of ``block_k`` aligned to absolute positions
    (block j holds keys [j * block_k, (j + 1) * block_k)), in increasing order,
    grouped into *chunks* of ``chunk_k`` keys. Every chunk starts from the empty
    state (m = -inf, l = 0, acc = 0); one block step updates a row's
    (max m, sum l, acc) online: ``acc`` is rescaled by the block's ``alpha``
    and ``p @ V`` accumulates onto it in the dot's own k16 chain (Triton folds
    ``acc + p @ V`` into the MMA's accumulator, as in the GEMM and the
    backward; Mosaic GPU's wgmma accumulates into it), and the row sum of a
    block is taken on the tensor cores from the same rounded probabilities that
    multiply V (``max_j (p @ ones[block_k, 16])[:, j]``: 16 equal columns, max
    is exact).
    Chunk states are merged into the running total in increasing chunk order
    by :func:`merge_states`, then the total is normalised by :func:`finalize_state`. The
    prefill kernel merges in-kernel; the split kernel writes each chunk's float32
    state and :func:`attention_combine_kernel` merges them with the same
    :func:`merge_states` and :func:`finalize_state`. So both paths give the same bits.
  * A block or a chunk that is fully masked for a row is an exact no-op on that
    row's state (alpha = exp2(0) = 1, p = 0: a product by 1 and zeros added), so
    loop bounds (causal skipping, the valid length, the tile's last row) may
    differ between calls without changing a bit.
  * Tile shapes, dtypes and warps come from :func:`attention_tiles`: a function
    of the head size, dtype and device only, except the forward's row tile,
    which shrinks for calls with few rows (:meth:`AttentionTiles.for_rows`).
    A row's arithmetic is the same in every row tile, wherever it sits in it:
    its max is exact, its products are the same instructions, and each dot
    contracts in the same k16 steps whether Triton picks wgmma (64-row
    warpgroups) or mma for the tile, as in the GEMM, where every tile gives the
    same bits. The GPU test checks it: decode steps (a 16-row tile) against a
    64-row prefill (wgmma), bf16 and float32; bf16's 16 against 128 rows (two
    warpgroups, the tile before) passed too.
  * On the GPU every float32 product that meets an add carries an explicit
    rounding mode: the logit scaling, the block's ``acc * alpha`` and the
    merge's rescaling products are ``mul.rn.f32``, the state updates
    (``l * alpha + l_block`` and the merge's) one ``fma.rn.f32`` each, the
    normalisation ``acc / l`` a product by the row's IEEE reciprocal and an
    ``fma.rn.f32`` correction (:func:`corrected_quotient`; ``multiply``,
    ``multiply_add``, ``divide``), the exponentials ``ex2.approx.ftz.f32`` (libdevice's ``exp2f``)
    and the log-sum-exp's logarithm ``lg2.approx.ftz.f32`` (:class:`Float32Ops`
    names them per kernel language). Neither LLVM nor ptxas contracts such an
    instruction, whereas a plain ``mul.f32`` feeding an ``add.f32`` may become
    an FMA or not depending on the code around it; so one line of Python
    rounds the same in every kernel that runs it. In interpret mode the
    products go through ``uncontracted`` so XLA:CPU cannot contract them
    differently in different programs.
  * At a given row count, the prefill, split and combine kernels launch with
    the same warps (the split path may prefetch more stages, which changes no
    arithmetic), and the prefill and split kernels issue the same dots from
    the same tiles (``[block_q, W] x [W, block_k]``, ``[block_q, block_k] x
    [block_k, W]`` and ``x [block_k, 16]``), so Triton picks the same MMA
    instruction and layout for both. Float32 dots are IEEE (precision
    HIGHEST, FMAs in increasing k), never TF32.

Every Triton kernel runs on a grid (programs along the query rows or keys,
sequences, kv heads) whose sequence axis is bucketed, with the sequence count an
operand (``_common.counted_axis_call``; a kernel reads its grid position from
``program_ids``): a decode step at any batch size of a bucket runs the same
compiled kernels.

Kernels:
  * :func:`attention_forward_kernel` - prefill: all chunks of a row tile. On
    an H100 a large prefill runs instead on the Mosaic GPU kernel of
    :mod:`pallas_kernels.attention_hopper`, which gives its bits
    (:func:`use_mosaic_prefill`).
  * :func:`attention_split_kernel` - one chunk of a row tile (decode: parallel
    over the key sequence); :func:`attention_combine_kernel` merges them.
  * :func:`attention_delta_kernel`, :func:`attention_dkdv_kernel`,
    :func:`attention_dq_kernel` - the backward from the saved log-sum-exp:
    dK/dV per key block over query row blocks in increasing order, dQ per row
    block over key blocks in increasing order. No atomics. On an H100 the dK/dV
    and dQ kernels of a large backward run on Mosaic GPU twins with their bits
    (:func:`use_mosaic_backward`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import (block_mask, cdiv, compiler_params, counted_axis_call,
                                    divide, dot_f32, launcher, load_block, log2_approx,
                                    lookup_tiles, multiply, multiply_add, store_block,
                                    uncontracted)
from pallas_kernels.matmul_plan import Device

LOG2E = math.log2(math.e)
ONES_COLUMNS = 16  # width of the ones matrix whose product gives the row sums
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
  """Forward: ``block_q`` packed rows x ``block_k`` keys per step, chunks of
  ``chunk_k`` keys, Triton warps/stages; calls with fewer rows take a row tile
  down to ``min_block_q`` (:meth:`for_rows`). The split path runs with
  ``split_stages`` (default ``num_stages``), and its combine kernel merges
  ``combine_cols`` columns a program. Backward: ``bwd_block_q`` rows x
  ``bwd_block_k`` keys for the dK/dV, dQ and delta kernels."""
  block_q: int
  block_k: int
  chunk_k: int
  num_warps: int
  num_stages: int
  bwd_block_q: int
  bwd_block_k: int
  bwd_warps: int
  bwd_stages: int
  min_block_q: int = 16
  combine_cols: int = 32
  split_stages: int | None = None

  def for_rows(self, rows: int) -> AttentionTiles:
    """The forward's tiles for ``rows`` packed rows per (sequence, kv head): the
    smallest power-of-two row tile from ``min_block_q`` up to ``block_q`` that
    holds them (with at most 4 warps when smaller than ``block_q``), so that a
    decode step (G rows) does not compute a 128-row tile. A row's bits do not
    depend on the row tile (module docstring)."""
    block_q = min(self.block_q, max(self.min_block_q, pl.next_power_of_2(rows)))
    if block_q == self.block_q:
      return self
    return dataclasses.replace(self, block_q=block_q, num_warps=min(self.num_warps, 4))


# GPU tiles, one table per input width: ``(largest padded head size served,
# tiles)`` pairs read by ``lookup_tiles``. The 16-bit H = 128 entry is the best
# of the H100 sweeps in benchmarks/results/h100.md (seventeenth and eighteenth
# sessions: a 64-row forward tile with 4 warps and 2 stages beat 128 rows with 8
# warps by 2-6% at B = 1 and 4; the split path's decode of one sequence was 20-30%
# slower with 2 stages than with 3); the others follow the Triton flash-attention
# tutorial and jax's Pallas attention, smaller where float32 or a 256-wide head
# would exhaust registers and shared memory. chunk_k = 512 gives a 32,768-key
# decode 64 chunks per (sequence, kv head) (1024 made the prefill 3% faster and
# a 4096-key decode of one sequence 20% slower). block_k = 128 is the Mosaic
# prefill's key block (pallas_kernels.attention_hopper; 2-14% faster than 64 on
# the H100, thirty-eighth session). The row tile, warps and stages do not change
# a row's bits; block_k and chunk_k do, never invariance.
GPU_TILES_16BIT: tuple[tuple[int, AttentionTiles], ...] = (
    (64, AttentionTiles(128, 128, 512, 4, 3, 64, 64, 4, 2)),
    (128, AttentionTiles(64, 128, 512, 4, 2, 64, 64, 4, 2, split_stages=3)),
    (256, AttentionTiles(64, 32, 512, 4, 2, 32, 32, 4, 1)),
)
GPU_TILES_32BIT: tuple[tuple[int, AttentionTiles], ...] = (
    (128, AttentionTiles(64, 32, 512, 4, 2, 32, 32, 4, 1)),
    (256, AttentionTiles(32, 32, 512, 4, 1, 16, 16, 4, 1)),
)

# Interpret mode (CPU): small blocks so that tiny test shapes run several row
# tiles, key blocks and chunks.
INTERPRET_TILES = AttentionTiles(16, 8, 16, 4, 1, 16, 8, 4, 1, min_block_q=8, combine_cols=8)

# The split (decode) path runs when one row tile holds all of a (sequence, kv
# head)'s rows and the prefill grid would give fewer programs than this (two
# waves of the H100's 132 SMs). Both paths give the same bits.
SPLIT_BELOW_PROGRAMS = 264
# Chunk states the combine kernel loads at once, while it merges the ones before
# them in order (loading and merging one at a time, a 32,768-key decode step's
# combine took 26 us, its split kernel 50 us).
COMBINE_UNROLL = 8


def padded_head_dim(head_dim: int) -> int:
  return max(16, pl.next_power_of_2(head_dim))


def attention_tiles(head_dim: int, dtype, *, interpret: bool) -> AttentionTiles:
  """The tiles for ``head_dim`` and ``dtype``; never a function of B, T or S."""
  if interpret:
    return INTERPRET_TILES
  table = GPU_TILES_32BIT if jnp.dtype(dtype).itemsize == 4 else GPU_TILES_16BIT
  return lookup_tiles(table, padded_head_dim(head_dim))


def use_split(rows: int, batch: int, kv_heads: int, seq: int, tiles: AttentionTiles) -> bool:
  """Whether the split-KV path serves this call; a function of shapes only, and
  either choice gives the same bits."""
  return (rows <= tiles.block_q and batch * kv_heads < SPLIT_BELOW_PROGRAMS
          and seq > tiles.chunk_k)


def pack_rows(x, kv_heads: int):
  """[B, T, N, H] -> [B, K, T * G, H], row t * G + g holding head k * G + g."""
  b, t, n, h = x.shape
  g = n // kv_heads
  return x.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, h)


def unpack_rows(x, seq_len: int):
  """Inverse of :func:`pack_rows`: [B, K, T * G, H] -> [B, T, K * G, H]."""
  b, k, r, h = x.shape
  g = r // seq_len
  return x.reshape(b, k, seq_len, g, h).transpose(0, 2, 1, 3, 4).reshape(b, seq_len, k * g, h)


# ---------------------------------------------------------------------------
# Elementwise pieces shared by every kernel.


def _logits(q, k, st: _Static):
  """Base-2 logits ``(q . k) * scale * log2(e)`` in float32, the scaling rounded
  on its own (never fused into the ``s - max`` that follows)."""
  return multiply(dot_f32(q, k, trans_b=True, precision=st.precision), st.scale * LOG2E,
                  native=st.native)


def _finite_or_zero(m):
  """The shift of a row's exponentials: its max, or 0 when the row has none yet
  (so exp2(-inf - 0) = 0 instead of NaN)."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def _empty_state(rows: int, width: int):
  return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, width), jnp.float32))


@dataclasses.dataclass(frozen=True)
class Float32Ops:
  """The float32 operations of :func:`merge_states` and :func:`finalize_state`,
  one set per kernel language, each rounding exactly as the numerics contract
  says (module docstring): ``mul`` and ``fma`` rounded once (``mul.rn``,
  ``fma.rn``), ``quotient(acc, l)`` a [rows, W] block divided by its [rows]
  divisors (:func:`corrected_quotient` on the GPU, IEEE division in interpret
  mode), ``exp2`` and ``log2`` the approximate base-2 instructions with
  subnormals flushed (``ex2.approx.ftz``, ``lg2.approx.ftz``), and
  ``rows(x, shape)`` a [rows] vector broadcast along the columns of a [rows, W]
  block. The Mosaic GPU prefill kernel has its own set
  (:mod:`pallas_kernels.attention_hopper`); both give the same bits."""
  mul: Callable
  fma: Callable
  quotient: Callable
  exp2: Callable
  log2: Callable
  rows: Callable


@functools.cache
def triton_ops(native: bool) -> Float32Ops:
  """The Triton kernels' :class:`Float32Ops` (``native``: on the GPU, else interpret
  mode). ``jnp.exp2`` lowers to libdevice's ``exp2f``, which is ``ex2.approx.ftz``."""
  mul = functools.partial(multiply, native=native)
  fma = functools.partial(multiply_add, fused=native)

  def rows(x, shape):
    return x[:, None]

  def quotient(acc, l):
    if native:
      return corrected_quotient(acc, l, mul=mul, fma=fma, rows=rows,
                                rcp=functools.partial(divide, 1.0, native=True))
    return divide(acc, rows(l, acc.shape), native=False)

  return Float32Ops(mul=mul, fma=fma, quotient=quotient, exp2=jnp.exp2,
                    log2=functools.partial(log2_approx, native=native), rows=rows)


def corrected_quotient(acc, l, *, mul, fma, rcp, rows):
  """``acc / l`` for a [rows, W] block and its [rows] divisors: ``q = acc * r``
  for the row's IEEE reciprocal ``r = rcp(l)``, corrected once,
  ``q + (acc - q * l) * r`` with two fused multiply-adds. That is the IEEE
  quotient wherever it is a normal float32 (Markstein's theorem), in three
  instructions an element instead of a division's longer sequence (its cost in the
  Mosaic prefill: benchmarks/results/h100.md). Both GPU kernel languages run it,
  so their bits agree by construction."""
  divisor, reciprocal = (rows(x, acc.shape) for x in (l, rcp(l)))
  estimate = mul(acc, reciprocal)
  return fma(fma(-estimate, divisor, acc), reciprocal, estimate)


def merge_states(total, part, ops: Float32Ops):
  """Merges a chunk's (m, l, acc) into the running total: the one merge of every
  path. Merging an empty chunk (-inf, 0, 0) leaves the total's bits unchanged."""
  m_tot, l_tot, acc_tot = total
  m_part, l_part, acc_part = part
  m_new = jnp.maximum(m_tot, m_part)
  shift = _finite_or_zero(m_new)
  alpha = ops.exp2(m_tot - shift)
  beta = ops.exp2(m_part - shift)
  l_new = ops.fma(l_tot, alpha, ops.mul(l_part, beta))
  acc_new = ops.fma(acc_tot, ops.rows(alpha, acc_tot.shape),
                    ops.mul(acc_part, ops.rows(beta, acc_tot.shape)))
  return m_new, l_new, acc_new


def finalize_state(state, ops: Float32Ops):
  """(m, l, acc) -> (acc / l, base-2 log-sum-exp). A row without a valid key
  gives zeros and a log-sum-exp of +inf (the backward then recomputes p = 0)."""
  m, l, acc = state
  has_keys = l > 0
  l_or_one = jnp.where(has_keys, l, 1.0)
  out = ops.quotient(acc, l_or_one)
  lse = jnp.where(has_keys, ops.log2(l_or_one) + m, jnp.inf)
  return out, lse


def _row_positions(row_start, block_q: int, group: int, offset):
  """Absolute position of each packed row of a tile: offset + r // G."""
  return offset + (row_start + jnp.arange(block_q)) // group


def _key_limit(kv_len, seq: int):
  return jnp.clip(kv_len, 0, seq)


def _int_select(cond, if_true: int, if_false: int):
  """``where(cond, if_true, if_false)`` for two static ints, as int32 constants:
  the Triton lowering of ``select_n`` gives a weakly typed literal operand the
  predicate's type (i1), which the Triton verifier then rejects."""
  return jnp.where(cond, jnp.int32(if_true), jnp.int32(if_false))


def _causal_limit(key_limit, offset, last_row, group: int):
  """Keys any row up to ``last_row`` may see: positions < offset + last_t + 1."""
  return jnp.clip(offset + last_row // group + 1, 0, key_limit)


@dataclasses.dataclass(frozen=True)
class _Static:
  """What every kernel needs to know besides refs: sizes, flags and tiles."""
  rows: int        # packed rows per (sequence, kv head): T * G
  group: int       # G
  seq: int         # S
  head_dim: int    # H (the refs are padded_head_dim wide)
  causal: bool
  scale: float
  precision: lax.Precision | None
  native: bool
  tiles: AttentionTiles

  @property
  def width(self) -> int:
    return padded_head_dim(self.head_dim)

  @property
  def head_cols(self):
    return None if self.width == self.head_dim else jnp.arange(self.width) < self.head_dim


def _block_step(kb, state, *, q, k_ref, v_ref, base, row_pos, key_limit, masked: bool,
                st: _Static):
  """One online-softmax step over key block ``kb`` (keys base + kb * block_k ...)
  of refs whose first key is absolute position ``base``. ``masked=False`` is for
  blocks every row of the tile sees whole: it skips the masks, which would keep
  every logit anyway, so the bits are the same."""
  bk = st.tiles.block_k
  m, l, acc = state
  local = pl.multiple_of(kb * bk, bk)
  keys = base + local + jnp.arange(bk)
  key_ok = keys < key_limit if masked else None
  k = load_block(k_ref.at[pl.ds(local, bk), :], rows=key_ok, cols=st.head_cols)
  v = load_block(v_ref.at[pl.ds(local, bk), :], rows=key_ok, cols=st.head_cols)
  s = _logits(q, k, st)
  if masked:
    mask = key_ok[None, :]
    if st.causal:
      mask = mask & (keys[None, :] <= row_pos[:, None])
    s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  shift = _finite_or_zero(m_new)
  alpha = jnp.exp2(m - shift)
  p = jnp.exp2(s - shift[:, None]).astype(v.dtype)
  ones = jnp.ones((bk, ONES_COLUMNS), v.dtype)
  l_block = jnp.max(uncontracted(dot_f32(p, ones, precision=st.precision), native=st.native),
                    axis=1)
  acc = multiply(acc, alpha[:, None], native=st.native)
  return (m_new, multiply_add(l, alpha, l_block, fused=st.native),
          acc + uncontracted(dot_f32(p, v, precision=st.precision), native=st.native))


def _chunk_state(q, k_ref, v_ref, *, base, first_block, end_block, clear_end, row_pos,
                 key_limit, st: _Static):
  """The state of one chunk: key blocks [first_block, end_block) from empty, in
  order; those below ``clear_end`` are seen whole by every row (no masks)."""
  step = functools.partial(_block_step, q=q, k_ref=k_ref, v_ref=v_ref, base=base,
                           row_pos=row_pos, key_limit=key_limit, st=st)
  middle = jnp.clip(clear_end, first_block, end_block)
  state = lax.fori_loop(first_block, middle, functools.partial(step, masked=False),
                        _empty_state(st.tiles.block_q, st.width))
  return lax.fori_loop(middle, end_block, functools.partial(step, masked=True), state)


def tile_key_bounds(row_start, block_rows: int, kv_len, offset, st: _Static):
  """(key limit, bound, clear) of the tile of ``block_rows`` packed rows from
  ``row_start`` (the first of them inside the array): keys at or past the limit
  are invalid, no row of the tile sees a key at or past the bound, and every row
  sees every key below ``clear``."""
  key_limit = _key_limit(kv_len, st.seq)
  bound = clear = key_limit
  if st.causal:
    last_row = jnp.minimum(row_start + block_rows, st.rows) - 1
    bound = _causal_limit(key_limit, offset, last_row, st.group)
    clear = _causal_limit(key_limit, offset, row_start, st.group)
  return key_limit, bound, clear


def key_tile_row_bounds(key_start, block_keys: int, block_rows: int, key_limit, offset,
                        st: _Static):
  """(first, clear, end) in row blocks of ``block_rows`` packed rows, for the
  ``block_keys`` keys from ``key_start``: the dK/dV kernels sum the row blocks
  from first to end (all of them) in order, masking those before clear; row
  blocks before first see none of these keys, those from clear on see all of
  them, all valid. Keys wholly at or past the key limit get first = clear = end."""
  end = cdiv(st.rows, block_rows)
  first = 0
  if st.causal:
    first = jnp.clip((key_start - offset) * st.group, 0, st.rows) // block_rows
  first = jnp.maximum(first, _int_select(key_start < key_limit, 0, end))
  clear = first
  if st.causal:
    last_key_rows = jnp.maximum((key_start + block_keys - 1 - offset) * st.group, 0)
    clear = jnp.clip((last_key_rows + block_rows - 1) // block_rows, first, end)
  clear = jnp.maximum(clear, _int_select(key_start + block_keys <= key_limit, 0, end))
  return first, clear, end


def _tile_setup(lens_ref, offs_ref, q_ref, row_tile, st: _Static):
  """The tile's query block, row positions/mask and its key bounds."""
  bq = st.tiles.block_q
  row_start = row_tile * bq
  offset = offs_ref[0]
  rows_ok = block_mask(row_start, bq, st.rows) if st.rows % bq else None
  q = load_block(q_ref, rows=rows_ok, cols=st.head_cols)
  row_pos = _row_positions(row_start, bq, st.group, offset)
  key_limit, bound, clear = tile_key_bounds(row_start, bq, lens_ref[0], offset, st)
  return q, rows_ok, row_pos, key_limit, bound, clear // st.tiles.block_k


def attention_forward_kernel(lens_ref, offs_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                             st: _Static, program_ids: tuple):
  """Prefill: one tile of packed rows against every chunk it may see.

  lens_ref, offs_ref: [1] int32 (this sequence's valid keys, first query's
  position); q_ref, o_ref: [block_q, W]; k_ref, v_ref: [Sp, W] (the whole
  sequence, rows >= S never loaded); lse_ref: [block_q] float32 (base 2).
  """
  tiles = st.tiles
  q, rows_ok, row_pos, key_limit, bound, clear_end = _tile_setup(
      lens_ref, offs_ref, q_ref, program_ids[0], st)
  blocks_per_chunk = tiles.chunk_k // tiles.block_k
  num_blocks = (bound + tiles.block_k - 1) // tiles.block_k

  def chunk(c, total):
    first = c * blocks_per_chunk
    part = _chunk_state(q, k_ref, v_ref, base=0, first_block=first,
                        end_block=jnp.minimum(first + blocks_per_chunk, num_blocks),
                        clear_end=clear_end, row_pos=row_pos, key_limit=key_limit, st=st)
    return merge_states(total, part, triton_ops(st.native))

  num_chunks = (bound + tiles.chunk_k - 1) // tiles.chunk_k
  total = lax.fori_loop(0, num_chunks, chunk, _empty_state(tiles.block_q, st.width))
  out, lse = finalize_state(total, triton_ops(st.native))
  store_block(o_ref, out.astype(o_ref.dtype), rows=rows_ok, cols=st.head_cols)
  _store_rows(lse_ref, lse, rows_ok)


def _store_rows(ref, value, rows_ok):
  """Stores a [block] vector, skipping rows past the array (mask None: all in)."""
  if rows_ok is None:
    ref[...] = value
  else:
    pltriton.store(ref, value, mask=rows_ok)


def _load_rows(ref, rows_ok, other):
  return ref[...] if rows_ok is None else pltriton.load(ref, mask=rows_ok, other=other)


def attention_split_kernel(lens_ref, offs_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *,
                           st: _Static, program_ids: tuple, row_tiles: int):
  """Decode: one chunk of ``chunk_k`` keys for one tile of packed rows.

  k_ref, v_ref: [chunk_k, W], keys c * chunk_k ...; m_ref, l_ref: [block_q];
  acc_ref: [block_q, W]: the chunk's float32 state from empty (an empty chunk
  stores (-inf, 0, 0)).
  """
  tiles = st.tiles
  c = program_ids[0] // row_tiles
  q, rows_ok, row_pos, key_limit, bound, clear_end = _tile_setup(
      lens_ref, offs_ref, q_ref, program_ids[0] % row_tiles, st)
  base = c * tiles.chunk_k
  end = jnp.clip((bound - base + tiles.block_k - 1) // tiles.block_k, 0,
                 tiles.chunk_k // tiles.block_k)
  m, l, acc = _chunk_state(q, k_ref, v_ref, base=base, first_block=0, end_block=end,
                           clear_end=clear_end - c * (tiles.chunk_k // tiles.block_k),
                           row_pos=row_pos, key_limit=key_limit, st=st)
  _store_rows(m_ref, m, rows_ok)
  _store_rows(l_ref, l, rows_ok)
  store_block(acc_ref, acc, rows=rows_ok)


def attention_combine_kernel(lens_ref, offs_ref, m_ref, l_ref, acc_ref, o_ref, lse_ref, *,
                             st: _Static, program_ids: tuple, col_tiles: int):
  """Merges the split kernel's chunk states in increasing chunk order, for one
  tile of packed rows and ``combine_cols`` of their columns (the merge is
  elementwise: any tiling gives the same bits; each column tile recomputes the
  rows' m and l, and the first stores the log-sum-exp).

  m_ref, l_ref: [C, block_q]; acc_ref: [C, block_q, combine_cols]; o_ref:
  [block_q, combine_cols]; lse_ref: [block_q]. Chunks past the tile's key bound
  are empty: skipped, or merged as empty states (an exact no-op) where they
  fill a group of COMBINE_UNROLL chunks. A group's loads are issued together,
  while the group before it merges.
  """
  tiles = st.tiles
  bq, cols = tiles.block_q, acc_ref.shape[-1]
  row_tile, col_tile = program_ids[0] // col_tiles, program_ids[0] % col_tiles
  row_start = row_tile * bq
  offset = offs_ref[0]
  rows_ok = block_mask(row_start, bq, st.rows) if st.rows % bq else None
  head_cols = None if st.width == st.head_dim else block_mask(col_tile * cols, cols, st.head_dim)
  _, bound, _ = tile_key_bounds(row_start, bq, lens_ref[0], offset, st)
  chunks = m_ref.shape[0]

  def load_group(g):
    """The states of chunks g * COMBINE_UNROLL ... The index is clamped to the
    last chunk, so every address lies in the array; a group that overhangs it
    and is merged gets the empty state there (masked loads). The loads past
    the last group merged are discarded."""
    parts = []
    for i in range(COMBINE_UNROLL):
      c = g * COMBINE_UNROLL + i
      ok = rows_ok
      if chunks % COMBINE_UNROLL:
        in_range = jnp.full((bq,), c < chunks)
        ok = in_range if ok is None else ok & in_range
      c = jnp.minimum(c, chunks - 1)
      parts.append((_load_rows(m_ref.at[c], ok, -jnp.inf), _load_rows(l_ref.at[c], ok, 0.0),
                    load_block(acc_ref.at[c], rows=ok)))
    return parts

  def chunk_group(g, carry):
    total, parts = carry
    upcoming = load_group(g + 1)  # in flight while this group merges
    for part in parts:
      total = merge_states(total, part, triton_ops(st.native))
    return total, upcoming

  num_chunks = (bound + tiles.chunk_k - 1) // tiles.chunk_k
  total, _ = lax.fori_loop(0, (num_chunks + COMBINE_UNROLL - 1) // COMBINE_UNROLL, chunk_group,
                           (_empty_state(bq, cols), load_group(0)))
  out, lse = finalize_state(total, triton_ops(st.native))
  store_block(o_ref, out.astype(o_ref.dtype), rows=rows_ok, cols=head_cols)

  @pl.when(col_tile == 0)
  def _():
    _store_rows(lse_ref, lse, rows_ok)


# ---------------------------------------------------------------------------
# Backward.


def attention_delta_kernel(o_ref, do_ref, delta_ref, *, st: _Static, program_ids: tuple):
  """delta = rowsum(out * dout) in float32 for ``bwd_block_q`` packed rows."""
  bq = st.tiles.bwd_block_q
  rows_ok = block_mask(program_ids[0] * bq, bq, st.rows) if st.rows % bq else None
  o = load_block(o_ref, rows=rows_ok, cols=st.head_cols).astype(jnp.float32)
  do = load_block(do_ref, rows=rows_ok, cols=st.head_cols).astype(jnp.float32)
  _store_rows(delta_ref, jnp.sum(multiply(o, do, native=st.native), axis=1), rows_ok)


def _probabilities(q, k, lse, mask, st: _Static):
  """The forward's probabilities, recomputed from the base-2 log-sum-exp.
  ``mask=None`` is for blocks every row sees whole (rows past the end have
  lse = +inf, so p = 0 there)."""
  s = _logits(q, k, st)
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  return jnp.exp2(s - lse[:, None])


def _backward_mask(keys, key_ok, rows_ok, row_pos, st: _Static):
  mask = key_ok[None, :]
  if rows_ok is not None:
    mask = mask & rows_ok[:, None]
  if st.causal:
    mask = mask & (keys[None, :] <= row_pos[:, None])
  return mask


def attention_dkdv_kernel(lens_ref, offs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                          dk_ref, dv_ref, *, st: _Static, program_ids: tuple):
  """dK, dV of one block of ``bwd_block_k`` keys, summed over the sequence's
  packed query rows in blocks of ``bwd_block_q``, in increasing order.

  q_ref, do_ref: [Rp, W]; lse_ref, delta_ref: [Rp]; k_ref, v_ref, dk_ref,
  dv_ref: [bwd_block_k, W]. Keys at or past the valid length get zeros. On the
  GPU Triton folds each ``acc + a @ b`` into the dot's accumulator, so dK and dV
  are one k16 chain over the row blocks, which the Mosaic GPU twin
  (:func:`pallas_kernels.attention_hopper.attention_backward`) repeats; its GPU
  test compares the bits.
  """
  tiles = st.tiles
  bq, bk = tiles.bwd_block_q, tiles.bwd_block_k
  key_start = program_ids[0] * bk
  offset = offs_ref[0]
  key_limit = _key_limit(lens_ref[0], st.seq)
  keys = key_start + jnp.arange(bk)
  key_ok = keys < key_limit
  k = load_block(k_ref, rows=key_ok, cols=st.head_cols)
  v = load_block(v_ref, rows=key_ok, cols=st.head_cols)
  first, clear_start, num_row_blocks = key_tile_row_bounds(key_start, bk, bq, key_limit, offset,
                                                         st)

  def step(rb, carry, masked):
    dk, dv = carry
    row_start = pl.multiple_of(rb * bq, bq)
    rows = pl.ds(row_start, bq)
    rows_ok = block_mask(row_start, bq, st.rows) if st.rows % bq else None
    q = load_block(q_ref.at[rows, :], rows=rows_ok, cols=st.head_cols)
    do = load_block(do_ref.at[rows, :], rows=rows_ok, cols=st.head_cols)
    lse = _load_rows(lse_ref.at[rows], rows_ok, jnp.inf)
    delta = _load_rows(delta_ref.at[rows], rows_ok, 0.0)
    row_pos = _row_positions(row_start, bq, st.group, offset)
    mask = _backward_mask(keys, key_ok, rows_ok, row_pos, st) if masked else None
    p = _probabilities(q, k, lse, mask, st)
    dv = dv + uncontracted(dot_f32(p.astype(do.dtype), do, trans_a=True, precision=st.precision),
                           native=st.native)
    dp = dot_f32(do, v, trans_b=True, precision=st.precision)
    ds = p * (dp - delta[:, None])
    dk = dk + uncontracted(dot_f32(ds.astype(q.dtype), q, trans_a=True, precision=st.precision),
                           native=st.native)
    return dk, dv

  zeros = jnp.zeros((bk, st.width), jnp.float32)
  carry = lax.fori_loop(first, clear_start, functools.partial(step, masked=True), (zeros, zeros))
  dk, dv = lax.fori_loop(clear_start, num_row_blocks, functools.partial(step, masked=False), carry)
  keys_in = block_mask(key_start, bk, st.seq) if st.seq % bk else None
  store_block(dk_ref, (dk * st.scale).astype(dk_ref.dtype), rows=keys_in, cols=st.head_cols)
  store_block(dv_ref, dv.astype(dv_ref.dtype), rows=keys_in, cols=st.head_cols)


def attention_dq_kernel(lens_ref, offs_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                        dq_ref, *, st: _Static, program_ids: tuple):
  """dQ of ``bwd_block_q`` packed rows over the key blocks in increasing order.

  q_ref, do_ref, dq_ref: [bwd_block_q, W]; lse_ref, delta_ref: [bwd_block_q];
  k_ref, v_ref: [Sp, W] (rows >= S never loaded).
  """
  tiles = st.tiles
  bq, bk = tiles.bwd_block_q, tiles.bwd_block_k
  row_start = program_ids[0] * bq
  offset = offs_ref[0]
  key_limit, bound, clear = tile_key_bounds(row_start, bq, lens_ref[0], offset, st)
  rows_ok = block_mask(row_start, bq, st.rows) if st.rows % bq else None
  q = load_block(q_ref, rows=rows_ok, cols=st.head_cols)
  do = load_block(do_ref, rows=rows_ok, cols=st.head_cols)
  lse = _load_rows(lse_ref, rows_ok, jnp.inf)
  delta = _load_rows(delta_ref, rows_ok, 0.0)
  row_pos = _row_positions(row_start, bq, st.group, offset)

  def step(kb, dq, masked):
    local = pl.multiple_of(kb * bk, bk)
    keys = local + jnp.arange(bk)
    key_ok = keys < key_limit if masked else None
    k = load_block(k_ref.at[pl.ds(local, bk), :], rows=key_ok, cols=st.head_cols)
    v = load_block(v_ref.at[pl.ds(local, bk), :], rows=key_ok, cols=st.head_cols)
    mask = _backward_mask(keys, key_ok, rows_ok, row_pos, st) if masked else None
    p = _probabilities(q, k, lse, mask, st)
    dp = dot_f32(do, v, trans_b=True, precision=st.precision)
    ds = p * (dp - delta[:, None])
    return dq + uncontracted(dot_f32(ds.astype(k.dtype), k, precision=st.precision),
                             native=st.native)

  num_blocks = (bound + bk - 1) // bk
  middle = jnp.minimum(clear // bk, num_blocks)  # key blocks below it: seen whole
  dq = lax.fori_loop(0, middle, functools.partial(step, masked=False),
                     jnp.zeros((bq, st.width), jnp.float32))
  dq = lax.fori_loop(middle, num_blocks, functools.partial(step, masked=True), dq)
  store_block(dq_ref, (dq * st.scale).astype(dq_ref.dtype), rows=rows_ok, cols=st.head_cols)


# ---------------------------------------------------------------------------
# Launchers: natural (unpadded) layouts in, natural layouts out.


def _static(q, k, *, scale, causal, tiles, interpret) -> _Static:
  b, t, n, h = q.shape
  native = not interpret
  precision = lax.Precision.HIGHEST if native and q.dtype == jnp.float32 else None
  return _Static(rows=t * (n // k.shape[2]), group=n // k.shape[2], seq=k.shape[1],
                 head_dim=h, causal=causal, scale=float(scale), precision=precision,
                 native=native, tiles=tiles)


def _scalar_spec():
  return pl.BlockSpec((1,), lambda i, b, h: (b,))


def _kv_spec(length: int, width: int):
  """A whole (padded) key sequence of one kv head."""
  return pl.BlockSpec((None, length, None, width), lambda i, b, h: (b, 0, h, 0))


def _rows_spec(block: int, width: int | None = None):
  if width is None:
    return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))
  return pl.BlockSpec((None, None, block, width), lambda i, b, h: (b, h, i, 0))


# The Mosaic prefill's launcher passes over all S keys of V once (and of K, where
# S is not a multiple of 8); the kernel's work grows as rows x T. It runs only
# where rows x T is at least this many times S, which keeps that pass to a few
# percent by this estimate (at B = 8, T = S = 512, 32 heads on 8 kv heads, the
# pass included, it ran 1.07x the Triton prefill).
MOSAIC_PREFILL_WORK_PER_KEY = 2048


def _mosaic_shapes(q_shape, kv_shape, device: Device) -> bool:
  """The shape terms of the Mosaic GPU rules: an H100; at least 128 queries (a
  CTA's rows: 128 queries of one head); at least a wave of such tiles; and
  queries enough for the key length (MOSAIC_PREFILL_WORK_PER_KEY: a short
  prefill into a long, preallocated cache stays on Triton, which reads only the
  keys it needs)."""
  from pallas_kernels import attention_hopper
  batch, t, heads, _ = q_shape
  seq, kv_heads = kv_shape[1], kv_shape[2]
  rows = t * (heads // kv_heads)
  tiles_of_rows = cdiv(t, attention_hopper.CTA_ROWS) * batch * heads
  return (device.is_hopper and t >= attention_hopper.CTA_ROWS
          and tiles_of_rows >= device.sm_count and rows * t >= MOSAIC_PREFILL_WORK_PER_KEY * seq)


def use_mosaic_prefill(q_shape, kv_shape, dtype, tiles: AttentionTiles, *, interpret: bool,
                       device: Device | None = None) -> bool:
  """Whether the prefill of query [B, T, N, H] against keys [B, S, K, H] runs on
  the Mosaic GPU kernel (:mod:`pallas_kernels.attention_hopper`) rather than the
  Triton one: for inputs and tiles it takes (head sizes 64 and 128) where
  :func:`_mosaic_shapes` holds. There it ran 1.00-1.46x the Triton prefill's speed
  on the H100; with fewer tiles (B = 1, T = 300, 28 heads: 68) it ran slower
  (benchmarks/results/h100.md, twenty-first and twenty-third sessions). A function
  of shapes only; both kernels give the same bits."""
  from pallas_kernels import attention_hopper
  if interpret:
    return False
  return (_mosaic_shapes(q_shape, kv_shape, device or Device.current())
          and attention_hopper.supported(dtype, q_shape[3], tiles))


def use_mosaic_backward(q_shape, kv_shape, dtype, tiles: AttentionTiles, *, interpret: bool,
                        device: Device | None = None) -> bool:
  """Whether the backward's dK/dV and dQ kernels run on Mosaic GPU
  (:func:`pallas_kernels.attention_hopper.attention_backward`) rather than
  Triton: for inputs and tiles they take (head sizes 64 and 128) where
  :func:`_mosaic_shapes` holds. There they ran 1.12-1.51x faster than Triton on
  the H100, at B = 1, T = 300 (84 tiles) 0.84x (benchmarks/results/h100.md,
  twenty-second session). A function of shapes only; both give the same bits."""
  from pallas_kernels import attention_hopper
  if interpret:
    return False
  return (_mosaic_shapes(q_shape, kv_shape, device or Device.current())
          and attention_hopper.supported_backward(dtype, q_shape[3], tiles))


@launcher
def attention_forward(q, k, v, kv_lengths, q_offsets, *, scale: float, causal: bool,
                      tiles: AttentionTiles, interpret: bool, split: bool | None = None,
                      mosaic: bool | None = None, dense: bool = False):
  """Forward attention.

  q: [B, T, N, H]; k, v: [B, S, K, H] (N a multiple of K); kv_lengths,
  q_offsets: [B] int32. ``split=None`` picks the prefill or the split-KV path
  by :func:`use_split`, and ``mosaic=None`` the prefill's kernel by
  :func:`use_mosaic_prefill` (same bits every way). ``dense`` promises that
  kv_lengths are all S and q_offsets all 0 (the caller gave neither): the Mosaic
  GPU kernels then know them when built and read neither. Returns (out
  [B, T, N, H] in q's dtype, base-2 log-sum-exp [B, K, T * N // K] float32, +inf
  for a row without a valid key).
  """
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  rows = t * (n // kv_heads)
  if split is None:
    split = use_split(rows, b, kv_heads, s, tiles.for_rows(rows))
  if mosaic is None:
    mosaic = not split and use_mosaic_prefill(q.shape, k.shape, q.dtype, tiles,
                                              interpret=interpret)
  if mosaic and split:
    raise ValueError("attention_forward: the Mosaic GPU kernel runs the prefill path, not "
                     "the split-KV one (mosaic=True needs split=False or None)")
  if mosaic:
    from pallas_kernels import attention_hopper
    return attention_hopper.attention_forward(q, k, v, kv_lengths, q_offsets, scale=scale,
                                              causal=causal, tiles=tiles, dense=dense)
  tiles = tiles.for_rows(rows)
  st = _static(q, k, scale=scale, causal=causal, tiles=tiles, interpret=interpret)
  qp = pack_rows(q, kv_heads)
  width, bq = st.width, tiles.block_q
  row_tiles = cdiv(rows, bq)
  out_shapes = (jax.ShapeDtypeStruct((b, kv_heads, rows, h), q.dtype),
                jax.ShapeDtypeStruct((b, kv_heads, rows), jnp.float32))
  out_specs = (_rows_spec(bq, width), _rows_spec(bq))
  params = compiler_params(tiles.num_warps, tiles.num_stages)
  scalars = (kv_lengths.astype(jnp.int32), q_offsets.astype(jnp.int32))
  if not split:
    kv_len = cdiv(s, tiles.block_k) * tiles.block_k
    op, lse = counted_axis_call(
        functools.partial(attention_forward_kernel, st=st),
        count=b, axis=1, grid=(row_tiles, b, kv_heads),
        in_specs=[_scalar_spec(), _scalar_spec(), _rows_spec(bq, width),
                  _kv_spec(kv_len, width), _kv_spec(kv_len, width)],
        out_specs=out_specs, out_shape=out_shapes, compiler_params=params,
        interpret=interpret, name="jdet_attention",
    )(*scalars, qp, k, v)
    return unpack_rows(op, t), lse

  ck = tiles.chunk_k
  chunks = cdiv(s, ck)
  params = compiler_params(tiles.num_warps, tiles.split_stages or tiles.num_stages)

  def part_index(p, bi, hi):
    return bi, hi, p // row_tiles, p % row_tiles

  chunk_spec = pl.BlockSpec((None, ck, None, width),
                            lambda p, bi, hi: (bi, p // row_tiles, hi, 0))
  m, l, acc = counted_axis_call(
      functools.partial(attention_split_kernel, st=st, row_tiles=row_tiles),
      count=b, axis=1, grid=(chunks * row_tiles, b, kv_heads),
      in_specs=[_scalar_spec(), _scalar_spec(),
                pl.BlockSpec((None, None, bq, width),
                             lambda p, bi, hi: (bi, hi, p % row_tiles, 0)),
                chunk_spec, chunk_spec],
      out_specs=(pl.BlockSpec((None, None, None, bq), part_index),
                 pl.BlockSpec((None, None, None, bq), part_index),
                 pl.BlockSpec((None, None, None, bq, width), lambda p, bi, hi: (*part_index(
                     p, bi, hi), 0))),
      out_shape=(jax.ShapeDtypeStruct((b, kv_heads, chunks, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, chunks, rows), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, chunks, rows, width), jnp.float32)),
      compiler_params=params, interpret=interpret, name="jdet_attention_split",
  )(*scalars, qp, k, v)
  cols = min(tiles.combine_cols, width)
  col_tiles = cdiv(h, cols)
  state_spec = pl.BlockSpec((None, None, chunks, bq),
                            lambda p, bi, hi: (bi, hi, 0, p // col_tiles))
  op, lse = counted_axis_call(
      functools.partial(attention_combine_kernel, st=st, col_tiles=col_tiles),
      count=b, axis=1, grid=(row_tiles * col_tiles, b, kv_heads),
      in_specs=[_scalar_spec(), _scalar_spec(), state_spec, state_spec,
                pl.BlockSpec((None, None, chunks, bq, cols),
                             lambda p, bi, hi: (bi, hi, 0, p // col_tiles, p % col_tiles))],
      out_specs=(pl.BlockSpec((None, None, bq, cols),
                              lambda p, bi, hi: (bi, hi, p // col_tiles, p % col_tiles)),
                 pl.BlockSpec((None, None, bq), lambda p, bi, hi: (bi, hi, p // col_tiles))),
      out_shape=out_shapes, compiler_params=params,
      interpret=interpret, name="jdet_attention_combine",
  )(*scalars, m, l, acc)
  return unpack_rows(op, t), lse


@launcher
def attention_backward(q, k, v, out, lse, dout, kv_lengths, q_offsets, *, scale: float,
                       causal: bool, tiles: AttentionTiles, interpret: bool,
                       mosaic: bool | None = None, dense: bool = False):
  """Gradients of :func:`attention_forward` from its output and log-sum-exp.

  q, out, dout: [B, T, N, H]; k, v: [B, S, K, H]; lse: [B, K, T * N // K].
  ``mosaic=None`` picks the dK/dV and dQ kernels (Triton or, on an H100, Mosaic
  GPU: the same bits) by :func:`use_mosaic_backward`; ``dense`` as in
  :func:`attention_forward`. Returns (dq [B, T, N, H], dk, dv [B, S, K, H]) in
  the inputs' dtypes.
  """
  if mosaic is None:
    mosaic = use_mosaic_backward(q.shape, k.shape, q.dtype, tiles, interpret=interpret)
  b, t, _, _ = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  st = _static(q, k, scale=scale, causal=causal, tiles=tiles, interpret=interpret)
  qp, op, dop = (pack_rows(x, kv_heads) for x in (q, out, dout))
  rows, width = st.rows, st.width
  bq, bk = tiles.bwd_block_q, tiles.bwd_block_k
  row_blocks = cdiv(rows, bq)
  params = compiler_params(tiles.bwd_warps, tiles.bwd_stages)
  scalars = (kv_lengths.astype(jnp.int32), q_offsets.astype(jnp.int32))
  delta = counted_axis_call(
      functools.partial(attention_delta_kernel, st=st),
      count=b, axis=1, grid=(row_blocks, b, kv_heads),
      in_specs=[_rows_spec(bq, width), _rows_spec(bq, width)],
      out_specs=_rows_spec(bq),
      out_shape=jax.ShapeDtypeStruct((b, kv_heads, rows), jnp.float32),
      compiler_params=params, interpret=interpret, name="jdet_attention_delta",
  )(op, dop)
  if mosaic:
    from pallas_kernels import attention_hopper
    return attention_hopper.attention_backward(q, k, v, dout, lse, delta, kv_lengths, q_offsets,
                                               scale=scale, causal=causal, tiles=tiles,
                                               dense=dense)
  all_rows = row_blocks * bq
  whole_rows = (pl.BlockSpec((None, None, all_rows, width), lambda j, bi, hi: (bi, hi, 0, 0)),
                pl.BlockSpec((None, None, all_rows), lambda j, bi, hi: (bi, hi, 0)))
  key_block = pl.BlockSpec((None, bk, None, width), lambda j, bi, hi: (bi, j, hi, 0))
  dk, dv = counted_axis_call(
      functools.partial(attention_dkdv_kernel, st=st),
      count=b, axis=1, grid=(cdiv(s, bk), b, kv_heads),
      in_specs=[_scalar_spec(), _scalar_spec(), whole_rows[0], key_block, key_block,
                whole_rows[0], whole_rows[1], whole_rows[1]],
      out_specs=(key_block, key_block),
      out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      compiler_params=params, interpret=interpret, name="jdet_attention_dkdv",
  )(*scalars, qp, k, v, dop, lse, delta)
  kv_len = cdiv(s, bk) * bk
  dqp = counted_axis_call(
      functools.partial(attention_dq_kernel, st=st),
      count=b, axis=1, grid=(row_blocks, b, kv_heads),
      in_specs=[_scalar_spec(), _scalar_spec(), _rows_spec(bq, width), _kv_spec(kv_len, width),
                _kv_spec(kv_len, width), _rows_spec(bq, width), _rows_spec(bq), _rows_spec(bq)],
      out_specs=_rows_spec(bq, width),
      out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
      compiler_params=params, interpret=interpret, name="jdet_attention_dq",
  )(*scalars, qp, k, v, dop, lse, delta)
  return unpack_rows(dqp, t), dk, dv
