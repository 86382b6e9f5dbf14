"""Batch-invariant row kernels: softmax, log_softmax, logsumexp and streamed token log-probs.

Numerics contract (what makes a row's bits independent of the batch): a row of
length L is read in sub-chunks of ``block_cols`` = W columns aligned at
multiples of W from column 0, in increasing order, each a [block_rows, W]
float32 block (columns past L read as -inf). One function,
:func:`online_update`, folds a sub-chunk into the row's running state
(m = max so far, s = sum of exp(x - m)):

    m' = max(m, max_j x_j);  c = m' (0 where m' = -inf)
    s' = s * exp(m - c) + sum_j exp(x_j - c)       (one fused multiply-add on the GPU)

``block_rows``, W, the warps and the kind of row sum are a pure function of L
(:func:`softmax_tiles`), never of the row count, so a row meets the same blocks,
the same reduction trees and the same op sequence in every batch. The row count
reaches the kernels as an operand, not as a constant, and the grid is bucketed
(:func:`~pallas_kernels._common.counted_rows_call`): every row count of a bucket
runs the same compiled kernel. Rows past the count are masked on load and store
(every block carries the row mask); programs past it return at once. A NaN stays
in its own row. The kernels read rows where they lie, at the array's pitch.

The streamed token kernels (:func:`token_chunk_update`) fold the columns
[c0, c0 + C) of a row (C a multiple of W, c0 a multiple of C) into a state that
travels through HBM in float32 between launches. They load the same
[block_rows, W] float32 blocks, with the same warps, as :func:`row_forward` on
the whole row, and call the same :func:`online_update`, so running a row's
chunks one launch after another gives the state that one launch over the whole
row gives, bit for bit (the state is stored exactly; it restarts a launch where
the previous one stopped).

Row sums. The kernels read rows where they lie, without padded copies, so a
block's register layout (which fixes ``jnp.sum``'s tree) may differ between a
batch's array, a one-row array and token_logprobs' chunk buffers. Every row sum
over a block (the state's and the backward's) is therefore
:func:`~pallas_kernels._common.row_sum`, which is ``jnp.sum`` where L is a
multiple of 8 (every row 16-byte aligned: one layout everywhere, as only the last
sub-chunk of a row or chunk carries a column mask and a chunk's length is
congruent to the row's modulo every power of two below W) and a pairwise tree
that no layout changes elsewhere (``SoftmaxTiles.pairwise_sums``).

Kernels:
  * :func:`row_forward_kernel` - the state, and softmax / log_softmax / logsumexp.
  * :func:`row_backward_kernel` - their VJPs from the input and the saved state.
  * :func:`token_chunk_update_kernel` - folds logits * (1 / temperature) of one
    vocab chunk into (m, s, picked token logit).
  * :func:`token_finalize_kernel` - picked - m - log(s): log_softmax's formula.
  * :func:`token_chunk_backward_kernel` - dlogits = g (onehot - p) / temperature.

1 / s is correctly rounded (:func:`pallas_kernels._common.divide`); exp and log
are libdevice's ``expf``/``logf`` on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._common import (block_mask, cdiv, compiler_params, counted_rows_call,
                                    divide, launcher, multiply, multiply_add,
                                    pairwise_sums_for, row_sum, store_block)

SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = "softmax", "log_softmax", "logsumexp"
KINDS = (SOFTMAX, LOG_SOFTMAX, LOGSUMEXP)


@dataclasses.dataclass(frozen=True)
class SoftmaxTiles:
  """Rows per program, sub-chunk width W (both powers of two), Triton warps, and
  whether row sums are pairwise (``_common.row_sum``)."""
  block_rows: int
  block_cols: int
  num_warps: int
  pairwise_sums: bool = False


# GPU rule (not measured yet; chosen for a memory-bound kernel on the H100): a row
# of up to GPU_ONE_BLOCK columns is one sub-chunk, read once and kept in registers
# (at most 32 float32 a thread); longer rows stream GPU_LONG_ROW_COLS-wide
# sub-chunks twice (state, then output), the second pass mostly from L2. Short
# rows share a program, GPU_MIN_BLOCK elements a block.
GPU_ONE_BLOCK = 8192
GPU_LONG_ROW_COLS = 4096
GPU_MIN_BLOCK = 2048
MIN_COLS = 16

# Interpret mode (CPU): narrow sub-chunks, so that short test rows already take
# the multi-sub-chunk and multi-chunk paths.
INTERPRET_MAX_COLS = 128
INTERPRET_BLOCK_ROWS = 8

# A token_logprobs vocab chunk is this many sub-chunks (GPU: 8192 columns).
CHUNK_SUB_CHUNKS = 2
# token_logprobs takes the whole vocabulary as one chunk (one GEMM against the
# weight itself: a chunk is a column window of [D, V], which the GEMM gets as a
# copy) when its [T, V] float32 logits hold at most this many elements (GPU: 1
# GiB) and the weight's rows are WHOLE_VOCAB_ALIGN-aligned (128 bytes in bf16;
# the GEMMs read rows of other pitches slower than a copy costs); elsewhere it
# streams chunks in O(T * C) memory. Interpret mode: a small limit, so that the
# tests' few rows take one path and their batches the other.
GPU_WHOLE_VOCAB_LOGITS = 1 << 28
INTERPRET_WHOLE_VOCAB_LOGITS = 1 << 11
WHOLE_VOCAB_ALIGN = 64
# Above that limit token_logprobs' forward (not its backward) cuts the rows into
# the fewest blocks whose logits hold at most this many elements (GPU: 512 MiB,
# so that the forward at 8192 tokens of a 151,936-word vocabulary holds under 1/8
# of XLA's logits), as even as whole multiples of the alignment allow (GPU: the
# Mosaic GEMM's 128-row program tiles), each over the whole vocabulary. One GEMM
# shape for every block: a new token count compiles one GEMM kernel where the
# chunk loop compiles two.
GPU_ROW_BLOCK_LOGITS = 1 << 27
INTERPRET_ROW_BLOCK_LOGITS = 1 << 11
GPU_ROW_BLOCK_ALIGN = 128
INTERPRET_ROW_BLOCK_ALIGN = 1

# The token finalize kernel is elementwise: any block gives the same bits.
FINALIZE_TILES = SoftmaxTiles(128, 1, 4)


def softmax_tiles(length: int, *, interpret: bool) -> SoftmaxTiles:
  """Tiles for rows of ``length`` columns (any input dtype: blocks are float32
  after the load); never a function of the row count."""
  width = pl.next_power_of_2(max(length, MIN_COLS))
  pairwise = pairwise_sums_for(length)
  if interpret:
    return SoftmaxTiles(INTERPRET_BLOCK_ROWS, min(width, INTERPRET_MAX_COLS), 4, pairwise)
  if length > GPU_ONE_BLOCK:
    width = GPU_LONG_ROW_COLS
  return SoftmaxTiles(max(1, GPU_MIN_BLOCK // width), width, 8 if width >= 8192 else 4,
                      pairwise)


def token_chunk_cols(vocab: int, *, interpret: bool) -> int:
  """Vocab columns per token_logprobs chunk: CHUNK_SUB_CHUNKS sub-chunks of the
  tiles of a ``vocab``-long row (a vocab of at most one such chunk is one chunk)."""
  return CHUNK_SUB_CHUNKS * softmax_tiles(vocab, interpret=interpret).block_cols


def token_whole_vocab(rows: int, vocab: int, *, interpret: bool) -> bool:
  """Whether token_logprobs takes ``rows`` rows over the whole vocabulary at once
  (see GPU_WHOLE_VOCAB_LOGITS). Either way gives the same bits: one launch over
  a row gives the state its chunks' launches give (module docstring)."""
  if interpret:
    return rows * vocab <= INTERPRET_WHOLE_VOCAB_LOGITS
  return vocab % WHOLE_VOCAB_ALIGN == 0 and rows * vocab <= GPU_WHOLE_VOCAB_LOGITS


def token_row_block(rows: int, vocab: int, *, interpret: bool) -> int | None:
  """Rows per block of token_logprobs' forward over ``rows`` rows of a ``vocab``
  vocabulary that passed the whole-vocabulary limit (see GPU_ROW_BLOCK_LOGITS;
  the rows are padded to whole blocks); None where the forward streams chunks
  instead: V not WHOLE_VOCAB_ALIGN-aligned (in interpret mode too, so that the
  CPU tests cover both forwards) or no block fits. Any block gives the same bits:
  rows are independent in the GEMM and the row kernel."""
  limit, align = ((INTERPRET_ROW_BLOCK_LOGITS, INTERPRET_ROW_BLOCK_ALIGN) if interpret
                  else (GPU_ROW_BLOCK_LOGITS, GPU_ROW_BLOCK_ALIGN))
  most = limit // vocab // align * align
  if vocab % WHOLE_VOCAB_ALIGN or not most:
    return None
  return cdiv(cdiv(rows, cdiv(rows, most)), align) * align


# ---------------------------------------------------------------------------
# Row state and the per-sub-chunk update. State arrays are [block_rows, 1].


def _shift(m):
  """The max to subtract: 0 where it is -inf (all -inf so far: exp gives 0, not NaN)."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def online_update(m, s, x, *, pairwise: bool, native: bool):
  """Folds the float32 [block_rows, W] block ``x`` into the state (m, s)."""
  m_new = jnp.maximum(m, jnp.max(x, axis=1, keepdims=True))
  shift = _shift(m_new)
  partial = row_sum(jnp.exp(x - shift), pairwise=pairwise, native=native)
  return m_new, multiply_add(s, jnp.exp(m - shift), partial, fused=native)


def _log_softmax_values(x, m, log_s):
  """log_softmax from the final state; shared by the row kernel and the token
  finalize kernel, so both round alike. m = -inf (all -inf) gives NaN, as in jax.nn."""
  return (x - m) - log_s


def _logsumexp_values(m, s):
  """shift + log(s); +inf when the row holds +inf (s is NaN then), as in jax.nn."""
  return jnp.where(m == jnp.inf, jnp.inf, _shift(m) + jnp.log(s))


def _initial_state(block_rows: int):
  return (jnp.full((block_rows, 1), -jnp.inf, jnp.float32),
          jnp.zeros((block_rows, 1), jnp.float32))


# ---------------------------------------------------------------------------
# Sub-chunk access. A kernel's row ref is a [block_rows, n * W] block; sub-chunk
# j covers columns j*W .. j*W + W - 1.


def _mask(valid, cols):
  return valid[:, None] if cols is None else valid[:, None] & cols[None, :]


def _load(ref, valid, cols=None, *, fill=0):
  """Loads a block as float32, ``fill`` where the row/column masks are False."""
  return pltriton.load(ref, mask=_mask(valid, cols), other=fill).astype(jnp.float32)


def _load_tokens(ref, valid):
  return pltriton.load(ref, mask=valid[:, None], other=0)


@dataclasses.dataclass(frozen=True)
class _Row:
  """Where a program's sub-chunks lie: ``length`` real columns of width-W
  sub-chunks; and how row sums run (``SoftmaxTiles.pairwise_sums``)."""
  length: int
  width: int
  pairwise_sums: bool

  @classmethod
  def of(cls, length: int, tiles: SoftmaxTiles) -> _Row:
    return cls(length, tiles.block_cols, tiles.pairwise_sums)

  def update(self, state, x, *, native: bool):
    return online_update(*state, x, pairwise=self.pairwise_sums, native=native)

  def sum(self, x, *, native: bool):
    return row_sum(x, pairwise=self.pairwise_sums, native=native)

  @property
  def count(self) -> int:
    return cdiv(self.length, self.width)

  def columns(self, start, last: bool):
    """The last sub-chunk's column mask when the row ends inside it, else None."""
    return block_mask(start, self.width, self.length) if last and self.length % self.width else None

  def load(self, ref, start, valid, *, last: bool, fill):
    return _load(ref.at[:, pl.ds(start, self.width)], valid, self.columns(start, last), fill=fill)

  def store(self, ref, start, value, valid, *, last: bool):
    store_block(ref.at[:, pl.ds(start, self.width)], value.astype(ref.dtype),
                rows=valid, cols=self.columns(start, last))

  def sweep(self, load, body, carry):
    """carry = body(block, start, carry) for each sub-chunk in increasing order: a
    loop over all but the last, then the last (the only masked one) peeled.
    Returns (carry, the last sub-chunk's block)."""
    def step(j, carry):
      start = pl.multiple_of(j * self.width, self.width)
      return body(load(start, last=False), start, carry)

    if self.count > 1:
      carry = lax.fori_loop(0, self.count - 1, step, carry)
    start = (self.count - 1) * self.width
    block = load(start, last=True)
    return body(block, start, carry), block

  def emit(self, load, emit, last_block=None):
    """emit(block, start, last) for each sub-chunk in increasing order; the last
    one's block is ``last_block`` when given (still in registers from a sweep)."""
    def step(j, carry):
      start = pl.multiple_of(j * self.width, self.width)
      emit(load(start, last=False), start, False)
      return carry

    if self.count > 1:
      lax.fori_loop(0, self.count - 1, step, 0)
    start = (self.count - 1) * self.width
    emit(load(start, last=True) if last_block is None else last_block, start, True)


# ---------------------------------------------------------------------------
# Kernels.


def row_forward_kernel(x_ref, y_ref, m_ref, s_ref, *, kind: str, valid, row: _Row,
                       native: bool):
  """x_ref: [block_rows, n*W] (any float dtype); y_ref: the same block (softmax,
  log_softmax) or [block_rows, 1] (logsumexp); m_ref, s_ref: [block_rows, 1] float32."""
  load = lambda start, last: row.load(x_ref, start, valid, last=last, fill=-jnp.inf)
  (m, s), last_block = row.sweep(
      load, lambda x, _, state: row.update(state, x, native=native),
      _initial_state(x_ref.shape[0]))
  store_block(m_ref, m, rows=valid)
  store_block(s_ref, s, rows=valid)
  if kind == LOGSUMEXP:
    store_block(y_ref, _logsumexp_values(m, s).astype(y_ref.dtype), rows=valid)
    return
  if kind == SOFTMAX:
    inv_s = divide(1.0, s, native=native)
    finish = lambda x: jnp.exp(x - m) * inv_s
  else:
    log_s = jnp.log(s)
    finish = lambda x: _log_softmax_values(x, m, log_s)
  row.emit(load, lambda x, start, last: row.store(y_ref, start, finish(x), valid, last=last),
           last_block)


def row_backward_kernel(x_ref, m_ref, s_ref, g_ref, dx_ref, *, kind: str, valid, row: _Row,
                        native: bool):
  """VJP from the input x, the saved state and the output cotangent g.

  softmax: dx = y (g - sum(g y)); log_softmax: dx = g - p sum(g); logsumexp:
  dx = g p (g_ref [block_rows, 1]); p = y = exp(x - m) / s. Row sums run over
  the sub-chunks in increasing order.
  """
  m, s = _load(m_ref, valid), _load(s_ref, valid)
  inv_s = divide(1.0, s, native=native)
  probs = lambda x: jnp.exp(x - m) * inv_s
  load_x = lambda start, last: row.load(x_ref, start, valid, last=last, fill=-jnp.inf)
  store = lambda start, dx, last: row.store(dx_ref, start, dx, valid, last=last)
  if kind == LOGSUMEXP:
    g = _load(g_ref, valid)
    row.emit(load_x, lambda x, start, last: store(start, g * probs(x), last))
    return

  def load(start, last):
    return (load_x(start, last),
            row.load(g_ref, start, valid, last=last, fill=0))

  if kind == SOFTMAX:
    term = lambda x, g: g * probs(x)
    grad = lambda x, g, total: probs(x) * (g - total)
  else:
    term = lambda x, g: g
    grad = lambda x, g, total: multiply_add(-probs(x), total, g, fused=native)
  total, last_block = row.sweep(
      load, lambda xg, _, total: total + row.sum(term(*xg), native=native),
      jnp.zeros((x_ref.shape[0], 1), jnp.float32))
  row.emit(load, lambda xg, start, last: store(start, grad(*xg, total), last), last_block)


def _scaled(x, inv_temperature: float, native: bool):
  """x * inv_temperature (1.0: x itself), rounded on its own as XLA's multiply is:
  on the GPU one ``mul.rn.f32``, which ptxas never contracts with the subtraction
  that follows into a fused multiply-add; in interpret mode ``uncontracted``."""
  return x if inv_temperature == 1.0 else multiply(x, inv_temperature, native=native)


def token_chunk_update_kernel(x_ref, tok_ref, m_ref, s_ref, p_ref, m_out, s_out, p_out, *,
                              valid, row: _Row, inv_temperature: float, native: bool):
  """Folds one vocab chunk into each row's (m, s, picked logit).

  x_ref: [block_rows, n*W] float32 logits of the chunk, multiplied in-kernel by
  ``inv_temperature`` (a float32 value; 1.0 skips it; see :func:`token_chunk_update`);
  tok_ref: [block_rows, 1] int32 token ids relative to the chunk's first column;
  m, s, p refs: [block_rows, 1] float32 state in and out (aliased). The picked
  logit is the max of -inf and the token's logit / temperature (exact).
  """
  token = _load_tokens(tok_ref, valid)
  cols = lax.broadcasted_iota(jnp.int32, (1, row.width), 1)

  def body(x, start, state):
    m, s, picked = state
    x = _scaled(x, inv_temperature, native)
    m, s = row.update((m, s), x, native=native)
    hit = jnp.where(start + cols == token, x, -jnp.inf)
    return m, s, jnp.maximum(picked, jnp.max(hit, axis=1, keepdims=True))

  state = (_load(m_ref, valid), _load(s_ref, valid), _load(p_ref, valid))
  state, _ = row.sweep(
      lambda start, last: row.load(x_ref, start, valid, last=last, fill=-jnp.inf), body, state)
  for ref, value in zip((m_out, s_out, p_out), state):
    store_block(ref, value, rows=valid)


def token_finalize_kernel(m_ref, s_ref, p_ref, o_ref, *, valid):
  """log-prob = picked - m - log(s), rounded as :func:`row_forward_kernel`'s log_softmax."""
  m, s, picked = _load(m_ref, valid), _load(s_ref, valid), _load(p_ref, valid)
  store_block(o_ref, _log_softmax_values(picked, m, jnp.log(s)), rows=valid)


def token_chunk_backward_kernel(x_ref, tok_ref, m_ref, s_ref, g_ref, dl_ref, *, valid,
                                row: _Row, inv_temperature: float, native: bool):
  """dlogits of one chunk: (onehot(token) - p) * g / τ, p = exp(x / τ - m) / s.

  x_ref: [block_rows, n*W] float32 logits before the temperature; tok_ref, m, s,
  g refs: [block_rows, 1]; dl_ref: like x_ref, in the GEMM's compute dtype.
  """
  token = _load_tokens(tok_ref, valid)
  m, s, g = _load(m_ref, valid), _load(s_ref, valid), _load(g_ref, valid)
  inv_s = divide(1.0, s, native=native)
  scale = _scaled(g, inv_temperature, native)
  cols = lax.broadcasted_iota(jnp.int32, (1, row.width), 1)

  def emit(x, start, last):
    p = jnp.exp(_scaled(x, inv_temperature, native) - m) * inv_s
    onehot = jnp.where(start + cols == token, 1.0, 0.0)
    row.store(dl_ref, start, (onehot - p) * scale, valid, last=last)

  row.emit(lambda start, last: row.load(x_ref, start, valid, last=last, fill=-jnp.inf), emit)


# ---------------------------------------------------------------------------
# Launchers: natural (unpadded) inputs and outputs.


def _call(kernel, inputs, outputs, *, tiles: SoftmaxTiles, wide, interpret: bool, name: str,
          row: _Row | None = None, aliases=None):
  """Launches ``kernel`` over row blocks; ``wide`` says which inputs/outputs are
  [rows, n*W] row blocks of ``row`` (the rest are [rows, 1] per-row values).
  The kernel gets ``valid``, its block's row mask (:func:`counted_rows_call`);
  ``aliases`` index ``inputs``."""
  rows = inputs[0].shape[0]
  block_rows = tiles.block_rows
  value_spec = pl.BlockSpec((block_rows, 1), lambda i: (i, 0))
  if row is not None:
    kernel = functools.partial(kernel, row=row)
    row_spec = pl.BlockSpec((block_rows, row.count * row.width), lambda i: (i, 0))
  specs = [row_spec if w else value_spec for w in wide]
  out_specs = specs[len(inputs):] if isinstance(outputs, list) else specs[-1]
  return counted_rows_call(
      kernel, rows=rows, block_rows=block_rows, in_specs=specs[:len(inputs)],
      out_specs=out_specs, out_shape=outputs, input_output_aliases=aliases,
      compiler_params=compiler_params(tiles.num_warps, 1), interpret=interpret, name=name,
  )(*inputs)


def _column(v):
  return v.reshape(-1, 1)


@launcher
def row_forward(x, *, kind: str, tiles: SoftmaxTiles, interpret: bool):
  """x: [rows, L] bfloat16/float16/float32. Returns (y, m, s): y is [rows, L]
  (softmax, log_softmax) or [rows] (logsumexp) in x's dtype; m, s: [rows] float32."""
  rows, length = x.shape
  f32 = lambda: jax.ShapeDtypeStruct((rows, 1), jnp.float32)
  y_shape = (rows, 1) if kind == LOGSUMEXP else x.shape
  y, m, s = _call(
      functools.partial(row_forward_kernel, kind=kind, native=not interpret), [x],
      [jax.ShapeDtypeStruct(y_shape, x.dtype), f32(), f32()],
      row=_Row.of(length, tiles), tiles=tiles, wide=(True, kind != LOGSUMEXP, False, False),
      interpret=interpret, name=f"jdet_{kind}")
  return (y[:, 0] if kind == LOGSUMEXP else y), m[:, 0], s[:, 0]


@launcher
def row_backward(x, m, s, g, *, kind: str, tiles: SoftmaxTiles, interpret: bool):
  """x: [rows, L]; m, s: [rows] float32 (from :func:`row_forward`); g: the
  cotangent of y ([rows, L], or [rows] for logsumexp). Returns dx [rows, L] in x's dtype."""
  length = x.shape[1]
  g = _column(g) if kind == LOGSUMEXP else g.astype(x.dtype)
  return _call(
      functools.partial(row_backward_kernel, kind=kind, native=not interpret),
      [x, _column(m), _column(s), g], jax.ShapeDtypeStruct(x.shape, x.dtype),
      row=_Row.of(length, tiles), tiles=tiles,
      wide=(True, False, False, kind != LOGSUMEXP, True), interpret=interpret,
      name=f"jdet_{kind}_bwd")


@launcher
def token_chunk_update(logits, tokens, m, s, picked, *, inv_temperature: float,
                       tiles: SoftmaxTiles, interpret: bool):
  """logits: [T, c] float32 (one vocab chunk, before the temperature); tokens: [T]
  int32 relative to the chunk; m, s, picked: [T] float32 state; ``inv_temperature``
  a float32 value the logits are multiplied by. Returns the new state.

  The product is rounded on its own, as XLA's ``logits / temperature`` is (XLA
  rewrites a division by a scalar into a multiplication by its float32
  reciprocal): see :func:`_scaled`.
  """
  rows, length = logits.shape
  state = [jax.ShapeDtypeStruct((rows, 1), jnp.float32)] * 3
  out = _call(
      functools.partial(token_chunk_update_kernel, inv_temperature=inv_temperature,
                        native=not interpret),
      [logits, _column(tokens), _column(m), _column(s), _column(picked)], state,
      row=_Row.of(length, tiles), tiles=tiles, wide=(True,) + (False,) * 7,
      interpret=interpret, name="jdet_token_chunk_update", aliases={2: 0, 3: 1, 4: 2})
  return tuple(v[:, 0] for v in out)


@launcher
def token_finalize(m, s, picked, *, interpret: bool):
  """m, s, picked: [T] float32 state after the last chunk; returns the [T] float32 log-probs."""
  rows = m.shape[0]
  out = _call(token_finalize_kernel, [_column(m), _column(s), _column(picked)],
              jax.ShapeDtypeStruct((rows, 1), jnp.float32), tiles=FINALIZE_TILES,
              wide=(False,) * 4, interpret=interpret, name="jdet_token_finalize")
  return out[:, 0]


@launcher
def token_chunk_backward(logits, tokens, m, s, g, *, inv_temperature: float, out_dtype,
                         tiles: SoftmaxTiles, interpret: bool):
  """logits: [T, c] float32 (before the temperature); tokens: [T] int32 relative
  to the chunk; m, s: [T] state after the last chunk; g: [T] float32 cotangent of
  the log-probs. Returns dlogits [T, c] in ``out_dtype``."""
  length = logits.shape[1]
  return _call(
      functools.partial(token_chunk_backward_kernel, inv_temperature=inv_temperature,
                        native=not interpret),
      [logits, _column(tokens), _column(m), _column(s), _column(g)],
      jax.ShapeDtypeStruct(logits.shape, out_dtype), row=_Row.of(length, tiles),
      tiles=tiles, wide=(True, False, False, False, False, True), interpret=interpret,
      name="jdet_token_chunk_bwd")
