"""The attention prefill forward on Hopper tensor cores through Mosaic GPU (TMA + wgmma).

It computes the bits of :func:`pallas_kernels.attention.attention_forward_kernel`
(the Triton prefill kernel) under the same numerics contract (that module's
docstring), so :func:`pallas_kernels.attention.attention_forward` may send any
prefill to either and decode (Triton) still matches it bit for bit:

* the same packed rows, 64 of them per consumer warpgroup (a Triton row tile);
* keys in 64-key blocks aligned to absolute positions, in increasing order, in
  chunks of ``chunk_k`` keys that start from the empty state and merge into the
  total with :func:`~pallas_kernels.attention.merge_states`, which with
  :func:`~pallas_kernels.attention.finalize_state` runs here on
  :func:`mosaic_ops`: the same PTX instructions as the Triton kernels' ops;
* the logits ``mul.rn(q . k, scale * log2(e))``, the row sum of a block from
  ``p @ ones`` on the tensor cores, ``p @ V`` from zero and one ``fma.rn`` into
  the state: the same k16 ``wgmma`` chains as Triton's dots.

A CTA owns 128 packed rows of one (sequence, kv head): one producer warpgroup
streams K/V blocks into a ring of shared-memory stages, two consumer
warpgroups each take 64 rows, taking turns on the tensor cores (a shared
schedule barrier) so that one's softmax overlaps the other's products. The
chunk total's accumulator lives in shared memory (registers would spill).
Values of V past a sequence's valid length are zeroed before the kernel (the
Triton kernels never load them; garbage there may be NaN, and p = 0 times NaN
is NaN). 16-bit inputs, head sizes 64 and 128.
"""

from __future__ import annotations

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
STAGES = 2          # K/V blocks in flight (3 ran 2% slower at the bench prefill)
HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
BLOCK_K = 64        # the only key block the kernel takes (the 16-bit tiles' block_k)
TMA_ROWS = 8        # TMA tiles a sequence by 8 keys


def supported(dtype, head_dim: int, tiles: tri.AttentionTiles) -> bool:
  """Whether this kernel computes a prefill with these inputs and tiles."""
  return (jnp.dtype(dtype) in DTYPES and head_dim in HEAD_DIMS
          and tiles.block_k == BLOCK_K and tiles.chunk_k % BLOCK_K == 0)


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
  return tri.Float32Ops(
      mul=_ptx_op("mul.rn.f32 $0, $1, $2;"), fma=_ptx_op("fma.rn.f32 $0, $1, $2, $3;"),
      div=_ptx_op("div.rn.f32 $0, $1, $2;"), exp2=_ptx_op("ex2.approx.ftz.f32 $0, $1;"),
      log2=_ptx_op("lg2.approx.ftz.f32 $0, $1;"),
      rows=lambda x, shape: lax.broadcast_in_dim(x, shape, [0]))


@functools.cache
def _scale_by(factor: float):
  """``mul.rn.f32`` by a float32 constant, as an immediate operand (a constant
  array would take registers)."""
  bits = np.float32(factor).view(np.uint32)
  return _ptx_op(f"mul.rn.f32 $0, $1, 0f{bits:08X};")


def _empty(width: int):
  plgpu = mosaic_gpu()
  row = plgpu.Layout.WGMMA.reduce(1)
  return (plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row),
          plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row),
          plgpu.layout_cast(jnp.full((ROWS, width), 0.0, jnp.float32), plgpu.Layout.WGMMA))


def _bounds(wg, kv_len, offset, row_tile, st: tri._Static):
  """A consumer's first row, key limit, key blocks and first masked block
  (:func:`~pallas_kernels.attention.tile_key_bounds` of its 64 rows; none for
  rows wholly past the array)."""
  row_start = (row_tile * 2 + wg) * ROWS
  key_limit, bound, clear = tri.tile_key_bounds(row_start, ROWS, kv_len, offset, st)
  bound = jnp.where(row_start < st.rows, bound, 0)
  return row_start, key_limit, (bound + BLOCK_K - 1) // BLOCK_K, clear // BLOCK_K


def _kernel(scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scratch, *, st: tri._Static):
  plgpu = mosaic_gpu()
  ops = mosaic_ops()
  wgmma_layout = plgpu.Layout.WGMMA
  (q_smem, k_smem, v_smem, ones_smem, total_smem, lse_smem, scalar_smem), \
      (k_loaded, v_loaded, q_loaded, scalars_loaded), (k_used, v_used, turns) = scratch
  dtype, width = q_smem.dtype, st.width
  blocks_per_chunk = st.tiles.chunk_k // BLOCK_K
  wg = lax.axis_index("wg")
  row_tile, b, h = lax.axis_index("rows"), lax.axis_index("batch"), lax.axis_index("kv_head")

  @pl.when(wg == 0)
  def _():
    plgpu.copy_gmem_to_smem(scalars_ref.at[b], scalar_smem, scalars_loaded.at[0])

  plgpu.barrier_wait(scalars_loaded.at[0])
  kv_len, offset = scalar_smem[0, 0], scalar_smem[1, 0]
  cta_blocks = jnp.maximum(_bounds(0, kv_len, offset, row_tile, st)[2],
                           _bounds(1, kv_len, offset, row_tile, st)[2])

  def take_turn():
    plgpu.barrier_arrive(turns)
    plgpu.barrier_wait(turns)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    row_start, key_limit, num_blocks, clear_end = _bounds(wg, kv_len, offset, row_tile, st)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(row_start, ROWS)], q_smem.at[wg],
                            q_loaded.at[wg])
    ones_smem[wg] = plgpu.layout_cast(jnp.full((BLOCK_K, tri.ONES_COLUMNS), 1.0, dtype),
                                      wgmma_layout)
    total_smem[wg] = plgpu.layout_cast(jnp.full((ROWS, width), 0.0, jnp.float32), wgmma_layout)
    plgpu.commit_smem()
    plgpu.barrier_wait(q_loaded.at[wg])
    row_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK_K), 0, layout=wgmma_layout)
    key_ids = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK_K), 1, layout=wgmma_layout)
    row_pos = offset + (row_start + row_ids) // st.group

    def block_step(kb, state, *, masked: bool):
      """``attention._block_step`` on key block ``kb``, in wgmma and PTX ops."""
      slot = lax.rem(kb, STAGES)
      plgpu.barrier_wait(k_loaded.at[slot])

      def logits_of(acc_ref):
        plgpu.wgmma(acc_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        take_turn()
        return acc_ref[...]

      s = pl.run_scoped(logits_of, plgpu.ACC((ROWS, BLOCK_K), jnp.float32))
      plgpu.barrier_arrive(k_used.at[slot])
      s = _scale_by(st.scale * tri.LOG2E)(s)
      if masked:
        keys = kb * BLOCK_K + key_ids
        mask = keys < key_limit
        if st.causal:
          mask = jnp.logical_and(mask, keys <= row_pos)
        s = jnp.where(mask, s, -jnp.inf)
      m, l, acc = state
      m_new = jnp.maximum(m, s.max(axis=1))
      shift = tri._finite_or_zero(m_new)
      alpha = ops.exp2(m - shift)
      p = ops.exp2(s - ops.rows(shift, s.shape)).astype(dtype)
      plgpu.barrier_arrive(turns)
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_wait(turns)

      def products(sums_ref, pv_ref):
        plgpu.wgmma(sums_ref, p, ones_smem.at[wg])
        plgpu.wgmma(pv_ref, p, v_smem.at[slot])
        return sums_ref[...], pv_ref[...]

      sums, pv = pl.run_scoped(products, plgpu.ACC((ROWS, tri.ONES_COLUMNS), jnp.float32),
                               plgpu.ACC((ROWS, width), jnp.float32))
      l_block = sums.max(axis=1)
      plgpu.barrier_arrive(v_used.at[slot])
      return m_new, ops.fma(l, alpha, l_block), ops.fma(acc, ops.rows(alpha, acc.shape), pv)

    def chunk(c, total):
      first = c * blocks_per_chunk
      end = jnp.minimum(first + blocks_per_chunk, num_blocks)
      middle = jnp.clip(clear_end, first, end)
      state = lax.fori_loop(first, middle, functools.partial(block_step, masked=False),
                            _empty(width))
      state = lax.fori_loop(middle, end, functools.partial(block_step, masked=True), state)
      total_acc = total_smem[wg]
      m, l, total_acc = tri.merge_states((*total, total_acc), state, ops)
      total_smem[wg] = total_acc
      return m, l

    pl.when(wg == 1)(take_turn)
    num_chunks = (num_blocks + blocks_per_chunk - 1) // blocks_per_chunk
    m, l = lax.fori_loop(0, num_chunks, chunk, _empty(width)[:2])

    @pl.loop(num_blocks, cta_blocks)
    def _drain(kb):
      """Blocks the other consumer needs: consumed unseen, turns taken."""
      slot = lax.rem(kb, STAGES)
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_arrive(k_used.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(v_used.at[slot])
      take_turn()
      take_turn()

    pl.when(wg == 0)(take_turn)
    acc = total_smem[wg]
    out, lse = tri.finalize_state((m, l, acc), ops)
    q_smem[wg] = out.astype(dtype)
    lse_smem[wg] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[b, h, pl.ds(row_start, ROWS)])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(row_start, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    def load(kb, slot):
      block = (b, pl.ds(kb * BLOCK_K, BLOCK_K), h)
      plgpu.copy_gmem_to_smem(k_ref.at[block], k_smem.at[slot], k_loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[block], v_smem.at[slot], v_loaded.at[slot])

    for kb in range(STAGES):
      pl.when(kb < cta_blocks)(functools.partial(load, kb, kb))

    @pl.loop(STAGES, jnp.maximum(cta_blocks, STAGES))
    def _(kb):
      slot = lax.rem(kb, STAGES)
      plgpu.barrier_wait(k_used.at[slot])
      plgpu.barrier_wait(v_used.at[slot])
      load(kb, slot)


def attention_forward(q, k, v, kv_lengths, q_offsets, *, scale: float, causal: bool,
                      tiles: tri.AttentionTiles):
  """The prefill forward of :func:`pallas_kernels.attention.attention_forward`
  (same arguments and results, the same bits) on an sm_90 GPU; see
  :func:`supported` for the inputs and tiles it takes."""
  plgpu = mosaic_gpu()
  b, t, n, head_dim = q.shape
  seq, kv_heads = k.shape[1], k.shape[2]
  if not supported(q.dtype, head_dim, tiles):
    raise ValueError(f"the Mosaic GPU prefill takes 16-bit inputs, head sizes {HEAD_DIMS} and "
                     f"{BLOCK_K}-key blocks; got {q.dtype}, {head_dim}, {tiles}")
  st = tri._static(q, k, scale=scale, causal=causal, tiles=tiles, interpret=False)
  rows = st.rows
  padded_rows = cdiv(rows, CTA_ROWS) * CTA_ROWS
  qp = jnp.pad(tri.pack_rows(q, kv_heads), ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
  positions = jnp.arange(seq)[None, :, None, None]
  v = jnp.where(positions < kv_lengths[:, None, None, None], v, jnp.zeros((), v.dtype))
  padded_seq = cdiv(seq, TMA_ROWS) * TMA_ROWS
  if padded_seq != seq:
    pad = ((0, 0), (0, padded_seq - seq), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  # [B, 2, 32] int32: 128-byte rows, the smallest copy a warpgroup issues.
  scalars = jnp.broadcast_to(jnp.stack([kv_lengths, q_offsets], 1).astype(jnp.int32)[..., None],
                             (b, 2, 32))
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  ones_tiled = (plgpu.TilingTransform((8, tri.ONES_COLUMNS)), plgpu.SwizzleTransform(32))
  total_tiled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

  def entry(scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    smem = (plgpu.SMEM((2, ROWS, head_dim), q.dtype, transforms=tiled),
            plgpu.SMEM((STAGES, BLOCK_K, head_dim), q.dtype, transforms=tiled),
            plgpu.SMEM((STAGES, BLOCK_K, head_dim), q.dtype, transforms=tiled),
            plgpu.SMEM((2, BLOCK_K, tri.ONES_COLUMNS), q.dtype, transforms=ones_tiled),
            plgpu.SMEM((2, ROWS, head_dim), jnp.float32, transforms=total_tiled),
            plgpu.SMEM((2, ROWS), jnp.float32),
            plgpu.SMEM((2, 32), jnp.int32))
    loaded = (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES),
              plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=1))
    shared = (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
              plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
              plgpu.Barrier(num_arrivals=2))
    pl.run_scoped(
        lambda *scratch: _kernel(scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scratch,
                                 st=st),
        smem, loaded, shared, collective_axes="wg")

  op, lse = plgpu.kernel(
      entry,
      out_type=(jax.ShapeDtypeStruct((b, kv_heads, padded_rows, head_dim), q.dtype),
                jax.ShapeDtypeStruct((b, kv_heads, padded_rows), jnp.float32)),
      grid=(padded_rows // CTA_ROWS, b, kv_heads), grid_names=("rows", "batch", "kv_head"),
      num_threads=3, thread_name="wg",
  )(scalars, qp, k, v)
  return tri.unpack_rows(op[:, :, :rows], t), lse[:, :, :rows]
