"""The attention prefill forward and the backward on Hopper tensor cores through
Mosaic GPU (TMA + wgmma).

The prefill computes the bits of
:func:`pallas_kernels.attention.attention_forward_kernel` (the Triton prefill
kernel) under the same numerics contract (that module's docstring), so
:func:`pallas_kernels.attention.attention_forward` may send any prefill to
either and decode (Triton) still matches it bit for bit:

* the same rows, 64 of them per consumer warpgroup (a Triton row tile) - but
  each CTA's 128 rows are 128 consecutive queries of one query head rather than
  packed rows, which TMA reads from and writes to the natural [B, T, N, H]
  layout, with no packing pass: a row's arithmetic is the same whichever rows
  sit beside it in its tile (:func:`_query_rows`);
* keys in 128-key blocks aligned to absolute positions, in increasing order, in
  chunks of ``chunk_k`` keys that start from the empty state and merge into the
  total with :func:`~pallas_kernels.attention.merge_states`, which with
  :func:`~pallas_kernels.attention.finalize_state` runs here on
  :func:`mosaic_ops`: the same PTX instructions as the Triton kernels' ops, but
  for the reciprocal (``rcp.rn.f32`` here, ``div.rn.f32`` of 1 there: both the
  IEEE-rounded ``1 / x``, so the same bits);
* the logits ``mul.rn(q . k, scale * log2(e))``, the row sum of a block from
  ``p @ ones`` on the tensor cores, and ``p @ V`` accumulated onto
  ``mul.rn(acc, alpha)`` in the wgmma accumulator: the same k16 chains as
  Triton's dots, which fold ``acc + p @ V`` into theirs.

A prefill CTA owns 128 queries of one (sequence, query head): one producer
warpgroup streams K/V blocks into a ring of shared-memory stages, two consumer
warpgroups each take 64 rows. They run free of each other: the warp schedulers
overlap one's softmax with the other's products (making them take turns on the
tensor cores, as FlashAttention-3 does, cost 2-8% at 8 of 10 shapes on the
H100). A consumer holds the block's logits, the chunk's state and the chunk
total in registers. 128-key blocks with ``p @ V`` accumulated into the state
were 2-14% faster on the H100 than 64-key blocks with ``p @ V`` from zero that
issued the next block's ``q . k`` during the softmax (B = 4, T = 4096: 5%
causal, 14% not). That overlap does not fit beside 128-key blocks: registers,
or shared memory with the chunk total there; with V single-buffered to make
room, it ran 10-20% slower than the 64-key kernel at three of four shapes.

The backward (:func:`attention_backward`) computes the bits of the Triton dK/dV
and dQ kernels at their 64 x 64 tiles: the same probabilities and ``ds``
(``ex2.approx.ftz`` of ``mul.rn``-scaled logits), and dV, dK and dQ accumulated
in the wgmma accumulator in the k16 order of Triton's dots, which Triton folds
into ``acc + a @ b`` chains. A dK/dV CTA owns 128 keys (64 per consumer) and
streams the sequence's 64-row blocks of packed rows (their order is the sum's);
a dQ CTA owns 128 queries of one head and streams the key blocks.

Values past a sequence's valid length (and keys, for the backward) are zeroed
before the kernels (the Triton kernels never load them, reading zeros; garbage
there may be NaN, and p = 0 times NaN is NaN). 16-bit inputs, head sizes 64 and 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import attention as tri
from pallas_kernels._common import cdiv, mosaic_gpu

ROWS = 64           # packed rows per consumer warpgroup (one wgmma row block)
CTA_ROWS = 2 * ROWS
STAGES = 2          # K/V blocks in flight (3 of 64 keys ran 2% slower; 3 of 128 do not fit)
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
PREFILL_BLOCK_K = 128  # the prefill's key block (the 16-bit tiles' block_k)
BACKWARD_BLOCK_K = 64  # the backward's (their bwd_block_k)
# A prefill consumer holds a 128-key block's logits, the chunk's state and the
# chunk total in registers (64 each); its producer needs few.
PREFILL_CONSUMER_REGISTERS = 240
PREFILL_PRODUCER_REGISTERS = 24
TMA_ROWS = 8        # TMA tiles a sequence by 8 keys


def supported(dtype, head_dim: int, tiles: tri.AttentionTiles) -> bool:
  """Whether the prefill kernel computes a prefill with these inputs and tiles."""
  return (jnp.dtype(dtype) in DTYPES and head_dim in HEAD_DIMS
          and tiles.block_k == PREFILL_BLOCK_K and tiles.chunk_k % PREFILL_BLOCK_K == 0)


def supported_backward(dtype, head_dim: int, tiles: tri.AttentionTiles) -> bool:
  """Whether the backward kernels give the Triton backward's bits for these
  inputs and tiles (they compute its 64 x 64 tiles)."""
  return (jnp.dtype(dtype) in DTYPES and head_dim in HEAD_DIMS
          and (tiles.bwd_block_q, tiles.bwd_block_k) == (ROWS, BACKWARD_BLOCK_K))


def _ptx_op(asm: str):
  """An elementwise float32 op of one PTX instruction (``asm``: ``$0`` the result,
  ``$1``... the operands) on Mosaic GPU arrays of one shape: [rows] vectors or
  [rows, W] blocks in the wgmma layout."""
  import jax.experimental.mosaic.gpu as mgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm
  plgpu = mosaic_gpu()

  def op(*xs):
    layout = plgpu.Layout.WGMMA if xs[0].ndim == 2 else plgpu.Layout.WGMMA.reduce(1)

    def scalar(*values):
      return llvm.inline_asm(ir.F32Type.get(), list(values), asm, "=f" + ",f" * len(values))

    @plgpu.inline_mgpu(arg_types=tuple(layout for _ in xs),
                       return_type=plgpu.ShapeDtypeStruct(xs[0].shape, jnp.float32, layout))
    def apply(_, *arrays):
      return arrays[0]._pointwise(mgpu.FragmentedArray._lift_fast_instr(scalar), *arrays[1:])

    return apply(*xs)

  return op


@functools.cache
def mosaic_ops() -> tri.Float32Ops:
  """:class:`~pallas_kernels.attention.Float32Ops` in Mosaic GPU: one explicit PTX
  instruction each (Mosaic's own arithmetic may contract a multiply into an add)."""
  mul, fma = _ptx_op("mul.rn.f32 $0, $1, $2;"), _ptx_op("fma.rn.f32 $0, $1, $2, $3;")

  def rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])

  return tri.Float32Ops(
      mul=mul, fma=fma, exp2=_ptx_op("ex2.approx.ftz.f32 $0, $1;"),
      quotient=functools.partial(tri.corrected_quotient, mul=mul, fma=fma, rows=rows,
                                 rcp=_ptx_op("rcp.rn.f32 $0, $1;")),
      log2=_ptx_op("lg2.approx.ftz.f32 $0, $1;"), rows=rows)


def _equal_columns_row(x):
  """[rows, W] float32 whose W columns are equal (``p @ ones``), in the wgmma layout ->
  its [rows] row values, each thread's own copy: the exact ``x.max(axis=1)``
  without the shuffles across a row's lanes."""
  import jax.experimental.mosaic.gpu as mgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import vector
  plgpu = mosaic_gpu()
  row = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(x.shape[:1], jnp.float32, row))
  def first_column(_, array):
    layout = array.layout
    columns = layout.tiling.tile_dimension(1)
    registers = array.registers
    kept = np.empty(tuple(1 if c else d for c, d in zip(columns, registers.shape)), dtype=object)
    for index in np.ndindex(kept.shape):
      register = registers[index]
      if columns[layout.vector_dim]:
        first = vector.extract(register, dynamic_position=[],
                               static_position=ir.DenseI64ArrayAttr.get([0]))
        register = vector.broadcast(ir.VectorType.get((1,), first.type), first)
      kept[index] = register
    reduced = layout.reduce((1,))
    return mgpu.FragmentedArray(_registers=kept.reshape(reduced.registers_shape(x.shape[:1])),
                                _layout=reduced, _is_signed=None)

  return first_column(x)


@functools.cache
def _scale_by(factor: float):
  """``mul.rn.f32`` by a float32 constant, as an immediate operand (a constant
  array would take registers)."""
  bits = np.float32(factor).view(np.uint32)
  return _ptx_op(f"mul.rn.f32 $0, $1, 0f{bits:08X};")


def _iota(shape, dim: int):
  """int32 indices along ``dim`` of a [rows, cols] block in the wgmma layout."""
  plgpu = mosaic_gpu()
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _masked(s, keys, key_limit, positions=None):
  """Logits ``s`` with -inf where the key (``keys``, int32 like ``s``) is at or
  past ``key_limit`` or, given the rows' ``positions`` (causal), past its row's
  position: the masks of ``attention._block_step`` and the Triton backward."""
  mask = keys < key_limit
  if positions is not None:
    mask = jnp.logical_and(mask, keys <= positions)
  return jnp.where(mask, s, -jnp.inf)


def _logits(a_ref, b_ref, shape, st: tri._Static):
  """``mul.rn(a @ b^T, scale * log2(e))``: [shape] float32 base-2 logits from two
  shared-memory blocks (one k16 wgmma chain), as the Triton kernels' logits."""
  plgpu = mosaic_gpu()

  def product(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)))
    return acc_ref[...]

  return _scale_by(st.scale * tri.LOG2E)(pl.run_scoped(product, plgpu.ACC(shape, jnp.float32)))


def _empty(width: int):
  plgpu = mosaic_gpu()
  row = plgpu.Layout.WGMMA.reduce(1)
  return (plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row),
          plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row),
          plgpu.layout_cast(jnp.full((ROWS, width), 0.0, jnp.float32), plgpu.Layout.WGMMA))


def _first_row(wg, row_tile):
  """The first of consumer ``wg``'s 64 rows of the CTA's row tile."""
  return (row_tile * 2 + wg) * ROWS


def _consumer_rows(wg, row_tile, b, n, queries: tri._Static):
  """Consumer ``wg``'s 64 queries of (sequence b, query head n) in the [B, T, N, H]
  layout, and whether any lies inside the array. Neither needs the sequence's
  scalars, so the row loads start before those are read."""
  first = _first_row(wg, row_tile)
  return (b, pl.ds(first, ROWS), n), first < queries.rows


def _bounds(wg, kv_len, offset, row_tile, st: tri._Static, block_k: int):
  """A consumer's first row, key limit, key blocks of ``block_k`` keys and first
  masked block (:func:`~pallas_kernels.attention.tile_key_bounds` of its 64 rows;
  none for rows wholly past the array)."""
  row_start = _first_row(wg, row_tile)
  key_limit, bound, clear = tri.tile_key_bounds(row_start, ROWS, kv_len, offset, st)
  bound = jnp.where(row_start < st.rows, bound, 0)
  return row_start, key_limit, (bound + block_k - 1) // block_k, clear // block_k


def _query_rows(st: tri._Static) -> tri._Static:
  """``st`` for a kernel whose rows are one query head's queries in order (row r
  is query r; no packing): T rows of one position each. A row's arithmetic does
  not depend on the rows beside it in its tile, so its bits are those of its
  packed row."""
  return dataclasses.replace(st, rows=st.rows // st.group, group=1)


def _longest_first(queries: tri._Static):
  """This CTA's row tile, the grid's fastest axis, counted down: CTAs start in
  grid order, so with a causal mask (later rows see more keys) each head's
  longest tiles start first, its shortest last."""
  return cdiv(queries.rows, CTA_ROWS) - 1 - lax.axis_index("rows")


def _row_stats(lse, delta, padded_rows: int):
  """[B, X, R] log-sum-exp and delta (X heads of R rows) as [B, X, padded_rows /
  64, 2, 64]: each 64-row block's pair in one copy; rows past R get lse = +inf
  and delta = 0 (p = 0 there)."""
  b, heads, rows = lse.shape
  pad = ((0, 0), (0, 0), (0, padded_rows - rows))
  stats = jnp.stack([jnp.pad(lse, pad, constant_values=jnp.inf), jnp.pad(delta, pad)], axis=-2)
  return stats.reshape(b, heads, 2, padded_rows // ROWS, ROWS).transpose(0, 1, 3, 2, 4)


def _per_head(x, seq_len: int):
  """[B, K, T * G] packed-row values -> [B, K * G, T]: one row of T per query head."""
  b, kv_heads, rows = x.shape
  group = rows // seq_len
  return x.reshape(b, kv_heads, seq_len, group).transpose(0, 1, 3, 2).reshape(
      b, kv_heads * group, seq_len)


def _packed(x, kv_heads: int):
  """Inverse of :func:`_per_head`: [B, N, T] -> [B, K, T * N // K]."""
  b, heads, seq_len = x.shape
  group = heads // kv_heads
  return x.reshape(b, kv_heads, group, seq_len).transpose(0, 1, 3, 2).reshape(
      b, kv_heads, seq_len * group)


def _tma_padded(x):
  """[B, S, K, H] keys or values, or [B, T, N, H] queries, padded with zeros to a
  multiple of TMA's 8-row tiles along axis 1 (a block past the end reads zeros)."""
  padded_seq = cdiv(x.shape[1], TMA_ROWS) * TMA_ROWS
  return jnp.pad(x, ((0, 0), (0, padded_seq - x.shape[1]), (0, 0), (0, 0)))


def _zeroed_past_lengths(x, kv_lengths):
  """:func:`_tma_padded` with zeros past each sequence's valid length too: what
  the Triton kernels' masked loads read there (garbage may be NaN). ``kv_lengths``
  None: every key is valid, nothing to zero."""
  if kv_lengths is None:
    return _tma_padded(x)
  positions = jnp.arange(x.shape[1])[None, :, None, None]
  return _tma_padded(jnp.where(positions < kv_lengths[:, None, None, None], x,
                                jnp.zeros((), x.dtype)))


def _scalars(kv_lengths, q_offsets):
  """[B, 2, 32] int32 (valid keys, first query's position): 128-byte rows, the
  smallest copy a warpgroup issues."""
  return jnp.broadcast_to(
      jnp.stack([kv_lengths, q_offsets], 1).astype(jnp.int32)[..., None],
      (kv_lengths.shape[0], 2, 32))


def _read_scalars(scalars_ref, scalar_smem, loaded, b, st: tri._Static, dense: bool):
  """This sequence's (valid keys, first query's position), read by every
  warpgroup; for a ``dense`` call (every key valid, no offsets) (S, 0), known
  when the kernel is built, so no CTA waits for a read before its key loads."""
  if dense:
    return st.seq, 0
  plgpu = mosaic_gpu()

  @pl.when(lax.axis_index("wg") == 0)
  def _():
    plgpu.copy_gmem_to_smem(scalars_ref.at[b], scalar_smem, loaded)

  plgpu.barrier_wait(loaded)
  return scalar_smem[0, 0], scalar_smem[1, 0]


def _stream_key_blocks(k_ref, v_ref, k_smem, v_smem, loaded, used, b, h, num_blocks, *,
                       block_k: int):
  """The producer of a kernel that walks key blocks of ``block_k`` keys 0 ..
  num_blocks - 1 of (sequence b, kv head h): each block's K and V into the ring
  of STAGES slots, a slot's K (V) refilled once both consumers have released
  that K (V)."""
  plgpu = mosaic_gpu()
  (k_loaded, v_loaded), (k_used, v_used) = loaded, used

  def load(kb, slot, ref, smem, barrier):
    block = (b, pl.ds(kb * block_k, block_k), h)
    plgpu.copy_gmem_to_smem(ref.at[block], smem.at[slot], barrier.at[slot])

  for kb in range(STAGES):
    @pl.when(kb < num_blocks)
    def _():
      load(kb, kb, k_ref, k_smem, k_loaded)
      load(kb, kb, v_ref, v_smem, v_loaded)

  @pl.loop(STAGES, jnp.maximum(num_blocks, STAGES))
  def _(kb):
    slot = lax.rem(kb, STAGES)
    plgpu.barrier_wait(k_used.at[slot])
    load(kb, slot, k_ref, k_smem, k_loaded)
    plgpu.barrier_wait(v_used.at[slot])
    load(kb, slot, v_ref, v_smem, v_loaded)


def _kernel(scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scratch, *, st: tri._Static,
            dense: bool):
  plgpu = mosaic_gpu()
  ops = mosaic_ops()
  wgmma_layout = plgpu.Layout.WGMMA
  (q_smem, k_smem, v_smem, ones_smem, lse_smem, scalar_smem), \
      (k_loaded, v_loaded, q_loaded, scalars_loaded), (k_used, v_used) = scratch
  dtype, width = q_smem.dtype, st.width
  blocks_per_chunk = st.tiles.chunk_k // PREFILL_BLOCK_K
  wg = lax.axis_index("wg")
  queries = _query_rows(st)
  row_tile, b, n = _longest_first(queries), lax.axis_index("batch"), lax.axis_index("head")
  h = lax.div(n, st.group)
  rows, has_rows = _consumer_rows(wg, row_tile, b, n, queries)

  @pl.when(jnp.logical_and(wg < 2, has_rows))
  def _load_queries():
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], q_loaded.at[wg])

  kv_len, offset = _read_scalars(scalars_ref, scalar_smem, scalars_loaded.at[0], b, st, dense)
  cta_blocks = jnp.maximum(_bounds(0, kv_len, offset, row_tile, queries, PREFILL_BLOCK_K)[2],
                           _bounds(1, kv_len, offset, row_tile, queries, PREFILL_BLOCK_K)[2])

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(PREFILL_CONSUMER_REGISTERS, action="increase")
    row_start, key_limit, num_blocks, clear_end = _bounds(wg, kv_len, offset, row_tile, queries,
                                                          PREFILL_BLOCK_K)
    ones_smem[wg] = plgpu.layout_cast(jnp.full((PREFILL_BLOCK_K, tri.ONES_COLUMNS), 1.0, dtype),
                                      wgmma_layout)
    plgpu.commit_smem()
    pl.when(has_rows)(lambda: plgpu.barrier_wait(q_loaded.at[wg]))
    shape = (ROWS, PREFILL_BLOCK_K)

    def block_step(kb, state, *, masked: bool):
      """``attention._block_step`` on key block ``kb``, in wgmma and PTX ops:
      ``acc * alpha`` becomes the accumulator that ``p @ V``'s wgmma chain adds to."""
      slot = lax.rem(kb, STAGES)
      m, l, acc = state
      plgpu.barrier_wait(k_loaded.at[slot])
      s = _logits(q_smem.at[wg], k_smem.at[slot], shape, st)
      plgpu.barrier_arrive(k_used.at[slot])
      if masked:
        row_pos = offset + row_start + _iota(shape, 0) if st.causal else None
        s = _masked(s, kb * PREFILL_BLOCK_K + _iota(shape, 1), key_limit, row_pos)
      m_new = jnp.maximum(m, s.max(axis=1))
      shift = tri._finite_or_zero(m_new)
      alpha = ops.exp2(m - shift)
      p = ops.exp2(s - ops.rows(shift, s.shape)).astype(dtype)
      scaled = ops.mul(acc, ops.rows(alpha, acc.shape))
      plgpu.barrier_wait(v_loaded.at[slot])

      def products(accumulators):
        sums_ref, acc_ref = accumulators
        plgpu.wgmma(sums_ref, p, ones_smem.at[wg])
        plgpu.wgmma(acc_ref, p, v_smem.at[slot])

      zero_sums = plgpu.layout_cast(jnp.full((ROWS, tri.ONES_COLUMNS), 0.0, jnp.float32),
                                    wgmma_layout)
      sums, acc = pl.run_state(products)((plgpu.ACC.init(zero_sums), plgpu.ACC.init(scaled)))
      plgpu.barrier_arrive(v_used.at[slot])
      return m_new, ops.fma(l, alpha, _equal_columns_row(sums)), acc

    def chunk(c, total):
      first = c * blocks_per_chunk
      end = jnp.minimum(first + blocks_per_chunk, num_blocks)
      middle = jnp.clip(clear_end, first, end)
      state = lax.fori_loop(first, middle, functools.partial(block_step, masked=False),
                            _empty(width))
      state = lax.fori_loop(middle, end, functools.partial(block_step, masked=True), state)
      return tri.merge_states(total, state, ops)

    num_chunks = (num_blocks + blocks_per_chunk - 1) // blocks_per_chunk
    total = lax.fori_loop(0, num_chunks, chunk, _empty(width))

    @pl.loop(num_blocks, cta_blocks)
    def _drain(kb):
      """Blocks the other consumer needs: consumed unseen."""
      slot = lax.rem(kb, STAGES)
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_arrive(k_used.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(v_used.at[slot])

    out, lse = tri.finalize_state(total, ops)
    q_smem[wg] = out.astype(dtype)
    lse_smem[wg] = lse
    plgpu.commit_smem()

    @pl.when(has_rows)
    def _store():  # TMA writes none of the rows past T
      plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[rows])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, pl.ds(row_start, ROWS)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PREFILL_PRODUCER_REGISTERS, action="decrease")
    _stream_key_blocks(k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_used, v_used),
                       b, h, cta_blocks, block_k=PREFILL_BLOCK_K)


def _checked_static(kernel: str, takes: bool, tile_terms: str, q, k, *, scale: float,
                    causal: bool, tiles: tri.AttentionTiles) -> tri._Static:
  """The static sizes of the Mosaic GPU ``kernel`` ("prefill" or "backward") for
  query [B, T, N, H] and keys [B, S, K, H], after checking that it takes them:
  ``takes`` (its ``supported`` test; ``tile_terms`` names the tiles it needs) and
  at least CTA_ROWS queries. Raises ValueError otherwise."""
  t, head_dim = q.shape[1], q.shape[3]
  if not takes:
    raise ValueError(f"the Mosaic GPU {kernel} takes 16-bit inputs, head sizes {HEAD_DIMS} and "
                     f"{tile_terms}; got {q.dtype}, {head_dim}, {tiles}")
  if t < CTA_ROWS:
    raise ValueError(f"the Mosaic GPU {kernel} takes at least {CTA_ROWS} queries; got {t}")
  return tri._static(q, k, scale=scale, causal=causal, tiles=tiles, interpret=False)


def attention_forward(q, k, v, kv_lengths, q_offsets, *, scale: float, causal: bool,
                      tiles: tri.AttentionTiles, dense: bool = False):
  """The prefill forward of :func:`pallas_kernels.attention.attention_forward`
  (same arguments and results, the same bits) on an sm_90 GPU; see
  :func:`supported` for the inputs and tiles it takes. ``dense``: the caller
  promises kv_lengths = S and q_offsets = 0 everywhere; the kernel then reads
  neither and copies no values to zero them past the lengths."""
  plgpu = mosaic_gpu()
  b, t, n, head_dim = q.shape
  kv_heads = k.shape[2]
  st = _checked_static("prefill", supported(q.dtype, head_dim, tiles),
                       f"{PREFILL_BLOCK_K}-key blocks", q, k, scale=scale, causal=causal,
                       tiles=tiles)
  row_tiles = cdiv(t, CTA_ROWS)
  q, k = _tma_padded(q), _tma_padded(k)
  v = _zeroed_past_lengths(v, None if dense else kv_lengths)
  scalars = _scalars(kv_lengths, q_offsets)
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  ones_tiled = (plgpu.TilingTransform((8, tri.ONES_COLUMNS)), plgpu.SwizzleTransform(32))

  def entry(scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    smem = (plgpu.SMEM((2, ROWS, head_dim), q.dtype, transforms=tiled),
            plgpu.SMEM((STAGES, PREFILL_BLOCK_K, head_dim), q.dtype, transforms=tiled),
            plgpu.SMEM((STAGES, PREFILL_BLOCK_K, head_dim), q.dtype, transforms=tiled),
            plgpu.SMEM((2, PREFILL_BLOCK_K, tri.ONES_COLUMNS), q.dtype, transforms=ones_tiled),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.SMEM((2, 32), jnp.int32))
    loaded = (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES),
              plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=1))
    shared = (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
              plgpu.Barrier(num_arrivals=2, num_barriers=STAGES))
    pl.run_scoped(
        lambda *scratch: _kernel(scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scratch,
                                 st=st, dense=dense),
        smem, loaded, shared, collective_axes="wg")

  out, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, n, row_tiles * CTA_ROWS), jnp.float32)),
      grid=(row_tiles, b, n), grid_names=("rows", "batch", "head"),
      num_threads=3, thread_name="wg",
  )(scalars, q, k, v)
  return out[:, :t], _packed(lse[:, :, :t], kv_heads)


# ---------------------------------------------------------------------------
# Backward: the Triton backward's dK/dV and dQ kernels at 64 x 64 tiles.


def _dkdv_kernel(scalars_ref, q_ref, do_ref, stats_ref, k_ref, v_ref, dk_ref, dv_ref, scratch,
                 *, st: tri._Static, dense: bool):
  """dK, dV of 64 keys per consumer warpgroup (two per CTA, adjacent), summed over
  the sequence's 64-row blocks in increasing order, which the producer streams
  (q, dout, and the rows' log-sum-exp and delta) to both."""
  plgpu = mosaic_gpu()
  ops = mosaic_ops()
  wgmma_layout = plgpu.Layout.WGMMA
  (k_smem, v_smem, q_smem, do_smem, stats_smem, scalar_smem), \
      (kv_loaded, rows_loaded, scalars_loaded), (rows_used,) = scratch
  dtype = q_smem.dtype
  wg = lax.axis_index("wg")
  key_tile, b, h = lax.axis_index("keys"), lax.axis_index("batch"), lax.axis_index("kv_head")
  kv_len, offset = _read_scalars(scalars_ref, scalar_smem, scalars_loaded.at[0], b, st, dense)
  key_limit = tri._key_limit(kv_len, st.seq)

  def bounds(consumer):
    key_start = (key_tile * 2 + consumer) * BACKWARD_BLOCK_K
    return (key_start, *tri.key_tile_row_bounds(key_start, BACKWARD_BLOCK_K, ROWS, key_limit,
                                                offset, st))

  cta_first, num_blocks = jnp.minimum(bounds(0)[1], bounds(1)[1]), bounds(0)[3]

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    key_start, first, clear, _ = bounds(wg)
    kv_block = (b, pl.ds(key_start, BACKWARD_BLOCK_K), h)
    plgpu.copy_gmem_to_smem(k_ref.at[kv_block], k_smem.at[wg], kv_loaded.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[kv_block], v_smem.at[wg], kv_loaded.at[2 + wg])
    plgpu.barrier_wait(kv_loaded.at[wg])
    plgpu.barrier_wait(kv_loaded.at[2 + wg])
    by_column = plgpu.Layout.WGMMA.reduce(0)

    def row_block(rb, carry, *, masked: bool):
      dk, dv = carry
      slot = lax.rem(rb, STAGES)
      plgpu.barrier_wait(rows_loaded.at[slot])

      s_t = _logits(k_smem.at[wg], q_smem.at[slot], (BACKWARD_BLOCK_K, ROWS), st)
      if masked:
        positions = None
        if st.causal:
          positions = offset + (rb * ROWS + _iota(s_t.shape, 1)) // st.group
        s_t = _masked(s_t, key_start + _iota(s_t.shape, 0), key_limit, positions)
      lse = plgpu.layout_cast(stats_smem[slot, 0], by_column)
      p_t = ops.exp2(s_t - lax.broadcast_in_dim(lse, s_t.shape, [1]))

      def values_and_dp(refs):
        dv_ref, dp_ref = refs
        plgpu.wgmma(dv_ref, p_t.astype(dtype), do_smem.at[slot])
        plgpu.wgmma(dp_ref, v_smem.at[wg], do_smem.at[slot].transpose((1, 0)))

      zeros = plgpu.layout_cast(jnp.full(s_t.shape, 0.0, jnp.float32), wgmma_layout)
      dv, dp_t = pl.run_state(values_and_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
      delta = plgpu.layout_cast(stats_smem[slot, 1], by_column)
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, s_t.shape, [1]))

      def keys_grad(dk_ref):
        plgpu.wgmma(dk_ref, ds_t.astype(dtype), q_smem.at[slot])

      dk = pl.run_state(keys_grad)(plgpu.ACC.init(dk))
      plgpu.barrier_arrive(rows_used.at[slot])
      return dk, dv

    @pl.loop(cta_first, first)
    def _skip(rb):
      """Row blocks only the other consumer needs: released unseen."""
      slot = lax.rem(rb, STAGES)
      plgpu.barrier_wait(rows_loaded.at[slot])
      plgpu.barrier_arrive(rows_used.at[slot])

    zeros = plgpu.layout_cast(jnp.full((BACKWARD_BLOCK_K, st.width), 0.0, jnp.float32),
                              wgmma_layout)
    carry = lax.fori_loop(first, clear, functools.partial(row_block, masked=True),
                          (zeros, zeros))
    dk, dv = lax.fori_loop(clear, num_blocks, functools.partial(row_block, masked=False), carry)
    k_smem[wg] = _scale_by(st.scale)(dk).astype(dtype)
    v_smem[wg] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[kv_block])
    plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[kv_block])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    def load(rb):
      slot = lax.rem(rb, STAGES)
      rows = (b, h, pl.ds(rb * ROWS, ROWS))
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], rows_loaded.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], rows_loaded.at[slot])
      plgpu.copy_gmem_to_smem(stats_ref.at[b, h, rb], stats_smem.at[slot], rows_loaded.at[slot])

    for i in range(STAGES):
      pl.when(cta_first + i < num_blocks)(functools.partial(load, cta_first + i))

    @pl.loop(cta_first + STAGES, num_blocks)
    def _(rb):
      plgpu.barrier_wait(rows_used.at[lax.rem(rb, STAGES)])
      load(rb)


def _dq_kernel(scalars_ref, q_ref, do_ref, stats_ref, k_ref, v_ref, dq_ref, scratch, *,
               st: tri._Static, dense: bool):
  """dQ of 64 packed rows per consumer warpgroup (two per CTA) over the key
  blocks they see in increasing order, which the producer streams."""
  plgpu = mosaic_gpu()
  ops = mosaic_ops()
  wgmma_layout = plgpu.Layout.WGMMA
  (q_smem, do_smem, stats_smem, k_smem, v_smem, scalar_smem), \
      (k_loaded, v_loaded, rows_loaded, scalars_loaded), (k_used, v_used) = scratch
  dtype = q_smem.dtype
  wg = lax.axis_index("wg")
  queries = _query_rows(st)
  row_tile, b, n = _longest_first(queries), lax.axis_index("batch"), lax.axis_index("head")
  h = lax.div(n, st.group)
  rows, has_rows = _consumer_rows(wg, row_tile, b, n, queries)

  @pl.when(jnp.logical_and(wg < 2, has_rows))
  def _load_rows():
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], rows_loaded.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], rows_loaded.at[wg])
    plgpu.copy_gmem_to_smem(stats_ref.at[b, n, row_tile * 2 + wg], stats_smem.at[wg],
                            rows_loaded.at[wg])

  kv_len, offset = _read_scalars(scalars_ref, scalar_smem, scalars_loaded.at[0], b, st, dense)
  cta_blocks = jnp.maximum(_bounds(0, kv_len, offset, row_tile, queries, BACKWARD_BLOCK_K)[2],
                           _bounds(1, kv_len, offset, row_tile, queries, BACKWARD_BLOCK_K)[2])

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    row_start, key_limit, num_blocks, clear_end = _bounds(wg, kv_len, offset, row_tile, queries,
                                                          BACKWARD_BLOCK_K)
    pl.when(has_rows)(lambda: plgpu.barrier_wait(rows_loaded.at[wg]))
    by_row = plgpu.Layout.WGMMA.reduce(1)
    lse = plgpu.layout_cast(stats_smem[wg, 0], by_row)
    delta = plgpu.layout_cast(stats_smem[wg, 1], by_row)

    def key_block(kb, dq, *, masked: bool):
      slot = lax.rem(kb, STAGES)
      plgpu.barrier_wait(k_loaded.at[slot])

      s = _logits(q_smem.at[wg], k_smem.at[slot], (ROWS, BACKWARD_BLOCK_K), st)
      if masked:
        positions = offset + row_start + _iota(s.shape, 0) if st.causal else None
        s = _masked(s, kb * BACKWARD_BLOCK_K + _iota(s.shape, 1), key_limit, positions)
      p = ops.exp2(s - ops.rows(lse, s.shape))
      plgpu.barrier_wait(v_loaded.at[slot])

      def dp_of(acc_ref):
        plgpu.wgmma(acc_ref, do_smem.at[wg], v_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      dp = pl.run_scoped(dp_of, plgpu.ACC((ROWS, BACKWARD_BLOCK_K), jnp.float32))
      plgpu.barrier_arrive(v_used.at[slot])
      ds = p * (dp - ops.rows(delta, s.shape))

      def queries_grad(dq_ref):
        plgpu.wgmma(dq_ref, ds.astype(dtype), k_smem.at[slot])

      dq = pl.run_state(queries_grad)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_used.at[slot])
      return dq

    middle = jnp.minimum(clear_end, num_blocks)
    dq = plgpu.layout_cast(jnp.full((ROWS, st.width), 0.0, jnp.float32), wgmma_layout)
    dq = lax.fori_loop(0, middle, functools.partial(key_block, masked=False), dq)
    dq = lax.fori_loop(middle, num_blocks, functools.partial(key_block, masked=True), dq)

    @pl.loop(num_blocks, cta_blocks)
    def _drain(kb):
      """Key blocks only the other consumer needs: released unseen."""
      slot = lax.rem(kb, STAGES)
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_arrive(k_used.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(v_used.at[slot])

    q_smem[wg] = _scale_by(st.scale)(dq).astype(dtype)
    plgpu.commit_smem()

    @pl.when(has_rows)
    def _store():  # TMA writes none of the rows past T
      plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")
    _stream_key_blocks(k_ref, v_ref, k_smem, v_smem, (k_loaded, v_loaded), (k_used, v_used),
                       b, h, cta_blocks, block_k=BACKWARD_BLOCK_K)


def attention_backward(q, k, v, dout, lse, delta, kv_lengths, q_offsets, *, scale: float,
                       causal: bool, tiles: tri.AttentionTiles, dense: bool = False):
  """dQ, dK and dV of :func:`pallas_kernels.attention.attention_backward` (the same
  bits as its Triton kernels at 64 x 64 backward tiles) on an sm_90 GPU.

  q, dout: [B, T, N, H]; k, v: [B, S, K, H]; lse, delta: [B, K, T * N // K]
  float32 (the forward's base-2 log-sum-exp, rowsum(out * dout)). ``dense``: as
  :func:`attention_forward`'s. Returns (dq [B, T, N, H], dk, dv [B, S, K, H]) in
  the inputs' dtypes.
  """
  plgpu = mosaic_gpu()
  b, t, n, head_dim = q.shape
  seq, kv_heads = k.shape[1], k.shape[2]
  st = _checked_static("backward", supported_backward(q.dtype, head_dim, tiles),
                       f"{ROWS} x {BACKWARD_BLOCK_K} backward tiles", q, k, scale=scale,
                       causal=causal, tiles=tiles)
  rows = st.rows
  padded_rows = cdiv(rows, ROWS) * ROWS
  row_pad = ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0))
  qp, dop = (jnp.pad(tri.pack_rows(x, kv_heads), row_pad) for x in (q, dout))
  stats = _row_stats(lse, delta, padded_rows)
  row_tiles = cdiv(t, CTA_ROWS)
  head_stats = _row_stats(_per_head(lse, t), _per_head(delta, t), row_tiles * CTA_ROWS)
  k, v = (_zeroed_past_lengths(x, None if dense else kv_lengths) for x in (k, v))
  scalars = _scalars(kv_lengths, q_offsets)
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  blocks = plgpu.SMEM((2, ROWS, head_dim), q.dtype, transforms=tiled)
  stream = plgpu.SMEM((STAGES, BACKWARD_BLOCK_K, head_dim), q.dtype, transforms=tiled)

  def dkdv_entry(scalars_ref, q_ref, do_ref, stats_ref, k_ref, v_ref, dk_ref, dv_ref):
    smem = (blocks, blocks, stream, stream, plgpu.SMEM((STAGES, 2, ROWS), jnp.float32),
            plgpu.SMEM((2, 32), jnp.int32))
    loaded = (plgpu.Barrier(num_barriers=4), plgpu.Barrier(num_arrivals=3, num_barriers=STAGES),
              plgpu.Barrier(num_barriers=1))
    used = (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),)
    pl.run_scoped(
        lambda *scratch: _dkdv_kernel(scalars_ref, q_ref, do_ref, stats_ref, k_ref, v_ref,
                                      dk_ref, dv_ref, scratch, st=st, dense=dense),
        smem, loaded, used, collective_axes="wg")

  padded_seq = cdiv(seq, 2 * BACKWARD_BLOCK_K) * 2 * BACKWARD_BLOCK_K
  kv_grad = jax.ShapeDtypeStruct((b, padded_seq, kv_heads, head_dim), k.dtype)
  dk, dv = plgpu.kernel(
      dkdv_entry, out_type=(kv_grad, kv_grad),
      grid=(padded_seq // (2 * BACKWARD_BLOCK_K), b, kv_heads),
      grid_names=("keys", "batch", "kv_head"),
      num_threads=3, thread_name="wg",
  )(scalars, qp, dop, stats, k, v)

  def dq_entry(scalars_ref, q_ref, do_ref, stats_ref, k_ref, v_ref, dq_ref):
    smem = (blocks, blocks, plgpu.SMEM((2, 2, ROWS), jnp.float32), stream, stream,
            plgpu.SMEM((2, 32), jnp.int32))
    loaded = (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES),
              plgpu.Barrier(num_arrivals=3, num_barriers=2), plgpu.Barrier(num_barriers=1))
    used = (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES))
    pl.run_scoped(
        lambda *scratch: _dq_kernel(scalars_ref, q_ref, do_ref, stats_ref, k_ref, v_ref, dq_ref,
                                    scratch, st=st, dense=dense),
        smem, loaded, used, collective_axes="wg")

  q, dout = _tma_padded(q), _tma_padded(dout)
  dq = plgpu.kernel(
      dq_entry, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(row_tiles, b, n), grid_names=("rows", "batch", "head"),
      num_threads=3, thread_name="wg",
  )(scalars, q, dout, head_stats, k, v)
  return dq[:, :t], dk[:, :seq], dv[:, :seq]
