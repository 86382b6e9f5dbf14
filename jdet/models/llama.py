"""A small Llama-style decoder whose every reduction runs through jdet.

Token embedding (a gather), then per layer an RMSNorm with the residual add
fused, grouped-query attention with rotary position embeddings and a KV cache,
an RMSNorm and a SwiGLU MLP; a final RMSNorm and the LM head. Parameters are a
dict of arrays (layers stacked on a leading axis and run with ``lax.scan``).

One code path serves two sets of ops (``ops=``): ``"jdet"`` runs every matmul,
norm, attention and log-prob through jdet; ``"xla"`` runs the same model on
``jnp.matmul``, a jnp RMSNorm, ``jax.nn.dot_product_attention`` and
``jax.nn.log_softmax``, for comparison.

Numerics contract (``ops="jdet"``, given the contracts of the jdet ops): the
hidden state and log-prob of token ``(b, t)`` are bitwise the same whether it
is computed by :func:`forward`/:func:`logprobs` (training: any batch, any
position in it, any padding), by :func:`prefill` (whole or chunked) or by
:func:`decode_step` against the cache. Everything between the jdet ops is a
gather, a cache write or elementwise math: rotary angles come from a table
computed once in float64 NumPy and indexed by absolute position, and the
rotation's products are kept apart from its sums so that no compiler can fuse
them into FMAs differently in different programs. The gradient of the
embedding is a one-hot ``jdet.matmul`` (fixed row order) instead of XLA's
scatter-add.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jdet

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
  """Model sizes. ``dtype`` is the parameter, activation and KV-cache dtype."""
  vocab: int = 64
  dim: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 16
  hidden: int = 128
  rope_theta: float = 10000.0
  eps: float = 1e-6
  dtype: Any = jnp.float32

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                       f"({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


CONFIGS = {
    "cpu": Config(),
    "gpu": Config(vocab=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=64,
                  hidden=2816, dtype=jnp.bfloat16),
}


def init_params(key, config: Config) -> dict:
  """Random parameters: weights ~ N(0, 1/fan_in), norm weights near 1."""
  c = config
  n, k, h, d, f, L = c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.hidden, c.n_layers
  keys = iter(jax.random.split(key, 9))

  def normal(shape, fan_in):
    return (jax.random.normal(next(keys), shape, F32) / np.sqrt(fan_in)).astype(c.dtype)

  def norm_weight(shape):
    return (1 + 0.1 * jax.random.normal(next(keys), shape, F32)).astype(c.dtype)

  return {
      "embed": normal((c.vocab, d), 1),
      "layers": {
          "attn_norm": norm_weight((L, d)),
          "wqkv": normal((L, d, (n + 2 * k) * h), d),
          "wo": normal((L, n * h, d), n * h),
          "mlp_norm": norm_weight((L, d)),
          "w_gate_up": normal((L, d, 2 * f), d),
          "w_down": normal((L, f, d), f),
      },
      "norm": norm_weight((d,)),
      "lm_head": normal((d, c.vocab), d),
  }


# ---------------------------------------------------------------- the two op sets


@dataclasses.dataclass(frozen=True)
class Ops:
  """What the model calls for each reduction (signatures of the jdet ops)."""
  embed: Any           # (table [V, D], tokens [...]) -> [..., D]
  matmul: Any          # (x [..., K], w [K, N], *, preferred_element_type=None) -> [..., N]
  rms_norm: Any        # (x, weight, *, eps, residual) -> y, or (y, x + residual)
  attention: Any       # jdet.dot_product_attention's signature
  token_logprobs: Any  # (hidden [..., D], weight [D, V], tokens [...], *, temperature)


@jax.custom_vjp
def _embed(table, tokens):
  return jnp.take(table, tokens, axis=0)


def _embed_forward(table, tokens):
  return _embed(table, tokens), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _embed_backward(residuals, d):
  """d table = one_hot(tokens)ᵀ · d, reduced over tokens in jdet.matmul's fixed order."""
  tokens, like = residuals
  rows = tokens.reshape(-1)
  one_hot_t = (jnp.arange(like.shape[0])[:, None] == rows[None, :]).astype(d.dtype)
  d_table = jdet.matmul(one_hot_t, d.reshape(rows.shape[0], -1), precision=lax.Precision.HIGHEST)
  return d_table, np.zeros(tokens.shape, jax.dtypes.float0)


_embed.defvjp(_embed_forward, _embed_backward)


def _jdet_rms_norm(x, weight, *, eps, residual=None):
  return jdet.rms_norm(x, weight, eps=eps, residual=residual)


def _jdet_attention(query, key, value, **options):
  return jdet.dot_product_attention(query, key, value, **options)


def _jdet_token_logprobs(hidden, weight, tokens, *, temperature):
  return jdet.token_logprobs(hidden, weight, tokens, temperature=temperature)


def _xla_matmul(x, w, *, preferred_element_type=None):
  out = jnp.matmul(x, w, preferred_element_type=F32)
  return out.astype(preferred_element_type or jnp.result_type(x, w))


def _xla_rms_norm(x, weight, *, eps, residual=None):
  s = x if residual is None else x + residual
  s32 = s.astype(F32)
  y = s32 * lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps)
  y = (y * weight.astype(F32)).astype(x.dtype)
  return y if residual is None else (y, s)


def _xla_attention(query, key, value, *, scale=None, is_causal=False,
                   key_value_seq_lengths=None, query_offsets=None):
  batch, t, s = query.shape[0], query.shape[1], key.shape[1]
  mask = _attention_mask(batch, t, s, is_causal, key_value_seq_lengths, query_offsets)
  return jax.nn.dot_product_attention(query, key, value, mask=mask[:, None], scale=scale,
                                      implementation="xla")


def _xla_token_logprobs(hidden, weight, tokens, *, temperature):
  logits = _xla_matmul(hidden, weight, preferred_element_type=F32) / temperature
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _attention_mask(batch, t, s, is_causal, key_value_seq_lengths, query_offsets):
  """[B, T, S]: key j is seen by query t of sequence b (jdet.dot_product_attention's rule)."""
  key_pos = jnp.arange(s)[None, None, :]
  mask = jnp.ones((batch, t, s), bool)
  if key_value_seq_lengths is not None:
    mask &= key_pos < key_value_seq_lengths[:, None, None]
  if is_causal:
    offsets = jnp.zeros((batch,), jnp.int32) if query_offsets is None else query_offsets
    mask &= key_pos <= (offsets[:, None] + jnp.arange(t)[None, :])[:, :, None]
  return mask


OPS = {
    "jdet": Ops(embed=_embed, matmul=jdet.matmul, rms_norm=_jdet_rms_norm,
                attention=_jdet_attention, token_logprobs=_jdet_token_logprobs),
    "xla": Ops(embed=lambda table, tokens: jnp.take(table, tokens, axis=0), matmul=_xla_matmul,
               rms_norm=_xla_rms_norm, attention=_xla_attention,
               token_logprobs=_xla_token_logprobs),
}


def _ops(ops: str) -> Ops:
  if ops not in OPS:
    raise ValueError(f"ops must be one of {sorted(OPS)}, got {ops!r}")
  return OPS[ops]


# ---------------------------------------------------------------- the model


_ROPE_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _rope_table(head_dim: int, theta: float, length: int) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin [length, head_dim / 2] of position x frequency, in float64, rounded once.

  NumPy evaluates cos/sin in SIMD lanes with a different tail path, so the table is
  built in blocks of one shape: a position's entry is computed the same way in a table
  of any length.
  """
  inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  blocks = -(-length // _ROPE_BLOCK)
  angles = np.arange(blocks * _ROPE_BLOCK, dtype=np.float64).reshape(blocks, _ROPE_BLOCK, 1)
  angles = angles * inv_freq
  cos = np.concatenate([np.cos(block) for block in angles])[:length]
  sin = np.concatenate([np.sin(block) for block in angles])[:length]
  return cos.astype(np.float32), sin.astype(np.float32)


def _rope(x, cos, sin):
  """Rotates halves of x [B, T, heads, H] by the angles of cos/sin [B, T, H/2]."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  # The barrier keeps every product rounded on its own before the sums: no FMA.
  a, b, c, d = lax.optimization_barrier((x1 * cos, x2 * sin, x2 * cos, x1 * sin))
  return jnp.concatenate([a - b, c + d], axis=-1).astype(x.dtype)


def _decoder(params, tokens, config: Config, ops: Ops, positions, rope_length, attend, kv):
  """Runs the layers. tokens, positions: [B, T]; ``attend(q, k, v, kv_layer) -> (out, kv_layer)``
  with ``kv`` scanned alongside the layers. Returns the final hidden [B, T, D] and kv."""
  c = config
  batch, t = tokens.shape
  n, k, h = c.n_heads, c.n_kv_heads, c.head_dim
  cos_table, sin_table = _rope_table(h, float(c.rope_theta), rope_length)
  # Positions of dropped cache rows can run past the table; their rows are never used.
  positions = jnp.minimum(positions, rope_length - 1)
  cos, sin = jnp.asarray(cos_table)[positions], jnp.asarray(sin_table)[positions]
  x = ops.embed(params["embed"], tokens)

  def layer(carry, xs):
    delta, residual = carry
    weights, kv_layer = xs
    y, residual = ops.rms_norm(delta, weights["attn_norm"], eps=c.eps, residual=residual)
    qkv = ops.matmul(y, weights["wqkv"])
    q = qkv[..., :n * h].reshape(batch, t, n, h)
    key = qkv[..., n * h:(n + k) * h].reshape(batch, t, k, h)
    value = qkv[..., (n + k) * h:].reshape(batch, t, k, h)
    out, kv_layer = attend(_rope(q, cos, sin), _rope(key, cos, sin), value, kv_layer)
    delta = ops.matmul(out.reshape(batch, t, n * h), weights["wo"])
    y, residual = ops.rms_norm(delta, weights["mlp_norm"], eps=c.eps, residual=residual)
    gate_up = ops.matmul(y, weights["w_gate_up"])
    gate, up = gate_up[..., :c.hidden], gate_up[..., c.hidden:]
    delta = ops.matmul(jax.nn.silu(gate) * up, weights["w_down"])
    return (delta, residual), kv_layer

  # The first norm adds a zero residual: x + 0 is x.
  (delta, residual), kv = lax.scan(layer, (x, jnp.zeros_like(x)), (params["layers"], kv))
  hidden, _ = ops.rms_norm(delta, params["norm"], eps=c.eps, residual=residual)
  return hidden, kv


def forward(params, tokens, config: Config, *, lengths=None, ops: str = "jdet"):
  """Training forward of whole sequences.

  Args:
    tokens: ``[B, T]`` int token ids; positions are 0..T-1.
    lengths: optional ``[B]`` int, valid tokens per sequence (keys at and past it are
      ignored; the hidden states of padding positions are then meaningless).
    ops: ``"jdet"`` or ``"xla"``.

  Returns:
    ``[B, T, D]`` final (normed) hidden states in ``config.dtype``. With
    ``ops="jdet"`` token ``(b, t)``'s row is bitwise independent of the batch, of
    padding and of whether it came from here, :func:`prefill` or :func:`decode_step`.
  """
  o = _ops(ops)
  scale = config.head_dim ** -0.5
  batch, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (batch, t))

  def attend(q, k, v, _):
    return o.attention(q, k, v, scale=scale, is_causal=True,
                       key_value_seq_lengths=lengths), None

  hidden, _ = _decoder(params, tokens, config, o, positions, t, attend, None)
  return hidden


def token_logprobs(params, hidden, tokens, config: Config, *, temperature: float = 1.0,
                   ops: str = "jdet"):
  """float32 ``log softmax(hidden @ lm_head / temperature)[tokens]``; hidden ``[..., D]``,
  tokens ``[...]``."""
  del config
  return _ops(ops).token_logprobs(hidden, params["lm_head"], tokens, temperature=temperature)


def logits(params, hidden, config: Config, *, ops: str = "jdet"):
  """float32 ``hidden @ lm_head`` ``[..., V]`` (to sample from)."""
  del config
  return _ops(ops).matmul(hidden, params["lm_head"], preferred_element_type=F32)


def logprobs(params, tokens, config: Config, *, lengths=None, temperature: float = 1.0,
             ops: str = "jdet"):
  """``[B, T - 1]`` float32: entry ``t`` is log p(tokens[:, t + 1] | tokens[:, :t + 1]).

  The training-side log-probs of whole sequences (``tokens`` ``[B, T]``, optional
  ``lengths`` ``[B]``; entries past a sequence's length are meaningless).
  """
  hidden = forward(params, tokens, config, lengths=lengths, ops=ops)
  return token_logprobs(params, hidden[:, :-1], tokens[:, 1:], config,
                        temperature=temperature, ops=ops)


def init_cache(config: Config, batch: int, max_len: int) -> dict:
  """An empty KV cache: k, v ``[layers, B, max_len, K, H]`` and ``lengths`` ``[B]`` int32."""
  shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
  return {"k": jnp.zeros(shape, config.dtype), "v": jnp.zeros(shape, config.dtype),
          "lengths": jnp.zeros((batch,), jnp.int32)}


def prefill(params, tokens, cache, config: Config, *, lengths=None, ops: str = "jdet"):
  """Appends new tokens to every sequence of the cache and returns their hidden states.

  Args:
    tokens: ``[B, T]`` new token ids; sequence ``b`` gets the first ``lengths[b]`` of them
      at positions ``cache["lengths"][b]`` on (so a prompt can be prefilled in chunks).
    cache: from :func:`init_cache`; ``max_len`` must hold every sequence's new length.
    lengths: ``[B]`` int, new tokens per sequence (default: all ``T``).

  Returns:
    ``(hidden [B, T, D], cache)`` with the new keys/values written and ``lengths``
    advanced. Hidden rows past ``lengths[b]`` are meaningless.
  """
  o = _ops(ops)
  batch, t = tokens.shape
  max_len = cache["k"].shape[2]
  offsets = cache["lengths"]
  new = jnp.full((batch,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
  steps = jnp.arange(t)[None, :]
  positions = offsets[:, None] + steps
  # Rows past a sequence's new tokens are dropped instead of written.
  slots = jnp.where(steps < new[:, None], positions, max_len)
  rows = jnp.arange(batch)[:, None]
  scale = config.head_dim ** -0.5

  def attend(q, k, v, kv_layer):
    cache_k, cache_v = kv_layer
    cache_k = cache_k.at[rows, slots].set(k, mode="drop")
    cache_v = cache_v.at[rows, slots].set(v, mode="drop")
    out = o.attention(q, cache_k, cache_v, scale=scale, is_causal=True,
                      key_value_seq_lengths=offsets + new, query_offsets=offsets)
    return out, (cache_k, cache_v)

  hidden, (cache_k, cache_v) = _decoder(params, tokens, config, o, positions, max_len, attend,
                                        (cache["k"], cache["v"]))
  return hidden, {"k": cache_k, "v": cache_v, "lengths": offsets + new}


def decode_step(params, token, cache, config: Config, *, ops: str = "jdet"):
  """One token per sequence: ``token`` ``[B]`` -> ``(hidden [B, D], cache)``."""
  hidden, cache = prefill(params, token[:, None], cache, config,
                          lengths=jnp.ones(token.shape, jnp.int32), ops=ops)
  return hidden[:, 0], cache
