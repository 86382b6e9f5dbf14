"""jdet.dot_product_attention: prefill == chunked prefill == decode bitwise, batch
and padding invariance, accuracy, gradients, errors, and the cuda lowering.

On CPU the kernels run in interpret mode with the interpret tiles (16 query rows,
8 for calls of at most 8 rows; 8-key blocks, 16-key chunks), so the tiny shapes
below run several row tiles, key blocks and chunks, and decode steps a smaller
row tile than the prefill; the ``gpu`` test repeats the core property at H = 128.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import (assert_bitwise_equal, cuda_lowering_available, random_normal,
                          relative_error)
from pallas_kernels import attention as kernels
from pallas_kernels import attention_hopper
from jdet.bench import on_gpu

B, S, N, K, H = 3, 24, 4, 2, 16  # GQA: two query heads per kv head
LENGTHS = (21, 13, 24)  # valid keys (= tokens) of each sequence of the cache
CHUNKS = (1, 3, 5)  # chunked prefill cycles through these sizes
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


def _cache(seed, dtype, *, batch=B, seq=S, q_heads=N, kv_heads=K, head_dim=H, garbage=np.nan):
  """Queries [B, seq, N, H] and a KV cache [B, seq, K, H] holding LENGTHS[b]
  valid tokens per sequence, ``garbage`` past them."""
  rng = np.random.default_rng(seed)
  q = random_normal(rng, (batch, seq, q_heads, head_dim), dtype)
  k = random_normal(rng, (batch, seq, kv_heads, head_dim), dtype)
  v = random_normal(rng, (batch, seq, kv_heads, head_dim), dtype)
  valid = np.arange(seq)[None, :, None, None] < np.array(LENGTHS[:batch])[:, None, None, None]
  k, v = (jnp.where(valid, x, jnp.asarray(garbage, dtype)) for x in (k, v))
  return q, k, v, jnp.array(LENGTHS[:batch], jnp.int32)


@functools.partial(jax.jit, static_argnames=("causal",))
def attend(q, k, v, lengths, offsets, causal=True):
  return jdet.dot_product_attention(q, k, v, is_causal=causal, key_value_seq_lengths=lengths,
                                    query_offsets=offsets)


@functools.partial(jax.jit, static_argnames=("causal", "split"))
def attend_path(q, k, v, lengths, offsets, causal=True, split=False):
  """The kernels' forward with the prefill or the split-KV path forced; like
  ``attend``, natively on the GPU and in interpret mode on CPU."""
  interpret = not on_gpu()
  tiles = kernels.attention_tiles(q.shape[-1], q.dtype, interpret=interpret)
  return kernels.attention_forward(q, k, v, lengths, offsets, scale=1 / np.sqrt(q.shape[-1]),
                                   causal=causal, tiles=tiles, interpret=interpret,
                                   split=split)[0]


def _zeros(batch=B):
  return jnp.zeros((batch,), jnp.int32)


def _decode(q, k, v, lengths, path=attend):
  """One query at a time against the growing cache: [B, S, N, H] (rows past a
  sequence's length are left zero)."""
  out = np.zeros(q.shape, q.dtype)
  for t in range(max(LENGTHS)):
    step = path(q[:, t:t + 1], k, v, jnp.minimum(lengths, t + 1), jnp.full((B,), t, jnp.int32))
    out[:, t] = np.asarray(step)[:, 0]
  return out


def _chunked(q, k, v, lengths):
  """Chunked prefill with chunk sizes cycling through CHUNKS."""
  qp = jnp.pad(q, ((0, 0), (0, max(CHUNKS)), (0, 0), (0, 0)))
  out, start, i = np.zeros(q.shape, q.dtype), 0, 0
  while start < q.shape[1]:
    size = CHUNKS[i % len(CHUNKS)]
    got = attend(qp[:, start:start + size], k, v, jnp.minimum(lengths, start + size),
                 jnp.full((B,), start, jnp.int32))
    take = min(size, q.shape[1] - start)
    out[:, start:start + take] = np.asarray(got)[:, :take]
    start, i = start + size, i + 1
  return out


def _valid_rows(x, lengths=LENGTHS):
  return [np.asarray(x)[b, :lengths[b]] for b in range(len(lengths))]


@pytest.fixture(scope="module")
def cache():
  return _cache(0, jnp.bfloat16)


@pytest.fixture(scope="module")
def prefill(cache):
  q, k, v, lengths = cache
  return attend(q, k, v, lengths, _zeros())


def test_prefill_equals_decode_and_chunked_prefill(cache, prefill):
  q, k, v, lengths = cache
  want = _valid_rows(prefill)
  assert_bitwise_equal(_valid_rows(_decode(q, k, v, lengths)), want, what="decode (split)")
  assert_bitwise_equal(_valid_rows(_chunked(q, k, v, lengths)), want, what="chunked prefill")


def test_split_and_prefill_paths_agree(cache, prefill):
  q, k, v, lengths = cache
  want = _valid_rows(prefill)  # the prefill path (on CPU T = 24 fills 3 row tiles)
  got = attend_path(q, k, v, lengths, _zeros(), split=True)
  assert_bitwise_equal(_valid_rows(got), want, what="whole prompt, split path")
  decoded = _decode(q, k, v, lengths, functools.partial(attend_path, split=False))
  assert_bitwise_equal(_valid_rows(decoded), want, what="decode, prefill path")


@pytest.mark.parametrize("where", ["here", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_split_path_with_a_partial_column_tile(where):
  """The combine kernel's 32-column tiles end mid-head: H = 48 in interpret mode
  (padded to 64 columns), H = 80 natively on the GPU (padded to 128)."""
  interpret = where == "here"
  head_dim = 48 if interpret else 80
  q, k, v, lengths = _cache(3, jnp.float32, head_dim=head_dim)
  tiles = kernels.attention_tiles(head_dim, q.dtype, interpret=interpret)
  tiles = dataclasses.replace(tiles, combine_cols=32)
  outs = [kernels.attention_forward(q[:, :3], k, v, lengths, _zeros() + 5, scale=0.2, causal=True,
                                    tiles=tiles, interpret=interpret, split=split)[0]
          for split in (False, True)]
  assert_bitwise_equal(outs[1], outs[0], what=f"split path, H = {head_dim}")


def test_batch_position_and_padding_invariance(cache, prefill):
  q, k, v, lengths = cache
  for b in range(B):
    alone = attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], lengths[b:b + 1], _zeros(1))
    assert_bitwise_equal(alone[0, :LENGTHS[b]], np.asarray(prefill)[b, :LENGTHS[b]],
                         what=f"sequence {b} alone")
  order = np.array([2, 0, 1])
  shuffled = attend(q[order], k[order], v[order], lengths[order], _zeros())
  assert_bitwise_equal(_valid_rows(shuffled, [LENGTHS[i] for i in order]),
                       [_valid_rows(prefill)[i] for i in order], what="batch order")
  # A longer cache, with other garbage (inf) past the valid keys.
  pad = ((0, 0), (0, 13), (0, 0), (0, 0))
  longer = attend(q, jnp.pad(k, pad, constant_values=jnp.inf),
                  jnp.pad(v, pad, constant_values=-jnp.inf), lengths, _zeros())
  assert_bitwise_equal(_valid_rows(longer), _valid_rows(prefill), what="S = 37")


def test_non_causal_rows_are_independent(cache):
  q, k, v, lengths = cache
  whole = attend(q, k, v, lengths, _zeros(), causal=False)
  for start, size in ((0, 1), (7, 1), (23, 1)):
    part = attend(q[:, start:start + size], k, v, lengths, _zeros(), causal=False)
    assert_bitwise_equal(part, whole[:, start:start + size], what=f"queries {start}+{size}")


def test_mqa_prefill_equals_decode():
  q, k, v, lengths = _cache(3, jnp.bfloat16, kv_heads=1)
  want = _valid_rows(attend(q, k, v, lengths, _zeros()))
  assert_bitwise_equal(_valid_rows(_decode(q, k, v, lengths)), want, what="MQA decode")


def test_nan_stays_in_its_sequence(cache, prefill):
  q, k, v, lengths = cache
  poisoned = attend(q, k, v.at[1, 2].set(jnp.nan), lengths, _zeros())
  assert np.isnan(np.asarray(poisoned[1, 2:LENGTHS[1]], np.float32)).all()
  for b in (0, 2):
    assert_bitwise_equal(poisoned[b], prefill[b], what=f"sequence {b} next to a NaN")


def test_rows_without_keys_are_zero(cache):
  q, k, v, _ = cache
  out = attend(q, k, v, jnp.array([0, 5, 24]), jnp.array([0, -3, 0]))
  out = np.asarray(out, np.float32)
  assert not np.any(out[0]) and not np.any(out[1, :3])  # length 0; causal before key 0
  assert np.all(np.any(out[1, 3:], axis=-1)) and np.all(np.any(out[2], axis=-1))


def test_deterministic(cache, prefill):
  q, k, v, lengths = cache
  assert_bitwise_equal(attend(q, k, v, lengths, _zeros()), prefill, what="second run")


def test_finalize_normalises_within_an_ulp_and_a_half():
  """Interpret mode's normalisation is within 1.5 float32 ulps of the float64
  quotient: XLA:CPU divides by a broadcast divisor as a product by its rounded
  reciprocal (at most 0.5 ulp for the product's rounding and 1 for the
  reciprocal's). A row without keys gives zeros and a log-sum-exp of +inf. (On
  the GPU both kernel languages run ``corrected_quotient``, and the GPU tests
  compare their bits.)"""
  rng = np.random.default_rng(5)
  rows, width = 64, 32
  m = rng.standard_normal(rows).astype(np.float32) * 4
  l = np.exp2(rng.uniform(0, 20, rows)).astype(np.float32)
  l[:3] = (0.0, 1.0, 3.0)
  acc = (rng.standard_normal((rows, width)) * l[:, None]).astype(np.float32)
  acc[0] = 0.0
  out, lse = kernels.finalize_state(tuple(map(jnp.asarray, (m, l, acc))),
                                    kernels.triton_ops(native=False))
  out, lse = np.asarray(out), np.asarray(lse)
  exact = acc[1:].astype(np.float64) / l[1:, None]
  ulps = np.abs(out[1:] - exact) / np.spacing(np.abs(exact).astype(np.float32))
  assert ulps.max() <= 1.5, ulps.max()
  assert not np.any(out[0]) and lse[0] == np.inf and np.all(np.isfinite(lse[1:]))


def _float64_attention(q, k, v, lengths, offsets, causal, scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, axis=2)) * scale
  key_pos = np.arange(k.shape[1])
  mask = key_pos[None, None, :] < np.asarray(lengths)[:, None, None]
  if causal:
    query_pos = np.asarray(offsets)[:, None] + np.arange(t)
    mask = mask & (key_pos[None, None, :] <= query_pos[..., None])
  logits = np.where(mask[:, None], logits, -np.inf)
  shift = np.max(logits, axis=-1, keepdims=True)
  e = np.exp(logits - np.where(np.isfinite(shift), shift, 0))
  total = e.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", e / np.where(total > 0, total, 1), np.repeat(v, g, axis=2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_accuracy_vs_float64_and_jax_nn(dtype, causal):
  q, k, v, lengths = _cache(5, dtype, garbage=0.0)
  offsets = jnp.array([0, 4, 0], jnp.int32)
  got = np.asarray(jnp.asarray(attend(q, k, v, lengths, offsets, causal=causal), jnp.float32))
  want = _float64_attention(q, k, v, lengths, offsets, causal, 1 / np.sqrt(H))
  assert relative_error(got, want) < TOLERANCE[dtype]
  ref = jdet.dot_product_attention_reference(q, k, v, is_causal=causal,
                                             key_value_seq_lengths=lengths, query_offsets=offsets)
  assert relative_error(jnp.asarray(ref, jnp.float32), want) < TOLERANCE[dtype]
  if not causal:  # jax.nn has no query offsets; every row here has valid keys
    with jax.default_matmul_precision("highest"):  # XLA:GPU's default float32 dot is TF32
      nn = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                        implementation="xla")
    assert relative_error(got, jnp.asarray(nn, jnp.float32)) < 2 * TOLERANCE[dtype]


def _loss(fn, q, k, v, lengths, offsets, weight):
  out = fn(q, k, v, is_causal=True, key_value_seq_lengths=lengths, query_offsets=offsets)
  return jnp.sum(out.astype(jnp.float32) * weight)


grads = jax.jit(jax.grad(functools.partial(_loss, jdet.dot_product_attention), argnums=(0, 1, 2)))


@pytest.fixture(scope="module")
def grad_case():
  q, k, v, lengths = _cache(7, jnp.float32, garbage=0.0)
  weight = random_normal(np.random.default_rng(8), q.shape, jnp.float32)
  return q, k, v, lengths, jnp.array([0, 2, 0], jnp.int32), weight


def test_gradients_match_reference(grad_case):
  got = grads(*grad_case)
  want = jax.grad(functools.partial(_loss, jdet.dot_product_attention_reference),
                  argnums=(0, 1, 2))(*grad_case)
  for name, g, w in zip("qkv", got, want):
    assert relative_error(g, w) < 1e-5, name
  lengths = np.asarray(grad_case[3])
  for b in range(B):  # keys past the valid length get exact zeros
    assert not np.any(np.asarray(got[1])[b, lengths[b]:])
    assert not np.any(np.asarray(got[2])[b, lengths[b]:])


def test_gradients_batch_invariant_and_deterministic(grad_case):
  q, k, v, lengths, offsets, weight = grad_case
  full = grads(*grad_case)
  assert_bitwise_equal(grads(*grad_case), full, what="second run")
  one = lambda x, b: x[b:b + 1]
  b = 1
  alone = grads(*(one(x, b) for x in grad_case))
  assert_bitwise_equal([g[0] for g in alone], [g[b] for g in full], what="sequence 1 alone")
  # Appending queries whose cotangent is zero leaves dk/dv and the others' dq unchanged.
  extra = ((0, 0), (0, 9), (0, 0), (0, 0))
  longer = grads(jnp.pad(q, extra, constant_values=1.0), k, v, lengths, offsets,
                 jnp.pad(weight, extra))
  assert_bitwise_equal(longer[1:], full[1:], what="dk, dv with zero-cotangent queries")
  assert_bitwise_equal(longer[0][:, :S], full[0], what="dq with appended queries")


def test_sequences_past_a_full_bucket_of_programs():
  """Nine sequences run on a grid of ten per (row tile, kv head) (the sequence
  axis is bucketed, ``_common.counted_axis_call``): the tenth programs return at
  once, and each sequence's output, split-KV decode step and gradients are
  bitwise those it gets alone."""
  batch = 9
  rng = np.random.default_rng(11)
  q, k, v, weight = (random_normal(rng, shape, jnp.float32)
                     for shape in ((batch, S, N, H), (batch, S, K, H), (batch, S, K, H),
                                   (batch, S, N, H)))
  lengths = jnp.array(rng.integers(1, S + 1, batch), jnp.int32)
  offsets = jnp.zeros((batch,), jnp.int32)
  steps = lengths - 1
  full = (attend(q, k, v, lengths, offsets),
          attend_path(q[:, :1], k, v, lengths, steps, split=True),
          *grads(q, k, v, lengths, offsets, weight))
  for b in range(batch):
    one = lambda x: x[b:b + 1]  # noqa: E731
    alone = (attend(one(q), one(k), one(v), one(lengths), one(offsets)),
             attend_path(one(q)[:, :1], one(k), one(v), one(lengths), one(steps), split=True),
             *grads(one(q), one(k), one(v), one(lengths), one(offsets), one(weight)))
    for name, got, want in zip(("out", "decode", "dq", "dk", "dv"), full, alone):
      assert_bitwise_equal(got[b], want[0], what=f"sequence {b} {name}")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(query=np.zeros((2, 3, 4, 16))), TypeError, "query must be bfloat16"),
    (dict(query=np.zeros((3, 4, 16), np.float32)), ValueError, "query must have shape"),
    (dict(key=np.zeros((2, 5, 3, 16), np.float32), value=np.zeros((2, 5, 3, 16), np.float32)),
     ValueError, "multiple of key's head"),
    (dict(value=np.zeros((2, 6, 2, 16), np.float32)), ValueError, "value must have key's"),
    (dict(key=np.zeros((2, 5, 2, 16), jnp.bfloat16)), TypeError, "key must have query's"),
    (dict(query=np.zeros((2, 3, 4, 24), np.float32), key=np.zeros((2, 5, 2, 24), np.float32),
          value=np.zeros((2, 5, 2, 24), np.float32)), ValueError, "head dimension"),
    (dict(key_value_seq_lengths=np.zeros((3,), np.int32)), ValueError, "key_value_seq_lengths"),
    (dict(key_value_seq_lengths=np.zeros((2,), np.float32)), TypeError, "key_value_seq_lengths"),
    (dict(query_offsets=np.zeros((2, 1), np.int32)), ValueError, "query_offsets"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(is_causal=1), TypeError, "is_causal"),
])
def test_bad_input_raises(kwargs, error, match):
  args = dict(query=np.zeros((2, 3, 4, 16), np.float32), key=np.zeros((2, 5, 2, 16), np.float32),
              value=np.zeros((2, 5, 2, 16), np.float32))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    jdet.dot_product_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)


def test_tile_rule_ignores_rows():
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    for h in (16, 64, 80, 128, 256):
      tiles = kernels.attention_tiles(h, dtype, interpret=False)
      assert tiles.chunk_k % tiles.block_k == 0
      assert min(tiles.block_q, tiles.block_k, tiles.bwd_block_q, tiles.bwd_block_k) >= 16


def test_few_rows_take_a_smaller_row_tile():
  for dtype in (jnp.bfloat16, jnp.float32):
    tiles = kernels.attention_tiles(128, dtype, interpret=False)
    for rows in (1, 4, 16, 17, 60, 64, 65, tiles.block_q, 4 * tiles.block_q):
      got = tiles.for_rows(rows)
      assert got.min_block_q <= got.block_q <= tiles.block_q
      assert got.block_q >= min(rows, tiles.block_q) and (got.block_q // 2 < rows
                                                           or got.block_q == got.min_block_q)
      assert got.num_warps <= tiles.num_warps
      assert dataclasses.replace(got, block_q=tiles.block_q, num_warps=tiles.num_warps) == tiles


def test_mosaic_prefill_rule():
  """The H100 prefill and backward (Mosaic GPU) serve 16-bit inputs at head sizes
  64 and 128 with at least a wave of 128-query tiles; everything else stays on
  Triton."""
  h100, a100 = kernels.Device("gpu", "9.0", 132), kernels.Device("gpu", "8.0", 108)
  bf16, f32 = jnp.bfloat16, jnp.float32

  def rule(batch, t, heads, kv_heads, head_dim=128, dtype=bf16, device=h100, interpret=False,
           seq=None):
    """The prefill's and the backward's choices, which agree."""
    tiles = kernels.attention_tiles(head_dim, dtype, interpret=interpret)
    shapes = ((batch, t, heads, head_dim), (batch, seq or t, kv_heads, head_dim), dtype, tiles)
    prefill = kernels.use_mosaic_prefill(*shapes, interpret=interpret, device=device)
    backward = kernels.use_mosaic_backward(*shapes, interpret=interpret, device=device)
    assert backward == prefill, shapes
    return prefill, backward

  both, neither = (True, True), (False, False)
  assert rule(1, 4096, 32, 8) == rule(8, 512, 32, 8) == rule(4, 1000, 28, 4) == both
  assert rule(1, 4096, 32, 8, dtype=jnp.float16) == rule(1, 2048, 32, 8, seq=4096) == both
  assert rule(1, 300, 28, 4) == neither  # 84 tiles of 128 queries for 132 SMs
  assert rule(64, 1, 32, 8) == neither  # decode
  assert rule(8, 512, 32, 8, seq=32768) == neither  # a short prefill into a long cache
  assert rule(2, 2048, 16, 16, head_dim=64) == both
  assert rule(2, 1000, 16, 16, head_dim=64) == neither  # 1000 x 1000 rows x T < 2048 x S
  assert rule(1, 4096, 32, 8, dtype=f32) == neither
  assert rule(1, 4096, 32, 8, device=a100) == neither
  assert rule(1, 4096, 32, 8, interpret=True) == neither
  sd = jax.ShapeDtypeStruct
  q, kv, ints = sd((1, 64, 4, 128), bf16), sd((1, 64, 2, 128), bf16), sd((1,), jnp.int32)
  static = dict(scale=0.1, causal=True, interpret=False, mosaic=True,
                tiles=kernels.attention_tiles(128, bf16, interpret=False))
  with pytest.raises(ValueError, match="split-KV"):
    jax.eval_shape(functools.partial(kernels.attention_forward, split=True, **static),
                   q, kv, kv, ints, ints)
  with pytest.raises(ValueError, match="at least 128 queries"):
    jax.eval_shape(functools.partial(kernels.attention_forward, split=False, **static),
                   q, kv, kv, ints, ints)
  with pytest.raises(ValueError, match="at least 128 queries"):
    jax.eval_shape(functools.partial(kernels.attention_backward, **static),
                   q, kv, kv, q, sd((1, 2, 128), jnp.float32), q, ints, ints)


@pytest.mark.skipif(on_gpu(), reason="the GPU tests compile the kernels for real")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_lower_for_cuda(dtype, head_dim):
  """Every kernel lowers for the GPU, the H100 prefill and backward (Mosaic GPU)
  too where they take the inputs (with and without lengths and offsets: dense),
  with a sequence length that TMA's 8-key tiles do not divide."""
  if not cuda_lowering_available():
    pytest.skip("jax's CUDA plugin is not installed")
  sd = jax.ShapeDtypeStruct
  q, kv = sd((2, 300, 8, head_dim), dtype), sd((2, 1001, 2, head_dim), dtype)
  ints = sd((2,), jnp.int32)
  tiles = kernels.attention_tiles(head_dim, dtype, interpret=False)
  static = dict(scale=0.1, causal=True, tiles=tiles, interpret=False)
  paths = [dict(split=False, mosaic=False), dict(split=True)]
  if attention_hopper.supported(dtype, head_dim, tiles):
    paths += [dict(split=False, mosaic=True), dict(split=False, mosaic=True, dense=True)]
  for path in paths:
    fwd = functools.partial(kernels.attention_forward, **path, **static)
    jax.jit(fwd).trace(q, kv, kv, ints, ints).lower(lowering_platforms=("cuda",))
  lse = sd((2, 2, 1200), jnp.float32)
  mosaic = attention_hopper.supported_backward(dtype, head_dim, tiles)
  for path in [dict(mosaic=False)] + mosaic * [dict(mosaic=True), dict(mosaic=True, dense=True)]:
    bwd = functools.partial(kernels.attention_backward, **path, **static)
    jax.jit(bwd).trace(q, kv, kv, q, lse, q, ints, ints).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.long
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_prefill_decode_chunked_split(dtype):
  seq, batch = 1024, 2
  rng = np.random.default_rng(11)
  q = random_normal(rng, (batch, seq, 32, 128), dtype)
  k = random_normal(rng, (batch, seq + 3600, 8, 128), dtype)
  v = random_normal(rng, (batch, seq + 3600, 8, 128), dtype)
  lengths = jnp.full((batch,), seq, jnp.int32)
  whole = np.asarray(attend(q, k, v, lengths, _zeros(batch)))
  ref = jdet.dot_product_attention_reference(q, k[:, :seq], v[:, :seq], is_causal=True)
  assert relative_error(jnp.asarray(whole, jnp.float32), jnp.asarray(ref, jnp.float32)) < 2e-2
  for split in (False, True):
    for t in list(range(0, seq, 37)) + [seq - 1]:
      step = attend_path(q[:, t:t + 1], k, v, jnp.full((batch,), t + 1, jnp.int32),
                         jnp.full((batch,), t, jnp.int32), split=split)
      assert_bitwise_equal(step[:, 0], whole[:, t], what=f"decode t={t} split={split}")
  start = 0
  for size in (1, 63, 333, 419):
    got = attend(q[:, start:start + size], k, v, jnp.full((batch,), start + size, jnp.int32),
                 jnp.full((batch,), start, jnp.int32))
    assert_bitwise_equal(got, whole[:, start:start + size], what=f"chunk {start}+{size}")
    start += size
  alone = attend(q[1:], k[1:], v[1:], lengths[1:], _zeros(1))
  assert_bitwise_equal(alone[0], whole[1], what="sequence 1 alone")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_mosaic_prefill_equals_triton_prefill(dtype):
  """The H100 prefill (Mosaic GPU) gives the Triton prefill's bits, output and
  log-sum-exp: causal and not, GQA, MQA and MHA, head sizes 64 and 128, packed
  rows that fill no whole tile, key lengths that TMA's 8-key tiles do not divide,
  padded caches with NaN past each sequence's length, and query offsets."""
  if not kernels.Device.current().is_hopper:
    pytest.skip("the Mosaic GPU prefill runs on an H100 (sm_90) only")
  rng = np.random.default_rng(5)
  for batch, t, seq, heads, kv_heads, head_dim, causal in [
      (2, 333, 1001, 8, 2, 128, True), (3, 200, 777, 4, 4, 64, True),
      (2, 1000, 1000, 8, 1, 128, False), (1, 512, 4096, 16, 2, 64, True)]:
    q = random_normal(rng, (batch, t, heads, head_dim), dtype)
    k = random_normal(rng, (batch, seq, kv_heads, head_dim), dtype)
    v = random_normal(rng, (batch, seq, kv_heads, head_dim), dtype)
    lengths = jnp.asarray(rng.integers(t, seq + 1, batch), jnp.int32)
    valid = jnp.arange(seq)[None, :, None, None] < lengths[:, None, None, None]
    k, v = (jnp.where(valid, x, jnp.asarray(np.nan, dtype)) for x in (k, v))
    offsets = lengths - t if causal else jnp.asarray(rng.integers(0, 50, batch), jnp.int32)
    tiles = kernels.attention_tiles(head_dim, dtype, interpret=False)
    outs = {}
    for mosaic in (True, False):
      fwd = jax.jit(functools.partial(kernels.attention_forward, scale=head_dim ** -0.5,
                                      causal=causal, tiles=tiles, interpret=False, split=False,
                                      mosaic=mosaic))
      outs[mosaic] = fwd(q, k, v, lengths, offsets)
    what = f"B={batch} T={t} S={seq} N={heads} K={kv_heads} H={head_dim} causal={causal}"
    assert not np.isnan(np.asarray(outs[True][0], np.float32)).any(), what
    assert_bitwise_equal(outs[True][0], outs[False][0], what=f"output, {what}")
    assert_bitwise_equal(outs[True][1], outs[False][1], what=f"log-sum-exp, {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_mosaic_backward_equals_triton_backward(dtype):
  """The H100 backward (Mosaic GPU dK/dV and dQ kernels) gives the Triton
  backward's bits for dq, dk and dv: causal and not, GQA, MQA and MHA, head
  sizes 64 and 128, rows and keys that fill no whole tile or CTA, padded caches
  with NaN past each sequence's length (and a sequence with no valid key), and
  query offsets."""
  if not kernels.Device.current().is_hopper:
    pytest.skip("the Mosaic GPU backward runs on an H100 (sm_90) only")
  rng = np.random.default_rng(6)
  for batch, t, seq, heads, kv_heads, head_dim, causal in [
      (2, 333, 1001, 8, 2, 128, True), (3, 200, 777, 4, 4, 64, True),
      (2, 1000, 1000, 8, 1, 128, False), (1, 512, 4096, 16, 2, 64, True),
      (2, 130, 300, 4, 2, 128, False)]:
    q, dout = (random_normal(rng, (batch, t, heads, head_dim), dtype) for _ in range(2))
    k = random_normal(rng, (batch, seq, kv_heads, head_dim), dtype)
    v = random_normal(rng, (batch, seq, kv_heads, head_dim), dtype)
    lengths = jnp.asarray(rng.integers(t, seq + 1, batch), jnp.int32)
    if not causal:
      lengths = lengths.at[-1].set(0)
    valid = jnp.arange(seq)[None, :, None, None] < lengths[:, None, None, None]
    k, v = (jnp.where(valid, x, jnp.asarray(np.nan, dtype)) for x in (k, v))
    offsets = lengths - t if causal else jnp.asarray(rng.integers(0, 50, batch), jnp.int32)
    static = dict(scale=head_dim ** -0.5, causal=causal,
                  tiles=kernels.attention_tiles(head_dim, dtype, interpret=False),
                  interpret=False)
    out, lse = jax.jit(functools.partial(kernels.attention_forward, **static))(
        q, k, v, lengths, offsets)
    grads = {}
    for mosaic in (True, False):
      bwd = jax.jit(functools.partial(kernels.attention_backward, mosaic=mosaic, **static))
      grads[mosaic] = bwd(q, k, v, out, lse, dout, lengths, offsets)
    what = f"B={batch} T={t} S={seq} N={heads} K={kv_heads} H={head_dim} causal={causal}"
    for name, got, want in zip(("dq", "dk", "dv"), grads[True], grads[False]):
      assert not np.isnan(np.asarray(got, np.float32)).any(), f"{name}, {what}"
      assert_bitwise_equal(got, want, what=f"{name}, {what}")
