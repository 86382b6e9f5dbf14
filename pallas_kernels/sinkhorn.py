"""Batch-invariant Sinkhorn-Knopp kernels for mHC, token-minor.

Layout: a batch of T matrices of n x n is a [T, n*n] array (row-major matrices,
one token per row). A program owns ``block_tokens`` tokens and holds each matrix
row as a [block_tokens, width] array (width = n rounded up to a power of two,
zero-filled), so a column sum is an unrolled chain of adds over the rows in
increasing order and a row sum is a reduction along the row whose order is
fixed by the tile (which depends on n only). No operation mixes tokens: a
token's bits depend on its own logits only, never on the block size, the grid,
or the other tokens (tokens past the count are masked on load and store; a NaN
token stays in its own lanes). The token count is a kernel operand on a bucketed
grid (``_common.counted_rows_call``): one compiled kernel serves every count of a
bucket.

Iteration (see ``jdet.sinkhorn`` for the formulas): an *init* (softmax rows + eps
then one column normalisation, or exp of the shifted logits), then ``units``
repetitions of two normalisations (rows then columns after the softmax init,
columns then rows after the exp init), each a fixed-count ``lax.fori_loop``.
A normalisation takes one reciprocal per line sum and multiplies (on the GPU
the hardware's approximate reciprocal, within 1 ulp); the jnp reference
divides, so the two agree to float32 rounding, not bitwise.

Kernels:
  * :func:`sinkhorn_forward_kernel` - the projection.
  * :func:`sinkhorn_unrolled_backward_kernel` - the exact VJP of the finite
    iteration. It recomputes the iterates on chip segment by segment, keeps
    only each normalisation's denominators, and walks the cotangent back as
    h = dR ⊙ R, rebuilding each earlier iterate by one multiply per entry.
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

from pallas_kernels._common import (cdiv, compiler_params, counted_rows_call, launcher,
                                    load_block, lookup_tiles, multiply_add, pad_axis,
                                    product, reciprocal, store_block, sum_in_order)

MAX_N = 16
INITS = ("softmax", "exp")
COLUMNS, ROWS = 0, 1


@dataclasses.dataclass(frozen=True)
class SinkhornTiles:
  """Tokens per program, Triton warps, and the unrolled backward's longest segment
  (units whose denominators it keeps per token)."""
  block_tokens: int
  num_warps: int
  segment_units: int = 1

  def __str__(self):
    return f"({self.block_tokens} tokens, {self.num_warps} warps, {self.segment_units} units)"


# GPU tiles by the largest n they serve; never a function of the token count.
# Every candidate was bitwise invariant; the sweep that chose them is in
# notes/h100_notebook.md, "Sinkhorn tile sweep" (`benchmarks/tune_sinkhorn.py`).
# A [block_tokens, width] row array puts a token's row in one thread for n <= 8
# (block_tokens below 32 * num_warps would only replicate work), and splits it
# over threads for n = 16.
GPU_FORWARD_TABLE: tuple[tuple[int, SinkhornTiles], ...] = (
    (4, SinkhornTiles(128, 4)),    # 6.3 us at 65,536 tokens
    (8, SinkhornTiles(256, 8)),    # 25 us
    (16, SinkhornTiles(32, 2)),    # 110 us (247 us at 64 or 128 tokens a program)
)
# The unrolled backward keeps segment_units iterations' denominators per token,
# and its compile time grows with the segment (each unit of it is unrolled twice):
# a new token count recompiles the kernel, so the segment is the longest whose
# backward compiles in about a second on the H100, about 48 matrix entries a
# segment (3 units at n = 4, 1 from n = 8). Longer segments recompute less
# (n = 4: 14.3 us and 9.5 s to compile at 20 units, 29 us and 1.1 s at 3; n = 8:
# 70 us and 12.6 s at 7 units, 169 us and 2.0 s at 1; benchmarks/results/h100.md).
# The implicit backward shares the tile (within noise of its own best).
GPU_BACKWARD_TABLE: tuple[tuple[int, SinkhornTiles], ...] = (
    (4, SinkhornTiles(128, 4, segment_units=3)),
    (8, SinkhornTiles(64, 4, segment_units=1)),
    (16, SinkhornTiles(32, 2, segment_units=1)),   # 1.3 ms (a 256-float state spills)
)

# Interpret mode (CPU): one tile for every n, and one-unit segments, which keep
# the traced kernel (and XLA:CPU compile time) small.
INTERPRET_TILES = SinkhornTiles(128, 4, segment_units=1)


def sinkhorn_tiles(n: int, *, backward: bool, interpret: bool) -> SinkhornTiles:
  """Tiles for n x n matrices; depends on n and the pass only."""
  if interpret:
    return INTERPRET_TILES
  return lookup_tiles(GPU_BACKWARD_TABLE if backward else GPU_FORWARD_TABLE, n)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static shape of the iteration: init, unit count and unit axes, and
  whether to use the GPU's approximate reciprocal and fused multiply-add
  (``native``; interpret mode cannot)."""
  n: int
  eps: float
  softmax_init: bool
  units: int
  native: bool

  @property
  def axes(self) -> tuple[int, int]:
    return (ROWS, COLUMNS) if self.softmax_init else (COLUMNS, ROWS)


def _plan(n: int, iters: int, eps: float, init: str, *, interpret: bool) -> _Plan:
  if init not in INITS:
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
  softmax_init = init == "softmax"
  # The softmax init already did the first column normalisation.
  return _Plan(n, float(eps), softmax_init, iters - 1 if softmax_init else iters,
               native=not interpret)


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


def _map2(fn, first, second, axis: int):
  return fn(first, second) if axis == COLUMNS else [fn(a, b) for a, b in zip(first, second)]


def _normalize(m, plan: _Plan, axis: int):
  """Divides each column (axis 0) or row (axis 1) by its guarded sum.

  Returns (result, denominators): the softmax convention's denominator is
  sum + eps, the exp convention's max(sum, eps). One reciprocal per line.
  """
  sums = _sums(m, axis)
  if plan.softmax_init:
    denominators = _map(lambda s: s + plan.eps, sums, axis)
  else:
    denominators = _map(lambda s: jnp.maximum(s, plan.eps), sums, axis)
  inv = _map(lambda d: reciprocal(d, approx=plan.native), denominators, axis)
  return tuple(row * _per_row(inv, axis, i) for i, row in enumerate(m)), denominators


def _normalize_vjp(out, denominators, h_out, plan: _Plan, axis: int):
  """Weighted VJP of :func:`_normalize`: h_in = h_out - sum(h_out) * out along ``axis``.

  ``h`` is a cotangent times its iterate entrywise (h = dR ⊙ R). For
  out = in / d with d = sum(in) + eps, d(in) = (d(out) - <d(out), out>) / d, so
  h_in = h_out - <d(out), out> ⊙ out with <d(out), out> the line sum of h_out:
  no division, and an exact-zero entry keeps h = 0 (no 1/eps factor can
  overflow). Where the exp convention's clamp max(sum, eps) is active the sum
  has no influence, so only h_in = h_out remains. On the GPU each entry is one
  fused multiply-add.
  """
  line_sums = _sums(h_out, axis)
  if not plan.softmax_init:
    line_sums = _map2(lambda t, d: jnp.where(d > plan.eps, t, 0.0), line_sums,
                      denominators, axis)
  return tuple(multiply_add(-_per_row(line_sums, axis, i), y, h, fused=plan.native)
               for i, (h, y) in enumerate(zip(h_out, out)))


def _denormalize(out, denominators, axis: int):
  """The input of :func:`_normalize` rebuilt from its result (to float32 rounding)."""
  return tuple(row * _per_row(denominators, axis, i) for i, row in enumerate(out))


def _unit(m, plan: _Plan):
  """One iteration (two normalizations); returns (result, the two denominators)."""
  denominators = []
  for axis in plan.axes:
    m, d = _normalize(m, plan, axis)
    denominators.append(d)
  return m, tuple(denominators)


def _unit_vjp(out, denominators, h_out, plan: _Plan):
  """Steps ``h`` back through one iteration; returns (rebuilt input, h_in)."""
  for axis, d in reversed(tuple(zip(plan.axes, denominators))):
    h_out = _normalize_vjp(out, d, h_out, plan, axis)
    out = _denormalize(out, d, axis)
  return out, h_out


def _iterate(m, count, plan: _Plan):
  """``count`` iterations (a traced or static int) of the forward."""
  return lax.fori_loop(0, count, lambda _, m: _unit(m, plan)[0], m)


def _shift(top):
  """The max to subtract, 0 where every entry is -inf (so exp gives 0, not NaN)."""
  return jnp.where(top == -jnp.inf, 0.0, top)


def _softmax_rows(x, plan: _Plan):
  probs = []
  for row in x:
    exps = jnp.exp(row - _shift(jnp.max(row, axis=1, keepdims=True)))
    total = _row_sum(exps)
    inv_total = reciprocal(jnp.where(total > 0, total, 1.0),  # all -inf: no mass
                           approx=plan.native)
    probs.append(exps * inv_total)
  return tuple(probs)


def _softmax_init_parts(x, plan: _Plan, real_columns):
  """(softmax probabilities q, P = q + eps); P's padding columns are 0."""
  probs = _softmax_rows(x, plan)
  return probs, tuple(jnp.where(real_columns, q + plan.eps, 0.0) for q in probs)


def _init(x, plan: _Plan, real_columns):
  """The iterate R0 before the first unit; x's padding columns are -inf."""
  if plan.softmax_init:
    return _normalize(_softmax_init_parts(x, plan, real_columns)[1], plan, COLUMNS)[0]
  return _exp_shifted(x)


def _exp_shifted(x):
  shift = _shift(functools.reduce(jnp.maximum, [jnp.max(row, axis=1, keepdims=True)
                                                for row in x]))
  return tuple(jnp.exp(row - shift) for row in x)


def _init_vjp(x, start, h_start, plan: _Plan, real_columns):
  """Cotangent of the logits from h = dR0 ⊙ R0, given R0 = ``start``."""
  if not plan.softmax_init:  # R0 = exp(x - shift): dx = dR0 ⊙ R0 (the shift is constant)
    return h_start
  probs, p = _softmax_init_parts(x, plan, real_columns)
  # The softmax convention's VJP reads no denominators.
  h_p = _normalize_vjp(start, None, h_start, plan, COLUMNS)
  d_probs = tuple(jnp.where(real_columns, h * reciprocal(pi, approx=plan.native),
                            0.0) for h, pi in zip(h_p, p))
  return tuple(q * (g - _row_sum(g * q)) for g, q in zip(d_probs, probs))


def _segments(units: int, max_length: int) -> tuple[int, int, int]:
  """Splits ``units`` into (count, length, rest): count segments of ``length``
  <= max_length after ``rest`` < count single units."""
  count = cdiv(units, max_length)
  return count, units // count, units % count


# ---------------------------------------------------------------------------
# Kernels. Refs are [block_tokens, n * width] blocks: row i of a token's
# matrix is columns i*width .. i*width + width - 1.


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


def sinkhorn_forward_kernel(x_ref, o_ref, *, plan: _Plan, valid):
  """x_ref: [block_tokens, n*width] logits (any float); o_ref: same block, float32."""
  x = _load_logits(x_ref, valid, plan.n)
  real = _real_columns(plan.n, x[0].shape[1])
  _store_matrix(o_ref, _iterate(_init(x, plan, real), plan.units, plan), valid)


def sinkhorn_unrolled_backward_kernel(x_ref, g_ref, dx_ref, *, plan: _Plan, valid,
                                      segment_units: int):
  """Exact VJP of the finite iteration, recomputing the iterates on chip.

  x_ref: [block_tokens, n*width] logits; g_ref: float32 cotangent of the result;
  dx_ref: cotangent of the logits (logits dtype). The cotangent travels as
  h = dR ⊙ R (see :func:`_normalize_vjp`). The units are cut into segments of
  at most ``segment_units``, last segment first: each is recomputed from the
  logits with the forward's own op sequence, keeping only its 2n denominators
  per unit, and walked back by rebuilding each input from its result and
  denominators (one multiply per entry). The walk ends at the rebuilt R0,
  which the init's VJP uses. Memory: 2n * segment length floats per token;
  work: about units * (segments + 1) / 2 forward units plus one backward unit
  per unit.
  """
  real = _real_columns(plan.n, x_ref.shape[1] // plan.n)
  start = lambda: _init(_load_logits(x_ref, valid, plan.n), plan, real)
  g = _load_matrix(g_ref, valid, plan.n)

  def walk_back(first_unit, length: int, h, is_last):
    """Returns (the rebuilt iterate before ``first_unit``, h there)."""
    m = _iterate(start(), first_unit, plan)
    denominators = []
    for _ in range(length):
      m, d = _unit(m, plan)
      denominators.append(d)
    h = tuple(jnp.where(is_last, a * y, a) for a, y in zip(h, m))  # dR -> dR ⊙ R at the end
    for d in reversed(denominators):
      m, h = _unit_vjp(m, d, h, plan)
    return m, h

  if plan.units == 0:
    m = start()
    h = tuple(a * y for a, y in zip(g, m))
  else:
    count, length, rest = _segments(plan.units, segment_units)

    def segment(k, carry):  # the k-th segment from the end
      return walk_back(rest + (count - 1 - k) * length, length, carry[1], k == 0)

    # A lone segment runs with static unit numbers, outside any loop. The carry
    # is (iterate, h); the iterate slot starts as any matrix.
    if count == 1:
      m, h = segment(0, (g, g))
    else:
      m, h = lax.fori_loop(0, count, segment, (g, g))
    if rest:
      m, h = lax.fori_loop(0, rest, lambda t, carry: walk_back(rest - 1 - t, 1, carry[1], False),
                           (m, h))
  _store_matrix(dx_ref, _init_vjp(_load_logits(x_ref, valid, plan.n), m, h, plan, real), valid)


# CG on the corrected system stops along directions whose curvature p·Ap is
# below this fraction of p·p times the largest column sum: they are rounding
# noise in float32 (the exact null direction, 1, is projected out of b).
_CG_CURVATURE_FLOOR = 1e-6


def sinkhorn_implicit_backward_kernel(r_ref, g_ref, dx_ref, *, n: int, valid,
                                      cg_steps: int, native: bool):
  """Fixed-point VJP from the corrected system, per token.

  (diag(c) - Rᵀ diag(r)⁻¹ R) β = s_c - Rᵀ diag(r)⁻¹ s_r, solved by ``cg_steps``
  of conjugate gradients from β = 0 with b projected onto 1⊥ (the system's
  null direction) and a guarded curvature; u = diag(r)⁻¹ (s_r - R β);
  dlogits = (dR - u 1ᵀ - 1 βᵀ) ⊙ R. r_ref: [block_tokens, n*width] float32
  result R (zero padding columns); g_ref: its float32 cotangent; dx_ref: the
  cotangent of the logits. Column vectors (β, c, s_c) are [block_tokens, width].
  Every product that an add or a sum consumes is a :func:`product` (rounded on its
  own in interpret mode).
  """
  mul = functools.partial(product, native=native)
  r = _load_matrix(r_ref, valid, n)
  g = _load_matrix(g_ref, valid, n)
  col_sums = _sums(r, COLUMNS)
  inv_rows = [1.0 / jnp.where(s > 0, s, 1.0) for s in _sums(r, ROWS)]  # zero rows stay 0
  weighted = tuple(mul(a, b) for a, b in zip(r, g))
  s_rows, s_cols = _sums(weighted, ROWS), _sums(weighted, COLUMNS)

  def r_times(v):  # R v, a row list
    return [_row_sum(mul(row, v)) for row in r]

  def rt_times(v):  # Rᵀ v, a column array
    return sum_in_order([mul(row, x) for row, x in zip(r, v)])

  def system(v):  # (diag(c) - Rᵀ diag(r)⁻¹ R) v
    return mul(col_sums, v) - rt_times([w * s for w, s in zip(inv_rows, r_times(v))])

  rhs = s_cols - rt_times([w * s for w, s in zip(inv_rows, s_rows)])
  rhs = jnp.where(_real_columns(n, rhs.shape[1]), rhs - mul(_row_sum(rhs), 1.0 / n), 0.0)
  floor = jnp.max(col_sums, axis=1, keepdims=True) * _CG_CURVATURE_FLOOR

  def cg_step(_, carry):
    beta, res, p, rr, active = carry
    ap = system(p)
    curvature = _row_sum(mul(p, ap))
    active = active & (curvature > floor * _row_sum(mul(p, p)))
    alpha = jnp.where(active, rr / jnp.where(active, curvature, 1.0), 0.0)
    beta = beta + mul(alpha, p)
    res = res - mul(alpha, ap)
    rr_next = _row_sum(mul(res, res))
    gamma = jnp.where(active & (rr > 0), rr_next / jnp.where(rr > 0, rr, 1.0), 0.0)
    return beta, res, res + mul(gamma, p), rr_next, active

  rr = _row_sum(mul(rhs, rhs))
  beta, *_ = lax.fori_loop(0, cg_steps, cg_step,
                           (jnp.zeros_like(rhs), rhs, rhs, rr, jnp.full(rr.shape, True)))
  u = [mul(w, s - t) for w, s, t in zip(inv_rows, s_rows, r_times(beta))]
  _store_matrix(dx_ref, tuple((gi - ui - beta) * ri for gi, ui, ri in zip(g, u, r)), valid)


# ---------------------------------------------------------------------------
# Launchers.


def _launch(kernel, inputs, *, out_dtype, tiles: SinkhornTiles, interpret: bool, name: str):
  """Runs ``kernel`` over [T, n, n] inputs, rows zero-padded to a power-of-two width.
  The kernel gets ``valid``, its block's token mask (:func:`counted_rows_call`)."""
  tokens, n, _ = inputs[0].shape
  width = pl.next_power_of_2(n)
  flat = [pad_axis(x, 2, width).reshape(tokens, n * width) for x in inputs]
  block = tiles.block_tokens
  spec = pl.BlockSpec((block, n * width), lambda i: (i, 0))
  out = counted_rows_call(
      kernel, rows=tokens, block_rows=block, in_specs=[spec] * len(inputs), out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((tokens, n * width), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, 1), interpret=interpret, name=name,
  )(*flat)
  return out.reshape(tokens, n, width)[:, :, :n]


@launcher
def sinkhorn_forward(logits, *, iters: int, eps: float, init: str, tiles: SinkhornTiles,
                     interpret: bool):
  """logits: [T, n, n] (float32/bfloat16/float16); returns the [T, n, n] float32 projection."""
  plan = _plan(logits.shape[-1], iters, eps, init, interpret=interpret)
  return _launch(functools.partial(sinkhorn_forward_kernel, plan=plan), (logits,),
                 out_dtype=jnp.float32, tiles=tiles, interpret=interpret, name="jdet_sinkhorn")


@launcher
def sinkhorn_unrolled_backward(logits, cotangent, *, iters: int, eps: float, init: str,
                               tiles: SinkhornTiles, interpret: bool):
  """logits: [T, n, n]; cotangent: [T, n, n] float32. Returns dlogits in logits' dtype."""
  kernel = functools.partial(sinkhorn_unrolled_backward_kernel,
                             plan=_plan(logits.shape[-1], iters, eps, init,
                                        interpret=interpret),
                             segment_units=tiles.segment_units)
  return _launch(kernel, (logits, cotangent), out_dtype=logits.dtype, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn_unrolled_bwd")


@launcher
def sinkhorn_implicit_backward(result, cotangent, *, out_dtype, tiles: SinkhornTiles,
                               interpret: bool):
  """result, cotangent: [T, n, n] float32. Returns dlogits [T, n, n] in ``out_dtype``."""
  n = result.shape[-1]
  kernel = functools.partial(sinkhorn_implicit_backward_kernel, n=n, cg_steps=2 * n,
                             native=not interpret)
  return _launch(kernel, (result, cotangent), out_dtype=out_dtype, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn_implicit_bwd")
