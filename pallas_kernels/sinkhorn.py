"""Batch-invariant Sinkhorn-Knopp kernels for mHC, token-minor.

Layout: a batch of T matrices of n x n is a [T, n*n] array (row-major matrices,
one token per row). A program owns ``block_tokens`` tokens and holds each of the
n*n matrix entries as a [block_tokens, 1] column, so every row or column sum is
an unrolled chain of elementwise adds in increasing index order. No operation
mixes tokens: a token's bits depend on its own logits only, never on the block
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
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (block_mask, cdiv, compiler_params,
                                    load_block, store_block)

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
# Not yet measured on the H100: chosen so that one thread holds one or two
# tokens (block_tokens / (32 * num_warps)) and a token's state (n*n floats,
# times `checkpoints` in the backward) stays near 128 registers.
GPU_FORWARD_TABLE: tuple[tuple[int, SinkhornTiles], ...] = (
    (4, SinkhornTiles(256, 4)),
    (8, SinkhornTiles(128, 4)),
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


def _plan(n: int, iters: int, eps: float, init: str) -> _Plan:
  if init not in INITS:
    raise ValueError(f"init must be one of {INITS}, got {init!r}")
  softmax_init = init == "softmax"
  # The softmax init already did the first column normalisation.
  return _Plan(n, float(eps), softmax_init, iters - 1 if softmax_init else iters)


# ---------------------------------------------------------------------------
# Token-minor matrix algebra: a matrix is a tuple of n*n columns, entry (i, j)
# at index i*n + j; sums run in increasing index order.


def _line(k: int, n: int, axis: int) -> int:
  """Which column (axis 0) or row (axis 1) sum entry k belongs to."""
  return k % n if axis == COLUMNS else k // n


def _sums(m, n: int, axis: int):
  """Column sums (axis 0, over i) or row sums (axis 1, over j), left to right."""
  if axis == COLUMNS:
    lines = ([m[i * n + j] for i in range(n)] for j in range(n))
  else:
    lines = ([m[i * n + j] for j in range(n)] for i in range(n))
  return [functools.reduce(operator.add, line) for line in lines]


def _normalize(m, plan: _Plan, axis: int):
  """Divides each column (axis 0) or row (axis 1) by its guarded sum.

  Returns (result, reciprocals, sums); the softmax convention adds eps to the
  sum, the exp convention clamps it below at eps.
  """
  sums = _sums(m, plan.n, axis)
  if plan.softmax_init:
    inv = [1.0 / (s + plan.eps) for s in sums]
  else:
    inv = [1.0 / jnp.maximum(s, plan.eps) for s in sums]
  out = tuple(v * inv[_line(k, plan.n, axis)] for k, v in enumerate(m))
  return out, inv, sums


def _normalize_vjp(out, inv, sums, d_out, plan: _Plan, axis: int):
  """VJP of :func:`_normalize` from its result: inv * (d_out - d'(sum) * <d_out, out>)."""
  dots = _sums([g * y for g, y in zip(d_out, out)], plan.n, axis)
  if not plan.softmax_init:  # d max(s, eps) / ds is 0 where the clamp is active.
    dots = [jnp.where(s > plan.eps, t, 0.0) for s, t in zip(sums, dots)]
  return tuple(inv[_line(k, plan.n, axis)] * (g - dots[_line(k, plan.n, axis)])
               for k, g in enumerate(d_out))


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


def _softmax_rows(x, n: int):
  probs = []
  for i in range(n):
    row = x[i * n:(i + 1) * n]
    shift = _shift(functools.reduce(jnp.maximum, row))
    exps = [jnp.exp(v - shift) for v in row]
    total = functools.reduce(operator.add, exps)
    inv = 1.0 / jnp.where(total > 0, total, 1.0)  # an all -inf row has no mass
    probs.extend(e * inv for e in exps)
  return tuple(probs)


def _init(x, plan: _Plan):
  """The iterate before the first unit."""
  if plan.softmax_init:
    p = tuple(v + plan.eps for v in _softmax_rows(x, plan.n))
    return _normalize(p, plan, COLUMNS)[0]
  shift = _shift(functools.reduce(jnp.maximum, x))
  return tuple(jnp.exp(v - shift) for v in x)


def _init_vjp(x, d_start, plan: _Plan):
  """Cotangent of the logits from that of the iterate :func:`_init` returns."""
  if plan.softmax_init:
    probs = _softmax_rows(x, plan.n)
    p = tuple(v + plan.eps for v in probs)
    start, inv, sums = _normalize(p, plan, COLUMNS)
    d_probs = _normalize_vjp(start, inv, sums, d_start, plan, COLUMNS)
    dots = _sums([g * q for g, q in zip(d_probs, probs)], plan.n, ROWS)
    return tuple(q * (g - dots[k // plan.n]) for k, (g, q) in enumerate(zip(d_probs, probs)))
  shift = _shift(functools.reduce(jnp.maximum, x))
  return tuple(jnp.exp(v - shift) * g for v, g in zip(x, d_start))


def _segment_lengths(units: int, checkpoints: int) -> list[int]:
  """Splits the units into at most ``checkpoints`` near-equal segments."""
  count = max(1, min(checkpoints, units))
  return [units // count + (g < units % count) for g in range(count)]


# ---------------------------------------------------------------------------
# Kernels.


def _token_mask(block: int, tokens: int):
  return block_mask(pl.program_id(0) * block, block, tokens)


def _load_matrix(ref, valid):
  """The block's n*n float32 columns, each [block_tokens, 1]; masked tokens read 0."""
  return tuple(load_block(ref.at[:, pl.ds(k, 1)], rows=valid).astype(jnp.float32)
               for k in range(ref.shape[1]))


def _store_matrix(ref, m, valid):
  for k, v in enumerate(m):
    store_block(ref.at[:, pl.ds(k, 1)], v.astype(ref.dtype), rows=valid)


def sinkhorn_forward_kernel(x_ref, o_ref, *, plan: _Plan, tokens: int):
  """x_ref: [block_tokens, n*n] logits (any float); o_ref: same block, float32."""
  valid = _token_mask(x_ref.shape[0], tokens)
  x = _load_matrix(x_ref, valid)
  out = lax.fori_loop(0, plan.units, lambda _, m: _unit(m, plan), _init(x, plan))
  _store_matrix(o_ref, out, valid)


def sinkhorn_unrolled_backward_kernel(x_ref, g_ref, dx_ref, *, plan: _Plan, tokens: int,
                                      checkpoints: int):
  """Exact VJP of the finite iteration, recomputing the iterates on chip.

  x_ref: [block_tokens, n*n] logits; g_ref: float32 cotangent of the result;
  dx_ref: cotangent of the logits (logits dtype). Memory: ``checkpoints``
  iterates per token; work: units + sum over segments of len*(len-1)/2 units
  recomputed, plus the VJPs.
  """
  valid = _token_mask(x_ref.shape[0], tokens)
  x = _load_matrix(x_ref, valid)
  step = lambda _, m: _unit(m, plan)
  lengths = _segment_lengths(plan.units, checkpoints)
  starts = [_init(x, plan)]
  for length in lengths[:-1]:
    starts.append(lax.fori_loop(0, length, step, starts[-1]))
  grad = _load_matrix(g_ref, valid)
  for start, length in zip(reversed(starts), reversed(lengths)):

    def back(t, grad, start=start, length=length):
      before = lax.fori_loop(0, length - 1 - t, step, start)
      return _unit_vjp(before, grad, plan)

    grad = lax.fori_loop(0, length, back, grad)
  _store_matrix(dx_ref, _init_vjp(x, grad, plan), valid)


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
  dlogits = (dR - u 1ᵀ - 1 βᵀ) ⊙ R. r_ref: [block_tokens, n*n] float32 result R;
  g_ref: its float32 cotangent; dx_ref: cotangent of the logits.
  """
  valid = _token_mask(r_ref.shape[0], tokens)
  r = _load_matrix(r_ref, valid)
  g = _load_matrix(g_ref, valid)
  add = lambda vs: functools.reduce(operator.add, vs)
  row_sums, col_sums = _sums(r, n, ROWS), _sums(r, n, COLUMNS)
  inv_rows = [1.0 / jnp.where(s > 0, s, 1.0) for s in row_sums]  # a zero row stays zero
  weighted = tuple(a * b for a, b in zip(r, g))
  s_rows, s_cols = _sums(weighted, n, ROWS), _sums(weighted, n, COLUMNS)

  def r_times(v):  # R v
    return [add([r[i * n + j] * v[j] for j in range(n)]) for i in range(n)]

  def rt_times(v):  # Rᵀ v
    return [add([r[i * n + j] * v[i] for i in range(n)]) for j in range(n)]

  def system(v):  # (diag(c) - Rᵀ diag(r)⁻¹ R) v
    scaled = [w * s for w, s in zip(inv_rows, r_times(v))]
    return [c * vj - t for c, vj, t in zip(col_sums, v, rt_times(scaled))]

  def dot(a, b):
    return add([x * y for x, y in zip(a, b)])

  rhs = [sc - t for sc, t in zip(s_cols, rt_times([w * s for w, s in zip(inv_rows, s_rows)]))]
  mean = add(rhs) * (1.0 / n)
  rhs = [b - mean for b in rhs]
  scale = functools.reduce(jnp.maximum, col_sums) * _CG_CURVATURE_FLOOR

  def cg_step(_, carry):
    beta, res, p, rr, active = carry
    ap = system(p)
    curvature = dot(p, ap)
    active = active & (curvature > scale * dot(p, p))
    alpha = jnp.where(active, rr / jnp.where(active, curvature, 1.0), 0.0)
    beta = [b + alpha * q for b, q in zip(beta, p)]
    res = [x - alpha * q for x, q in zip(res, ap)]
    rr_next = dot(res, res)
    gamma = jnp.where(active & (rr > 0), rr_next / jnp.where(rr > 0, rr, 1.0), 0.0)
    p = [x + gamma * q for x, q in zip(res, p)]
    return beta, res, p, rr_next, active

  zeros = [jnp.zeros_like(rhs[0])] * n
  beta, *_ = lax.fori_loop(
      0, cg_steps, cg_step,
      (zeros, rhs, rhs, dot(rhs, rhs), jnp.ones(rhs[0].shape, jnp.bool_)))
  u = [w * (s - t) for w, s, t in zip(inv_rows, s_rows, r_times(beta))]
  dx = tuple((g[k] - u[k // n] - beta[k % n]) * r[k] for k in range(n * n))
  _store_matrix(dx_ref, dx, valid)


# ---------------------------------------------------------------------------
# Launchers.


def _launch(kernel, inputs, *, out_dtype, tiles: SinkhornTiles, interpret: bool, name: str):
  tokens, width = inputs[0].shape
  block = tiles.block_tokens
  spec = pl.BlockSpec((block, width), lambda i: (i, 0))
  return pl.pallas_call(
      functools.partial(kernel, tokens=tokens),
      grid=(cdiv(tokens, block),),
      in_specs=[spec] * len(inputs),
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((tokens, width), out_dtype),
      compiler_params=compiler_params(tiles.num_warps, 1),
      interpret=interpret,
      name=name,
  )(*inputs)


@functools.partial(jax.jit,
                   static_argnames=("n", "iters", "eps", "init", "tiles", "interpret"))
def sinkhorn_forward(logits, *, n: int, iters: int, eps: float, init: str,
                     tiles: SinkhornTiles, interpret: bool):
  """logits: [T, n*n] (float32/bfloat16/float16); returns the [T, n*n] float32 projection."""
  kernel = functools.partial(sinkhorn_forward_kernel, plan=_plan(n, iters, eps, init))
  return _launch(kernel, (logits,), out_dtype=jnp.float32, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn")


@functools.partial(jax.jit,
                   static_argnames=("n", "iters", "eps", "init", "tiles", "interpret"))
def sinkhorn_unrolled_backward(logits, cotangent, *, n: int, iters: int, eps: float,
                               init: str, tiles: SinkhornTiles, interpret: bool):
  """logits: [T, n*n]; cotangent: [T, n*n] float32. Returns dlogits in logits' dtype."""
  kernel = functools.partial(sinkhorn_unrolled_backward_kernel,
                             plan=_plan(n, iters, eps, init), checkpoints=tiles.checkpoints)
  return _launch(kernel, (logits, cotangent), out_dtype=logits.dtype, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn_unrolled_bwd")


@functools.partial(jax.jit, static_argnames=("n", "out_dtype", "tiles", "interpret"))
def sinkhorn_implicit_backward(result, cotangent, *, n: int, out_dtype,
                               tiles: SinkhornTiles, interpret: bool):
  """result, cotangent: [T, n*n] float32. Returns dlogits [T, n*n] in ``out_dtype``."""
  kernel = functools.partial(sinkhorn_implicit_backward_kernel, n=n, cg_steps=2 * n)
  return _launch(kernel, (result, cotangent), out_dtype=out_dtype, tiles=tiles,
                 interpret=interpret, name="jdet_sinkhorn_implicit_bwd")
