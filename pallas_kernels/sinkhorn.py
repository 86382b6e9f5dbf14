"""Batch-invariant Sinkhorn-Knopp kernels for mHC, token-minor.

Layout: a batch of T matrices of n x n is a [T, n*n] array (row-major matrices,
one token per row). A program owns ``block_tokens`` tokens and holds each matrix
row as a [block_tokens, width] array (width = n rounded up to a power of two,
zero-filled), so a column sum is an unrolled chain of adds over the rows in
increasing order and a row sum is a reduction along the row whose order is
fixed by the tile (which depends on n only). No operation mixes tokens: a token's bits depend on its own logits only, never on the block
size, the grid, or the other tokens (tail tokens of the last block are masked
on load and store; a NaN token stays in its own lanes).

Iteration (see ``jdet.sinkhorn`` for the formulas): an *init* (softmax rows + eps
then one column normalisation, or exp of the shifted logits), then ``units``
repetitions of two normalisations (rows then columns after the softmax init,
columns then rows after the exp init), each a fixed-count ``lax.fori_loop``.
A normalisation takes one reciprocal per line sum and multiplies; the jnp
reference divides, so the two agree to float32 rounding, not bitwise.

Kernels:
  * :func:`sinkhorn_forward_kernel` - the projection.
  * :func:`sinkhorn_unrolled_backward_kernel` - the exact VJP of the finite
    iteration. It recomputes the iterates on chip: ``checkpoints`` iterates are
    kept in registers (segment starts), and inside a segment each iterate is
    recomputed from the segment start (cost ~ units * segment / 2 extra units).
  * :func:`sinkhorn_implicit_backward_kernel` - the fixed-point VJP from the
    corrected linear system, solved by guarded conjugate gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (block_mask, cdiv, compiler_params,
                                    load_block, pad_axis, store_block,
                                    sum_in_order)

MAX_N = 16
INITS = ("softmax", "exp")
COLUMNS, ROWS = 0, 1


@dataclasses.dataclass(frozen=True)
class SinkhornTiles:
  """Tokens per program, Triton warps, and iterates the unrolled backward keeps."""
  block_tokens: int
  num_warps: int
  checkpoints: int = 1


# GPU tiles by the largest n they serve; never a function of the token count.
# Measured on the H100 (benchmarks/tune_sinkhorn.py, 2026-11-22, jax 0.11.2,
# 65,536 tokens, 20 iterations, CUPTI kernel time): one token per thread
# (block_tokens = 32 * num_warps) is what matters. Forward n = 4: 8.5-8.7 us at
# (32, 1), (64, 2), (128, 4), (256, 8) against 15 us with two tokens per thread;
# n = 8: 33.5 us at (256, 8), 35.0 at (128, 4). Unrolled backward n = 4: 31.9 us at
# (128, 4, 6 checkpoints), 32.7-36.2 us with 4 or 10 checkpoints or fewer warps;
# n = 8: 290 us for every candidate. Implicit backward (same tiles): 8.0 us at
# n = 4 and 38 us at n = 8 with (128, 4). n = 16 is not measured: one token per
# thread again, with few warps because a token's state is 256 floats. Every
# candidate gave the same bits as every other.
GPU_FORWARD_TABLE: tuple[tuple[int, SinkhornTiles], ...] = (
    (4, SinkhornTiles(128, 4)),
    (8, SinkhornTiles(256, 8)),
    (16, SinkhornTiles(64, 2)),
)
GPU_BACKWARD_TABLE: tuple[tuple[int, SinkhornTiles], ...] = (
    (4, SinkhornTiles(128, 4, checkpoints=6)),
    (8, SinkhornTiles(128, 4, checkpoints=2)),
    (16, SinkhornTiles(64, 2, checkpoints=1)),
)

# Interpret mode (CPU): one tile for every n, and a single checkpoint, which
# keeps the traced kernel (and XLA:CPU compile time) small.
INTERPRET_TILES = SinkhornTiles(128, 4)


def sinkhorn_tiles(n: int, *, backward: bool, interpret: bool) -> SinkhornTiles:
  """Tiles for n x n matrices; depends on n and the pass only."""
  if interpret:
    return INTERPRET_TILES
  for max_n, tiles in GPU_BACKWARD_TABLE if backward else GPU_FORWARD_TABLE:
    if n <= max_n:
      return tiles
  raise ValueError(f"n = {n} exceeds the largest supported n = {MAX_N}")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static shape of the iteration: init, unit count and unit axes."""
  n: int
  eps: float
  softmax_init: bool
  units: int

  @property
  def axes(self) -> tuple[int, int]:
    return (ROWS, COLUMNS) if self.softmax_init else (COLUMNS, ROWS)

  @property
  def zero_free(self) -> bool:
    """No iterate has an exact zero: softmax + eps, and no padding columns."""
    return self.softmax_init and self.n == pl.next_power_of_2(self.n)


def _plan(n: int, iters: int, eps: float, init: str) -> _Plan:
  if init not in INITS:
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
  softmax_init = init == "softmax"
  # The softmax init already did the first column normalisation.
  return _Plan(n, float(eps), softmax_init, iters - 1 if softmax_init else iters)


# ---------------------------------------------------------------------------
# Matrix algebra on one block: a matrix is a tuple of n rows, each a
# [block_tokens, width] array (width = n rounded up to a power of two; the extra
# columns hold exact zeros). Column quantities are one [block_tokens, width]
# array, row quantities a list of n [block_tokens, 1] arrays.


def _row_sum(row):
  return jnp.sum(row, axis=1, keepdims=True)


def _sums(m, axis: int):
  """The column sums (axis 0: one array) or the row sums (axis 1: a list)."""
  return sum_in_order(m) if axis == COLUMNS else [_row_sum(row) for row in m]


def _per_row(values, axis: int, i: int):
  """What applies to row i: the column array itself, or row i's entry of a list."""
  return values if axis == COLUMNS else values[i]


def _map(fn, values, axis: int):
  return fn(values) if axis == COLUMNS else [fn(v) for v in values]


def _normalize(m, plan: _Plan, axis: int):
  """Divides each column (axis 0) or row (axis 1) by its guarded sum.

  Returns (result, reciprocals, sums); the softmax convention adds eps to the
  sum, the exp convention clamps it below at eps. One reciprocal per sum.
  """
  sums = _sums(m, axis)
  if plan.softmax_init:
    inv = _map(lambda s: 1.0 / (s + plan.eps), sums, axis)
  else:
    inv = _map(lambda s: 1.0 / jnp.maximum(s, plan.eps), sums, axis)
  return tuple(row * _per_row(inv, axis, i) for i, row in enumerate(m)), inv, sums


def _normalize_vjp(out, inv, sums, d_out, plan: _Plan, axis: int):
  """VJP of :func:`_normalize` from its result: inv * (d_out - d'(sum) * <d_out, out>)."""
  dots = _sums([g * y for g, y in zip(d_out, out)], axis)
  if not plan.softmax_init:  # d max(s, eps) / ds is 0 where the clamp is active.
    if axis == COLUMNS:
      dots = jnp.where(sums > plan.eps, dots, 0.0)
    else:
      dots = [jnp.where(s > plan.eps, t, 0.0) for s, t in zip(sums, dots)]
  d_in = tuple(_per_row(inv, axis, i) * (g - _per_row(dots, axis, i))
               for i, g in enumerate(d_out))
  if not plan.zero_free:
    # An entry that is exactly 0 only ever meets its cotangent multiplied by
    # itself (in the dots above and in the init's VJP), so its cotangent is 0.
    # Without this, the 1/eps factors of all-zero lines (exp underflow, -inf
    # logits, padding columns) overflow to inf, and inf * 0 would spread NaN.
    d_in = tuple(jnp.where(y == 0, 0.0, d) for y, d in zip(out, d_in))
  return d_in


def _unit(m, plan: _Plan):
  for axis in plan.axes:
    m, _, _ = _normalize(m, plan, axis)
  return m


def _unit_vjp(m, d_out, plan: _Plan):
  first, second = plan.axes
  half, half_inv, half_sums = _normalize(m, plan, first)
  out, out_inv, out_sums = _normalize(half, plan, second)
  d_half = _normalize_vjp(out, out_inv, out_sums, d_out, plan, second)
  return _normalize_vjp(half, half_inv, half_sums, d_half, plan, first)


def _shift(top):
  """The max to subtract, 0 where every entry is -inf (so exp gives 0, not NaN)."""
  return jnp.where(top == -jnp.inf, 0.0, top)


def _softmax_rows(x):
  probs = []
  for row in x:
    exps = jnp.exp(row - _shift(jnp.max(row, axis=1, keepdims=True)))
    total = _row_sum(exps)
    probs.append(exps * (1.0 / jnp.where(total > 0, total, 1.0)))  # all -inf: no mass
  return tuple(probs)


def _init(x, plan: _Plan, real_columns):
  """The iterate before the first unit; x's padding columns are -inf."""
  if plan.softmax_init:
    p = tuple(jnp.where(real_columns, q + plan.eps, 0.0) for q in _softmax_rows(x))
    return _normalize(p, plan, COLUMNS)[0]
  return _exp_shifted(x)


def _exp_shifted(x):
  shift = _shift(functools.reduce(jnp.maximum, [jnp.max(row, axis=1, keepdims=True)
                                                for row in x]))
  return tuple(jnp.exp(row - shift) for row in x)


def _init_vjp(x, d_start, plan: _Plan, real_columns):
  """Cotangent of the logits from that of the iterate :func:`_init` returns."""
  if not plan.softmax_init:
    return tuple(e * g for e, g in zip(_exp_shifted(x), d_start))
  probs = _softmax_rows(x)
  p = tuple(jnp.where(real_columns, q + plan.eps, 0.0) for q in probs)
  start, inv, sums = _normalize(p, plan, COLUMNS)
  d_probs = _normalize_vjp(start, inv, sums, d_start, plan, COLUMNS)
  return tuple(q * (g - _row_sum(g * q)) for g, q in zip(d_probs, probs))


def _segment_lengths(units: int, checkpoints: int) -> list[int]:
  """Splits the units into at most ``checkpoints`` near-equal segments."""
  count = max(1, min(checkpoints, units))
  return [units // count + (g < units % count) for g in range(count)]


# ---------------------------------------------------------------------------
# Kernels. Refs are [block_tokens, n * width] blocks: row i of a token's
# matrix is columns i*width .. i*width + width - 1.


def _token_mask(block: int, tokens: int):
  return block_mask(pl.program_id(0) * block, block, tokens)


def _real_columns(n: int, width: int):
  return (jnp.arange(width) < n)[None, :]


def _load_matrix(ref, valid, n: int):
  """The block's n rows in float32, each [block_tokens, width]; masked tokens read 0."""
  width = ref.shape[1] // n
  return tuple(load_block(ref.at[:, pl.ds(i * width, width)], rows=valid).astype(jnp.float32)
               for i in range(n))


def _load_logits(ref, valid, n: int):
  """Like :func:`_load_matrix`, with -inf in the padding columns."""
  x = _load_matrix(ref, valid, n)
  width = ref.shape[1] // n
  if width == n:
    return x
  return tuple(jnp.where(_real_columns(n, width), row, -jnp.inf) for row in x)


def _store_matrix(ref, m, valid):
  width = m[0].shape[1]
  for i, row in enumerate(m):
    store_block(ref.at[:, pl.ds(i * width, width)], row.astype(ref.dtype), rows=valid)


def sinkhorn_forward_kernel(x_ref, o_ref, *, plan: _Plan, tokens: int):
  """x_ref: [block_tokens, n*width] logits (any float); o_ref: same block, float32."""
  valid = _token_mask(x_ref.shape[0], tokens)
  x = _load_logits(x_ref, valid, plan.n)
  real = _real_columns(plan.n, x[0].shape[1])
  out = lax.fori_loop(0, plan.units, lambda _, m: _unit(m, plan), _init(x, plan, real))
  _store_matrix(o_ref, out, valid)


def sinkhorn_unrolled_backward_kernel(x_ref, g_ref, dx_ref, *, plan: _Plan, tokens: int,
                                      checkpoints: int):
  """Exact VJP of the finite iteration, recomputing the iterates on chip.

  x_ref: [block_tokens, n*width] logits; g_ref: float32 cotangent of the result;
  dx_ref: cotangent of the logits (logits dtype). Memory: ``checkpoints``
  iterates per token; work: units + sum over segments of len*(len-1)/2 units
  recomputed, plus the VJPs.
  """
  valid = _token_mask(x_ref.shape[0], tokens)
  x = _load_logits(x_ref, valid, plan.n)
  real = _real_columns(plan.n, x[0].shape[1])
  step = lambda _, m: _unit(m, plan)
  lengths = _segment_lengths(plan.units, checkpoints)
  starts = [_init(x, plan, real)]
  for length in lengths[:-1]:
    starts.append(lax.fori_loop(0, length, step, starts[-1]))
  grad = _load_matrix(g_ref, valid, plan.n)
  for start, length in zip(reversed(starts), reversed(lengths)):

    def back(t, grad, start=start, length=length):
      before = lax.fori_loop(0, length - 1 - t, step, start)
      return _unit_vjp(before, grad, plan)

    grad = lax.fori_loop(0, length, back, grad)
  _store_matrix(dx_ref, _init_vjp(x, grad, plan, real), valid)


# CG on the corrected system stops along directions whose curvature p·Ap is
# below this fraction of p·p times the largest column sum: they are rounding
# noise in float32 (the exact null direction, 1, is projected out of b).
_CG_CURVATURE_FLOOR = 1e-6


def sinkhorn_implicit_backward_kernel(r_ref, g_ref, dx_ref, *, n: int, tokens: int,
                                      cg_steps: int):
  """Fixed-point VJP from the corrected system, per token.

  (diag(c) - Rᵀ diag(r)⁻¹ R) β = s_c - Rᵀ diag(r)⁻¹ s_r, solved by ``cg_steps``
  of conjugate gradients from β = 0 with b projected onto 1⊥ (the system's
  null direction) and a guarded curvature; u = diag(r)⁻¹ (s_r - R β);
  dlogits = (dR - u 1ᵀ - 1 βᵀ) ⊙ R. r_ref: [block_tokens, n*width] float32
  result R (zero padding columns); g_ref: its float32 cotangent; dx_ref: the
  cotangent of the logits. Column vectors (β, c, s_c) are [block_tokens, width].
  """
  valid = _token_mask(r_ref.shape[0], tokens)
  r = _load_matrix(r_ref, valid, n)
  g = _load_matrix(g_ref, valid, n)
  col_sums = _sums(r, COLUMNS)
  inv_rows = [1.0 / jnp.where(s > 0, s, 1.0) for s in _sums(r, ROWS)]  # zero rows stay 0
  weighted = tuple(a * b for a, b in zip(r, g))
  s_rows, s_cols = _sums(weighted, ROWS), _sums(weighted, COLUMNS)

  def r_times(v):  # R v, a row list
    return [_row_sum(row * v) for row in r]

  def rt_times(v):  # Rᵀ v, a column array
    return sum_in_order([row * x for row, x in zip(r, v)])

  def system(v):  # (diag(c) - Rᵀ diag(r)⁻¹ R) v
    return col_sums * v - rt_times([w * s for w, s in zip(inv_rows, r_times(v))])

  rhs = s_cols - rt_times([w * s for w, s in zip(inv_rows, s_rows)])
  rhs = jnp.where(_real_columns(n, rhs.shape[1]), rhs - _row_sum(rhs) * (1.0 / n), 0.0)
  floor = jnp.max(col_sums, axis=1, keepdims=True) * _CG_CURVATURE_FLOOR

  def cg_step(_, carry):
    beta, res, p, rr, active = carry
    ap = system(p)
    curvature = _row_sum(p * ap)
    active = active & (curvature > floor * _row_sum(p * p))
    alpha = jnp.where(active, rr / jnp.where(active, curvature, 1.0), 0.0)
    beta = beta + alpha * p
    res = res - alpha * ap
    rr_next = _row_sum(res * res)
    gamma = jnp.where(active & (rr > 0), rr_next / jnp.where(rr > 0, rr, 1.0), 0.0)
    return beta, res, res + gamma * p, rr_next, active

  rr = _row_sum(rhs * rhs)
  beta, *_ = lax.fori_loop(0, cg_steps, cg_step,
                           (jnp.zeros_like(rhs), rhs, rhs, rr, jnp.full(rr.shape, True)))
  u = [w * (s - t) for w, s, t in zip(inv_rows, s_rows, r_times(beta))]
  _store_matrix(dx_ref, tuple((gi - ui - beta) * ri for gi, ui, ri in zip(g, u, r)), valid)


# ---------------------------------------------------------------------------
# Launchers.


def _launch(kernel, inputs, *, out_dtype, tiles: SinkhornTiles, interpret: bool, name: str):
  """Runs ``kernel`` over [T, n, n] inputs, rows zero-padded to a power-of-two width."""
  tokens, n, _ = inputs[0].shape
  width = pl.next_power_of_2(n)
  flat = [pad_axis(x, 2, width).reshape(tokens, n * width) for x in inputs]
  block = tiles.block_tokens
  spec = pl.BlockSpec((block, n * width), lambda i: (i, 0))
  out = pl.pallas_call(
      functools.partial(kernel, tokens=tokens),
      grid=(cdiv(tokens, block),),
      in_specs=[spec] * len(inputs),
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((tokens, n * width), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, 1),
      interpret=interpret,
      name=name,
  )(*flat)
  return out.reshape(tokens, n, width)[:, :, :n]


@functools.partial(jax.jit, static_argnames=("iters", "eps", "init", "tiles", "interpret"))
def sinkhorn_forward(logits, *, iters: int, eps: float, init: str, tiles: SinkhornTiles,
                     interpret: bool):
  """logits: [T, n, n] (float32/bfloat16/float16); returns the [T, n, n] float32 projection."""
  plan = _plan(logits.shape[-1], iters, eps, init)
  return _launch(functools.partial(sinkhorn_forward_kernel, plan=plan), (logits,),
                 out_dtype=jnp.float32, tiles=tiles, interpret=interpret, name="jdet_sinkhorn")


@functools.partial(jax.jit, static_argnames=("iters", "eps", "init", "tiles", "interpret"))
def sinkhorn_unrolled_backward(logits, cotangent, *, iters: int, eps: float, init: str,
                               tiles: SinkhornTiles, interpret: bool):
  """logits: [T, n, n]; cotangent: [T, n, n] float32. Returns dlogits in logits' dtype."""
  kernel = functools.partial(sinkhorn_unrolled_backward_kernel,
                             plan=_plan(logits.shape[-1], iters, eps, init),
                             checkpoints=tiles.checkpoints)
  return _launch(kernel, (logits, cotangent), out_dtype=logits.dtype, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn_unrolled_bwd")


@functools.partial(jax.jit, static_argnames=("out_dtype", "tiles", "interpret"))
def sinkhorn_implicit_backward(result, cotangent, *, out_dtype, tiles: SinkhornTiles,
                               interpret: bool):
  """result, cotangent: [T, n, n] float32. Returns dlogits [T, n, n] in ``out_dtype``."""
  n = result.shape[-1]
  kernel = functools.partial(sinkhorn_implicit_backward_kernel, n=n, cg_steps=2 * n)
  return _launch(kernel, (result, cotangent), out_dtype=out_dtype, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn_implicit_bwd")
