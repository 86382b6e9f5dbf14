"""``jdet.dot_product_attention``: fused attention whose every query's output is
bitwise the same in prefill, chunked prefill and decode."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet._backend import as_array, check_float, differentiable_once, use_interpret
from pallas_kernels import attention as kernels


@dataclasses.dataclass(frozen=True)
class _AttentionConfig:
  scale: float
  causal: bool
  tiles: kernels.AttentionTiles
  interpret: bool
  dense: bool  # neither lengths nor offsets given: every key valid, no offsets


def dot_product_attention(query, key, value, *, scale=None, is_causal=False,
                          key_value_seq_lengths=None, query_offsets=None, interpret=None):
  """Scaled dot-product attention (flash-style, fused), batch- and chunk-invariant.

  Layouts are :func:`jax.nn.dot_product_attention`'s.

  Args:
    query: ``[B, T, N, H]``.
    key, value: ``[B, S, K, H]``, N a multiple of K (grouped-query and
      multi-query attention: query head n uses kv head n // (N // K)).
      query, key and value share one dtype: bfloat16, float16 or float32.
      H is a multiple of 16, at most 256.
    scale: multiplies the logits; default ``1 / sqrt(H)``.
    is_causal: query t attends to keys at positions <= ``query_offsets[b] + t``.
    key_value_seq_lengths: ``[B]`` integers, the valid keys of each sequence (a
      padded KV cache); keys at or past it contribute exactly nothing (their
      key/value entries are never read, so garbage or NaN there is harmless).
      Values are clipped to [0, S]. Default: S.
    query_offsets: ``[B]`` integers, the absolute position of each sequence's
      first query (used by ``is_causal`` only). Default 0: query t sits at
      position t, like :func:`jax.nn.dot_product_attention`'s causal mask
      (top-left aligned) when T < S. For decode against a cache holding L
      tokens, pass ``key_value_seq_lengths = L + T`` and ``query_offsets = L``.
      Passing neither (rather than S and 0) gives the same bits and lets the H100
      kernels skip reading them (about 2-7% faster there).
    interpret: ``None`` picks by platform (the GPU kernels on a GPU: Triton, and
      Mosaic GPU for large prefills and their backward on an H100, with the
      same bits; interpret mode on CPU).

  Returns:
    ``[B, T, N, H]`` in query's dtype. A query with no valid key (length 0, or
    a causal position before every key) gets zeros; :func:`jax.nn.dot_product_attention`
    instead masks with a large finite negative number, so such a row there is
    the plain average of all values (its ``implementation="xla"``).
    Logits and softmax are float32; bf16/f16 probabilities are rounded to the
    input dtype before multiplying the values (as in FlashAttention), and the
    softmax denominator sums those same rounded probabilities; on the GPU
    float32 inputs use IEEE float32 products.

  Invariance: the output of query (b, t, n) depends only on that query, its
  absolute position, and its sequence's valid keys and values: not on B or the
  sequence's place in the batch, not on T (decoding one token at a time against
  a growing cache, chunked prefill with any chunk sizes and whole-sequence
  prefill give the same bits), not on S or anything past the valid length, nor
  on the run. Keys are reduced in blocks at fixed absolute positions in
  increasing order (``pallas_kernels.attention`` states the contract). Under
  ``jax.grad``, each query's dq obeys the same, and dk/dv of a sequence depend
  only on that sequence (queries with zero cotangent add exact zeros); no
  atomics. Integer arguments get no gradient.
  """
  query, key, value = (as_array(name, x) for name, x in
                       (("query", query), ("key", key), ("value", value)))
  for name, x, layout in (("query", query, "[B, T, N, H]"), ("key", key, "[B, S, K, H]"),
                          ("value", value, "[B, S, K, H]")):
    if x.ndim != 4:
      raise ValueError(f"{name} must have shape {layout} (rank 4), got shape {x.shape}")
  dtype = check_float("query", query)
  for name, x in (("key", key), ("value", value)):
    if check_float(name, x) != dtype:
      raise TypeError(f"{name} must have query's dtype {dtype}, got {x.dtype}")
  b, t, n, h = query.shape
  if value.shape != key.shape:
    raise ValueError(f"value must have key's shape {key.shape}, got {value.shape}")
  if key.shape[0] != b or key.shape[3] != h:
    raise ValueError(f"key must have shape [B, S, K, H] = [{b}, S, K, {h}] to match query "
                     f"{query.shape}, got {key.shape}")
  kv_heads = key.shape[2]
  if kv_heads == 0 or n % kv_heads:
    raise ValueError(f"query's head count N = {n} must be a multiple of key's head count "
                     f"K = {kv_heads}")
  if h % 16 or not 16 <= h <= kernels.MAX_HEAD_DIM:
    raise ValueError(f"the head dimension H must be a multiple of 16 in [16, "
                     f"{kernels.MAX_HEAD_DIM}], got H = {h}")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
  scale = _check_scale(scale, h)
  lengths = _check_per_sequence("key_value_seq_lengths", key_value_seq_lengths, b, key.shape[1])
  offsets = _check_per_sequence("query_offsets", query_offsets, b, 0)
  interpret = use_interpret(interpret, query, key, value)
  if query.size == 0 or key.shape[1] == 0:
    return jnp.zeros(query.shape, dtype)
  config = _AttentionConfig(scale, bool(is_causal),
                            kernels.attention_tiles(h, dtype, interpret=interpret), interpret,
                            key_value_seq_lengths is None and query_offsets is None)
  return _attention(query, key, value, lengths, offsets, config)


def _check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return float(scale)


def _check_per_sequence(name: str, x, batch: int, default: int):
  if x is None:
    return jnp.full((batch,), default, jnp.int32)
  x = as_array(name, x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape [B], got dtype {x.dtype}")
  if x.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got {x.shape}")
  return x.astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(query, key, value, lengths, offsets, config: _AttentionConfig):
  return _attention_forward(query, key, value, lengths, offsets, config)[0]


def _kernel_args(config):
  # Only the GPU's Mosaic kernels use ``dense``: interpret mode keeps one
  # compiled launcher for both.
  return dict(scale=config.scale, causal=config.causal, tiles=config.tiles,
              interpret=config.interpret, dense=config.dense and not config.interpret)


def _attention_forward(query, key, value, lengths, offsets, config):
  out, lse = kernels.attention_forward(query, key, value, lengths, offsets,
                                       **_kernel_args(config))
  return out, (query, key, value, lengths, offsets, out, lse)


def _attention_backward(config, saved, dout):
  query, key, value, lengths, offsets, out, lse = saved
  dq, dk, dv = kernels.attention_backward(query, key, value, out, lse, dout.astype(query.dtype),
                                          lengths, offsets, **_kernel_args(config))
  return dq, dk, dv, None, None


_attention = differentiable_once("dot_product_attention", _attention, _attention_forward,
                                 _attention_backward)


def dot_product_attention_reference(query, key, value, *, scale=None, is_causal=False,
                                    key_value_seq_lengths=None, query_offsets=None):
  """Plain ``jax.numpy`` attention with :func:`dot_product_attention`'s masks.

  query ``[B, T, N, H]``, key/value ``[B, S, K, H]``; float32 math (HIGHEST
  precision einsums), output in query's dtype; a query with no valid key gets
  zeros. Differentiable with ``jax.grad``; not batch-invariant.
  """
  b, t, n, h = query.shape
  s, kv_heads = key.shape[1], key.shape[2]
  scale = 1.0 / math.sqrt(h) if scale is None else scale
  lengths = (jnp.full((b,), s) if key_value_seq_lengths is None
             else jnp.asarray(key_value_seq_lengths))
  offsets = jnp.zeros((b,), jnp.int32) if query_offsets is None else jnp.asarray(query_offsets)
  q = query.astype(jnp.float32).reshape(b, t, kv_heads, n // kv_heads, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST) * scale
  key_pos = jnp.arange(s)
  mask = (key_pos[None, None, :] < lengths[:, None, None])  # [B, 1, S]
  if is_causal:
    query_pos = offsets[:, None] + jnp.arange(t)[None, :]  # [B, T]
    mask = mask & (key_pos[None, None, :] <= query_pos[:, :, None])
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  shift = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  e = jnp.exp(logits - jnp.where(jnp.isfinite(shift), shift, 0.0))
  total = jnp.sum(e, axis=-1, keepdims=True)
  weights = e / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("bkgts,bskh->btkgh", weights, value.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
  return out.reshape(b, t, n, h).astype(query.dtype)
