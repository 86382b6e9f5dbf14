"""``jdet.token_logprobs``: the log-probability of each row's token under an LM head,
streamed over the vocabulary, each row bitwise on its own.

Numerics: the vocabulary is cut into fixed chunks of C columns (C a function of V
only: ``pallas_kernels.softmax.token_chunk_cols``). Per chunk, in increasing
order, the jdet GEMM computes the float32 logits of every row against
``weight[:, chunk]``, and a row kernel folds logits * (1 / temperature) into each row's
running (max, sum of exponentials, picked logit). The backward recomputes each
chunk's logits.

Two paths give those bits. Where the [T, V] float32 logits fit 1 GiB and the
weight's rows are 64-element aligned (``pallas_kernels.softmax.token_whole_vocab``),
one GEMM computes them against the weight itself and one launch of the row
kernel folds every chunk in order; the backward's dhidden GEMM sums its
contraction over the vocabulary in the same chunks (``contraction_chunk``).
Elsewhere a loop walks the chunks, each GEMM against a copied column window
``weight[:, chunk]``, and the extra memory is O(T * C). The GEMM's bits do not
depend on which columns it computes, and a row kernel's launch over several
chunks gives the state of one launch per chunk. The first path is the faster
where it applies: the loop's column windows are copies of the weight's slices
(benchmarks/results/h100.md, nineteenth session).

Above that limit, with the weight's rows aligned, the forward (not the backward)
takes the first path on even blocks of rows (``token_row_block``: at most 512 MiB
of logits each), the rows zero-padded to whole blocks. Rows are independent in
the GEMM and the row kernel, so the bits are the same; the program holds one
GEMM kernel, so a new token count's first call compiles one GEMM kernel instead
of the chunk loop's two, and the forward reads no column windows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet._backend import as_array, check_float, check_ndim, differentiable_once, use_interpret
from jdet.matmul import _GemmConfig, gemm
from pallas_kernels import pad_axis
from pallas_kernels.matmul import Layout
from pallas_kernels import softmax as kernels


@dataclasses.dataclass(frozen=True)
class _TokenConfig:
  inv_temperature: float  # float32(1) / float32(temperature), a float32 value
  chunk: int
  tiles: kernels.SoftmaxTiles
  interpret: bool
  whole_vocab: bool  # one chunk loop trip over every column (module docstring)
  row_block: int | None  # the forward in blocks of this many rows, each over every column

  @property
  def gemm(self) -> _GemmConfig:
    return _GemmConfig(None, np.dtype(np.float32), self.interpret, "pallas")


def token_logprobs(hidden, weight, tokens, *, temperature=1.0, interpret=None):
  """Batch-invariant ``log_softmax(hidden @ weight / temperature)[token]``.

  Args:
    hidden: ``[..., T, D]`` activations, bfloat16, float16 or float32.
    weight: ``[D, V]`` LM head (any of the same dtypes; the GEMM runs in
      ``jnp.result_type(hidden, weight)`` with float32 accumulation).
    tokens: ``[..., T]`` integer token ids, ``hidden.shape[:-1]``. Concrete ids
      outside [0, V) raise ValueError; under a trace such a row's result is NaN
      (and its gradient zero).
    temperature: a finite Python float > 0.
    interpret: ``None`` picks by platform (Triton on GPU, interpret on CPU).

  Returns:
    ``[..., T]`` float32 log-probabilities.

  Bitwise promise: the result equals
  ``jnp.take_along_axis(jdet.log_softmax(jdet.matmul(hidden, weight,
  preferred_element_type=jnp.float32) / temperature), tokens[..., None], -1)[..., 0]``
  for every row. The GEMM's bits do not depend on which columns it computes.
  XLA turns ``/ temperature`` into a multiplication by float32(1 / temperature)
  (its algebraic simplifier rewrites a division by a scalar; seen with jax
  0.10.2), so the chunk kernel multiplies by that same float32 reciprocal,
  rounded on its own (``mul.rn.f32`` on the GPU; XLA before the launch in
  interpret mode). And the chunk kernel loads the same float32 sub-chunk blocks
  (shape, warps, masks) as log_softmax's row kernel over V columns and folds them
  with the same function and the same kind of row sum; the state passes between
  chunks exactly through HBM. Not guaranteed by construction: where V is a
  multiple of 8, Triton's choice of register layout (which fixes ``jnp.sum``'s
  tree; argued equal in ``pallas_kernels.softmax``; elsewhere the sums are a tree
  that no layout changes), and XLA's division rewrite; both checked by the GPU
  test (V = 151,936, 128,256 and the odd 50,257). On float32 inputs the GEMM uses
  TF32 on the GPU in both.

  Gradients (``jax.grad``): per chunk, the logits are recomputed and a row
  kernel forms dlogits = g (onehot(token) - p) / temperature, rounded to the GEMM's
  compute dtype; dhidden = sum over chunks, in increasing order, of
  dlogits @ weight[:, chunk]ᵀ (float32 across chunks, then hidden's dtype); each
  dweight[:, chunk] = hiddenᵀ @ dlogits is the GEMM's dB (a fixed order of
  64-row blocks). tokens get no gradient.

  Invariance: row i's log-prob and dhidden row depend only on hidden row i, its
  token, its cotangent and weight: not on the number of rows, their order,
  padding, chunking, ``jit``/``vmap``, nor on the run. dweight is unchanged by
  appended rows whose cotangent is zero.

  Memory: where the [rows, V] float32 logits of one call fit 1 GiB (rows: every
  row of ``hidden``'s leading dims; V a multiple of 64), the call holds them
  (and, for the gradient, dlogits in the compute dtype) for speed; above, the
  forward holds at most 512 MiB of them at a time (V a multiple of 64; else it
  streams the vocabulary in O(rows * 8192)) and the gradient streams the
  vocabulary. Under ``jax.vmap`` the rule sees one
  mapped example's rows, so the logits of all examples may be held at once:
  pass a batch as leading dims of ``hidden`` instead to keep the limit.
  """
  hidden = as_array("hidden", hidden)
  weight = as_array("weight", weight)
  tokens = as_array("tokens", tokens)
  check_ndim("hidden", hidden, 2, "[..., T, D]")
  check_float("hidden", hidden)
  check_float("weight", weight)
  if weight.ndim != 2:
    raise ValueError(f"weight must have shape [D, V], got shape {weight.shape}")
  d, vocab = weight.shape
  if hidden.shape[-1] != d:
    raise ValueError(f"weight must have D = {hidden.shape[-1]} rows to match hidden's last "
                     f"dim (hidden: {hidden.shape}), got weight: {weight.shape}")
  if d < 1 or vocab < 1:
    raise ValueError(f"D and V must be >= 1, got weight: {weight.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
  if tokens.shape != hidden.shape[:-1]:
    raise ValueError(f"tokens must have shape hidden.shape[:-1] = {hidden.shape[:-1]}, "
                     f"got {tokens.shape}")
  temperature = _check_temperature(temperature)
  _check_token_range(tokens, vocab)
  interpret = use_interpret(interpret, hidden, weight)
  inv_temperature = float(np.float32(1) / np.float32(temperature))
  whole_vocab = kernels.token_whole_vocab(tokens.size, vocab, interpret=interpret)
  config = _TokenConfig(inv_temperature, kernels.token_chunk_cols(vocab, interpret=interpret),
                        kernels.softmax_tiles(vocab, interpret=interpret), interpret,
                        whole_vocab,
                        None if whole_vocab else kernels.token_row_block(
                            tokens.size, vocab, interpret=interpret))
  if tokens.size == 0:
    return jnp.zeros(tokens.shape, jnp.float32)
  dtype = jnp.result_type(hidden.dtype, weight.dtype)
  rows = hidden.reshape(-1, d).astype(dtype)
  token_ids = tokens.reshape(-1).astype(jnp.int32)
  out = _token_logprobs(rows, weight.astype(dtype), token_ids, config)
  in_range = (token_ids >= 0) & (token_ids < vocab)
  return jnp.where(in_range, out, jnp.nan).reshape(tokens.shape)


def _check_temperature(temperature) -> float:
  if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
    raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
  single = np.float32(temperature) if math.isfinite(temperature) else np.float32(0)
  if not (temperature > 0 and 0 < single < np.inf and np.isfinite(np.float32(1) / single)):
    raise ValueError(f"temperature must be a finite number > 0 whose float32 reciprocal "
                     f"is finite, got {temperature}")
  return float(temperature)


def _check_token_range(tokens, vocab: int) -> None:
  try:
    ids = np.asarray(tokens)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced: out-of-range rows give NaN
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    bad = ids[(ids < 0) | (ids >= vocab)]
    raise ValueError(f"tokens must lie in [0, V = {vocab}), got {bad.size} outside it "
                     f"(e.g. {int(bad.flat[0])})")


def _chunks(config: _TokenConfig, vocab: int):
  """(number of full chunks, first column of the partial last chunk or None)."""
  full, rest = divmod(vocab, config.chunk)
  return full, (full * config.chunk if rest else None)


def _logits(config: _TokenConfig, h, w_chunk):
  """float32 [T, c] logits of one chunk (before the temperature): the jdet GEMM,
  its contraction in one sum whatever the chunk's width (a narrow last chunk would
  otherwise take ``matmul_plan.fixed_contraction_chunk``'s chunks, which the whole
  vocabulary's GEMM does not)."""
  return gemm(config.gemm, Layout.NN, h[None], w_chunk[None], out_dtype=jnp.float32,
              contraction_chunk=h.shape[1])[0]


def _over_chunks(config: _TokenConfig, w, step, carry):
  """carry = step(first column, weight[:, chunk], carry) for each chunk in increasing
  order; with ``config.whole_vocab`` one step over every column."""
  if config.whole_vocab:
    return step(0, w, carry)
  full, tail = _chunks(config, w.shape[1])
  if full:
    carry = lax.fori_loop(
        0, full, lambda k, c: step(k * config.chunk, lax.dynamic_slice_in_dim(
            w, k * config.chunk, config.chunk, axis=1), c), carry)
  if tail is not None:
    carry = step(tail, w[:, tail:], carry)
  return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_logprobs(h, w, tokens, config: _TokenConfig):
  """h: [T, D]; w: [D, V] (same dtype); tokens: [T] int32."""
  return _token_logprobs_forward(h, w, tokens, config)[0]


def _token_logprobs_forward(h, w, tokens, config):
  if config.row_block is None:
    m, s, picked = _row_state(config, h, w, tokens)
  else:
    m, s, picked = _row_blocks_state(config, h, w, tokens)
  return kernels.token_finalize(m, s, picked, interpret=config.interpret), (h, w, tokens, m, s)


def _row_state(config: _TokenConfig, h, w, tokens):
  """Each row's final (max, sum of exponentials, picked logit), [T] float32 each,
  over the chunks of the whole vocabulary."""
  rows = h.shape[0]

  def step(first, w_chunk, state):
    return kernels.token_chunk_update(
        _logits(config, h, w_chunk), tokens - first, *state, inv_temperature=config.inv_temperature,
        tiles=config.tiles, interpret=config.interpret)

  start = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.full((rows,), -jnp.inf, jnp.float32))
  return _over_chunks(config, w, step, start)


def _row_blocks_state(config: _TokenConfig, h, w, tokens):
  """:func:`_row_state` over blocks of ``config.row_block`` rows, each on the
  whole-vocabulary path. The rows are zero-padded to whole blocks, so that every
  block runs one GEMM kernel: a new token count compiles one, not the chunk
  loop's two."""
  whole = dataclasses.replace(config, whole_vocab=True, row_block=None)
  rows, block = h.shape[0], config.row_block
  states = lax.map(lambda b: _row_state(whole, b[0], w, b[1]),
                   (pad_axis(h, 0, block).reshape(-1, block, h.shape[1]),
                    pad_axis(tokens, 0, block).reshape(-1, block)))
  return tuple(x.reshape(-1)[:rows] for x in states)


def _token_logprobs_backward(config, saved, cotangent):
  h, w, tokens, m, s = saved
  rows, d = h.shape
  cotangent = cotangent.astype(jnp.float32)

  def step(first, w_chunk, carry):
    dh, dw = carry
    dlogits = kernels.token_chunk_backward(
        _logits(config, h, w_chunk), tokens - first, m, s, cotangent,
        inv_temperature=config.inv_temperature, out_dtype=h.dtype, tiles=config.tiles,
        interpret=config.interpret)
    # dhidden += dlogits @ w_chunkᵀ (the GEMM's dA, contracting each chunk in 64-wide
    # steps; a step over several chunks adds their sums in order).
    dh = dh + gemm(config.gemm, Layout.NT, dlogits[None], w_chunk[None], out_dtype=jnp.float32,
                   contraction_chunk=config.chunk)[0]
    # dweight[:, chunk] = hᵀ @ dlogits (the GEMM's dB: fixed 64-row blocks in order).
    dw_chunk = gemm(config.gemm, Layout.TN, h[None], dlogits[None], out_dtype=w.dtype)[0]
    if dw is None:
      return dh, dw_chunk
    return dh, lax.dynamic_update_slice_in_dim(dw, dw_chunk, first, axis=1)

  start = (jnp.zeros((rows, d), jnp.float32), None if config.whole_vocab else jnp.zeros_like(w))
  dh, dw = _over_chunks(config, w, step, start)
  return dh.astype(h.dtype), dw, None


_token_logprobs = differentiable_once("token_logprobs", _token_logprobs,
                                      _token_logprobs_forward, _token_logprobs_backward)


def token_logprobs_reference(hidden, weight, tokens, *, temperature=1.0):
  """Plain jnp: ``log_softmax(hidden @ weight / temperature)`` (float32 logits,
  HIGHEST precision) at ``tokens``; ``[..., T]`` float32. Not batch-invariant."""
  logits = jnp.matmul(hidden, weight, precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32) / temperature
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1),
                               jnp.asarray(tokens)[..., None].astype(jnp.int32), axis=-1)
  return picked[..., 0]
