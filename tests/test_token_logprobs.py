"""jdet.token_logprobs: fused == unfused bitwise, row invariance, gradients, errors.

On CPU the vocab chunk is 256 columns (two 128-wide sub-chunks), so V = 300 runs
one full chunk in the chunk loop and a 44-column tail chunk. A few rows take the
whole vocabulary at once and the 24-row batch the chunk loop, so comparing rows
alone with the batch compares the two paths. V = 300 is not 64-aligned, so the
forward streams chunks too; a 64-aligned V takes blocks of rows instead
(test_row_blocks_forward).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.bench import on_gpu
from jdet.testing import assert_bitwise_equal, random_normal, relative_error
from pallas_kernels import softmax as kernels

T, D, V = 24, 40, 300
TAU = 0.7


def _normal(rng, shape, dtype=jnp.float32, scale=1.0):
  return (random_normal(rng, shape) * scale).astype(dtype)


def _unfused(h, w, t, temperature):
  logits = jdet.matmul(h, w, preferred_element_type=jnp.float32) / temperature
  return jnp.take_along_axis(jdet.log_softmax(logits), t[..., None], -1)[..., 0]


fused = jax.jit(lambda h, w, t: jdet.token_logprobs(h, w, t, temperature=TAU))
unfused = jax.jit(lambda h, w, t: _unfused(h, w, t, TAU))


def _grads(fn):
  return jax.jit(jax.grad(lambda h, w, t, g: jnp.sum(fn(h, w, t, temperature=TAU) * g),
                          argnums=(0, 1)))


grads = _grads(jdet.token_logprobs)


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  return (_normal(rng, (T, D), jnp.bfloat16), _normal(rng, (D, V), jnp.bfloat16, 0.5),
          jnp.asarray(rng.integers(0, V, (T,)), jnp.int32).at[:3].set(jnp.array([0, 299, 256])),
          _normal(rng, (T,)))


def test_chunking_on_cpu():
  assert kernels.token_chunk_cols(V, interpret=True) == 256
  assert kernels.softmax_tiles(V, interpret=True).block_cols == 128
  assert kernels.token_whole_vocab(1, V, interpret=True)
  assert not kernels.token_whole_vocab(kernels.softmax_tiles(V, interpret=True).block_rows, V,
                                       interpret=True)


def test_row_blocks_forward():
  """Above the whole-vocabulary limit a 64-aligned V's forward takes even row
  blocks of at most 6 rows at V = 320 on CPU (14 rows: three of 5, one padded),
  each over the whole vocabulary; the backward streams chunks. Rows alone, in
  blocks at other offsets and sizes and the whole batch give the same bits, and
  the unfused ones."""
  vocab, rows = 320, 14
  assert kernels.token_row_block(rows, vocab, interpret=True) == 5
  assert kernels.token_row_block(12, vocab, interpret=True) == 6
  assert kernels.token_row_block(rows, V, interpret=True) is None
  # The GPU rule (128-row multiples, 512 MiB of logits): test_gpu_fused_equals_...'s
  # 1800 rows at V = 151,936 take three blocks of 640.
  assert kernels.token_row_block(1800, 151936, interpret=False) == 640
  assert not kernels.token_whole_vocab(rows, vocab, interpret=True)
  rng = np.random.default_rng(1)
  h = _normal(rng, (rows, D), jnp.bfloat16)
  w = _normal(rng, (D, vocab), jnp.bfloat16, 0.5)
  t = jnp.asarray(rng.integers(0, vocab, (rows,)), jnp.int32)
  g = _normal(rng, (rows,))
  out = fused(h, w, t)
  assert_bitwise_equal(out, unfused(h, w, t), what="row blocks: fused vs unfused")
  dh, _ = grads(h, w, t, g)
  for part in (slice(4, 5), slice(2, 14)):
    assert_bitwise_equal(fused(h[part], w, t[part]), out[part], what=f"rows {part} alone")
    dh_part, _ = grads(h[part], w, t[part], g[part])
    assert_bitwise_equal(dh_part, dh[part], what=f"dhidden rows {part} alone")
  # Under vmap each half's 7 rows take two blocks of 4 (one row padded).
  halves = jax.jit(jax.vmap(lambda h, t: jdet.token_logprobs(h, w, t, temperature=TAU)))
  assert_bitwise_equal(halves(h.reshape(2, rows // 2, D), t.reshape(2, rows // 2)).reshape(rows),
                       out, what="vmap over two halves in row blocks")


def test_fused_equals_unfused_bitwise(data):
  h, w, t, _ = data
  assert_bitwise_equal(fused(h, w, t), unfused(h, w, t), what="fused vs unfused, temperature 0.7")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_invariant_forward_and_dhidden(data, dtype):
  h, w, t, g = data
  h, w = h.astype(dtype), (w * 2).astype(dtype)
  out = fused(h, w, t)
  dh, _ = grads(h, w, t, g)
  # Rows 8-15 are one whole row block on CPU (a grid of one program, which XLA:CPU
  # inlines into its surroundings).
  block = kernels.softmax_tiles(V, interpret=True).block_rows
  for rows in (slice(1, 2), slice(5, 6), slice(23, 24), slice(block, 2 * block)):
    assert_bitwise_equal(fused(h[rows], w, t[rows]), out[rows], what=f"rows {rows} alone")
    dh_rows, _ = grads(h[rows], w, t[rows], g[rows])
    assert_bitwise_equal(dh_rows, dh[rows], what=f"dhidden rows {rows} alone")
  split = jax.jit(jax.vmap(lambda h, t: jdet.token_logprobs(h, w, t, temperature=TAU)))
  # Halves take the chunk loop, pairs of rows the whole vocabulary.
  for parts in (2, T // 2):
    assert_bitwise_equal(split(h.reshape(parts, T // parts, D), t.reshape(parts, T // parts))
                         .reshape(T), out, what=f"vmap over {parts} parts")


def test_dweight_unchanged_by_zero_cotangent_rows(data):
  h, w, t, g = data
  for i in (0, 5):
    _, dw = grads(h[i:i + 1], w, t[i:i + 1], g[i:i + 1])
    _, dw_padded = grads(h, w, t, jnp.zeros_like(g).at[i].set(g[i]))
    assert_bitwise_equal(dw_padded, dw, what=f"dweight of row {i} with 23 zero-cotangent rows")


def test_accuracy_and_grads_vs_reference(data):
  h, w, t, g = data
  h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
  want = jdet.token_logprobs_reference(h32, w32, t, temperature=TAU)
  x64 = (np.asarray(h32, np.float64) @ np.asarray(w32, np.float64)) / TAU
  top = x64.max(-1, keepdims=True)
  lp64 = (x64 - top - np.log(np.exp(x64 - top).sum(-1, keepdims=True)))[np.arange(T), t]
  out = fused(h, w, t)
  assert out.dtype == jnp.float32 and out.shape == (T,)
  assert relative_error(out, lp64) < 1e-6 and relative_error(want, lp64) < 1e-6
  dh, dw = grads(h, w, t, g)
  assert dh.dtype == h.dtype and dw.dtype == w.dtype
  rh, rw = _grads(jdet.token_logprobs_reference)(h32, w32, t, g)
  # dlogits is rounded to bfloat16 (the GEMM's compute dtype) before the backward GEMMs.
  assert relative_error(dh, rh) < 1e-2 and relative_error(dw, rw) < 1e-2


def test_float32_temperature_1_unfused_and_gradients():
  """float32 [2, 3, D] hidden (leading dims), temperature 1 (no scaling in-kernel)."""
  rng = np.random.default_rng(3)
  h, w = _normal(rng, (2, 3, 16)), _normal(rng, (16, 130))
  t = jnp.asarray(rng.integers(0, 130, (2, 3)), jnp.int32)
  g = _normal(rng, (2, 3))
  out, vjp = jax.jit(lambda h, w: jax.vjp(lambda h, w: jdet.token_logprobs(h, w, t), h, w))(h, w)
  assert_bitwise_equal(out, jax.jit(_unfused, static_argnums=3)(h, w, t, 1.0),
                       what="float32, temperature 1: fused vs unfused")
  got = vjp(g)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(jax.grad(lambda h, w: jnp.sum(jdet.token_logprobs_reference(h, w, t) * g),
                           (0, 1)))(h, w)
  # On the GPU jdet's float32 GEMMs use TF32 (jdet.matmul's default precision).
  tolerance = 2e-3 if on_gpu() else 1e-5
  for x, y in zip(got, want):
    assert relative_error(x, y) < tolerance


def test_traced_out_of_range_tokens_give_nan_and_no_gradient(data):
  h, w, t, g = data
  bad = t.at[4].set(V).at[7].set(-1)
  out = fused(h, w, bad)
  assert np.isnan(np.asarray(out)[[4, 7]]).all()
  keep = np.setdiff1d(np.arange(T), [4, 7])
  assert_bitwise_equal(out[keep], fused(h, w, t)[keep], what="rows beside bad tokens")
  dh, _ = grads(h, w, bad, g.at[4].set(0.0).at[7].set(0.0))
  assert np.isfinite(np.asarray(dh, np.float32)).all()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"hidden": np.ones((4,), np.float32)}, ValueError, "hidden must have shape"),
    ({"weight": np.ones((8, 3, 2), np.float32)}, ValueError, r"weight must have shape \[D, V\]"),
    ({"weight": np.ones((7, 10), np.float32)}, ValueError, "D = 8"),
    ({"tokens": np.zeros((4,), np.float32)}, TypeError, "tokens must have an integer dtype"),
    ({"tokens": np.zeros((5,), np.int32)}, ValueError, r"tokens must have shape"),
    ({"tokens": np.full((4,), 10, np.int32)}, ValueError, r"tokens must lie in \[0, V = 10\)"),
    ({"tokens": np.full((4,), -1, np.int32)}, ValueError, "tokens must lie in"),
    ({"hidden": np.ones((4, 8), np.int32)}, TypeError, "hidden must be"),
    ({"weight": np.ones((8, 10), np.float64)}, TypeError, "float64"),
    ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
    ({"temperature": float("inf")}, ValueError, "temperature"),
    ({"temperature": 1e-46}, ValueError, "temperature"),
    ({"temperature": "1"}, TypeError, "temperature must be a Python float"),
])
def test_bad_input_raises(kwargs, error, match):
  args = {"hidden": np.ones((4, 8), np.float32), "weight": np.ones((8, 10), np.float32),
          "tokens": np.zeros((4,), np.int32)}
  args.update(kwargs)
  temperature = args.pop("temperature", 1.0)
  with pytest.raises(error, match=match):
    jdet.token_logprobs(args["hidden"], args["weight"], args["tokens"], temperature=temperature)


@pytest.mark.gpu
@pytest.mark.long
@pytest.mark.parametrize("vocab", [151936, 128256, 50257])
def test_gpu_fused_equals_unfused_and_rows_invariant(vocab):
  """Realistic LM head: fused == unfused bitwise (temperature 1 and 0.7), the first
  rows alone vs the whole batch (1800 rows at V = 151,936, else 300), dhidden rows,
  and dweight unchanged by zero-cotangent rows.
  At V = 151,936 the whole batch's forward takes three blocks of 640 rows (the
  last padded), its gradient the chunk loop, and up to 1766 rows the whole
  vocabulary at once (128,256: all of them), so the first rows compare the
  paths. V = 50,257 (odd: always the chunk loop) reads log_softmax's rows at
  an odd pitch and the chunks at an aligned one: pallas_kernels.softmax's
  layout-free row sums."""
  rng = np.random.default_rng(vocab)
  d, rows = 1024, 1800 if vocab == 151936 else 300
  assert kernels.token_whole_vocab(rows, vocab, interpret=False) == (vocab == 128256)
  assert kernels.token_whole_vocab(255, vocab, interpret=False) == (vocab != 50257)
  h = _normal(rng, (rows, d), jnp.bfloat16)
  w = _normal(rng, (d, vocab), jnp.bfloat16, 0.05)
  t = jnp.asarray(rng.integers(0, vocab, (rows,)), jnp.int32)
  g = _normal(rng, (rows,))
  for tau in (1.0, TAU):
    got = jax.jit(lambda h, w, t: jdet.token_logprobs(h, w, t, temperature=tau))(h, w, t)
    want = jax.jit(lambda h, w, t: _unfused(h, w, t, tau))(h, w, t)
    assert_bitwise_equal(got, want, what=f"V={vocab}, temperature {tau}: fused vs unfused")
  out = fused(h, w, t)
  dh, dw = grads(h, w, t, g)
  for m in (1, 17, 64, 129, 255):
    assert_bitwise_equal(fused(h[:m], w, t[:m]), out[:m], what=f"V={vocab}, first {m} rows")
    dh_m, dw_m = grads(h[:m], w, t[:m], g[:m])
    assert_bitwise_equal(dh_m, dh[:m], what=f"V={vocab}, dhidden, first {m} rows")
    _, dw_zero = grads(h, w, t, jnp.zeros_like(g).at[:m].set(g[:m]))
    assert_bitwise_equal(dw_zero, dw_m, what=f"V={vocab}, dweight, {rows - m} zero rows")
  ref = jdet.token_logprobs_reference(h, w, t, temperature=TAU)
  assert relative_error(out, ref) < 1e-5
