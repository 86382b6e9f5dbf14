"""jdet.rms_norm: row invariance, fused residual, determinism, backward, accuracy, errors.

The same tests run in Pallas interpret mode on CPU and natively on a GPU; the
``gpu``-marked sweep covers the GPU tile rule over H with larger row counts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jdet
from jdet.testing import (assert_batch_invariant, assert_bitwise_equal, assert_deterministic,
                          random_normal, relative_error)
from pallas_kernels import rms_norm as kernels

ROWS = 40  # 5 interpret row blocks of 8, 3 dweight chunks of 16
# H = 7: one partial chunk; 200: two chunks walked twice (the interpret chunk is
# 128); 96 (one chunk, masked columns) runs in the model and vmap tests.
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}


def _operands(h, dtype=jnp.bfloat16, rows=ROWS):
  return (random_normal(h, (rows, h), dtype), random_normal(h + 1, (rows, h), dtype),
          random_normal(h + 2, (h,), jnp.float32) + 1.0, random_normal(h + 3, (rows, h), dtype))


def _per_row_loss(y, g):
  return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32))


def _outputs(x, r, w, g):
  """Both forms and every per-row gradient: each row's entries depend on its own row."""
  y = jdet.rms_norm(x, w)
  y_fused, total = jdet.rms_norm(x, w, residual=r)
  dx = jax.grad(lambda x: _per_row_loss(jdet.rms_norm(x, w), g))(x)

  def fused_loss(x, r):
    y, total = jdet.rms_norm(x, w, residual=r)
    return _per_row_loss(y, g) + _per_row_loss(total, g * g)

  dx_fused, dr_fused = jax.grad(fused_loss, argnums=(0, 1))(x, r)
  return {"y": y, "y_fused": y_fused, "sum": total, "dx": dx, "dx_fused": dx_fused,
          "dr_fused": dr_fused}


def _grads(x, r, w, g):
  def loss(x, r, w):
    y, total = jdet.rms_norm(x, w, residual=r)
    return _per_row_loss(y, g) + _per_row_loss(total, g * g)
  return jax.grad(loss, argnums=(0, 1, 2))(x, r, w)


grads = jax.jit(_grads)
plain_grads = jax.jit(jax.grad(lambda x, w, g: _per_row_loss(jdet.rms_norm(x, w), g),
                               argnums=(0, 1)))


# float32 outputs show 1-ulp differences that bf16 rounding can hide.
@pytest.mark.parametrize("h,dtype,batch_sizes,vmap_splits", [
    (7, jnp.bfloat16, (1,), ()), (200, jnp.float32, (1, 17), (4,))])
def test_batch_invariant_forward_fused_and_row_gradients(h, dtype, batch_sizes, vmap_splits):
  x, r, w, g = _operands(h, dtype)
  assert_batch_invariant(_outputs, x, r, w, g, in_axes=(0, 0, None, 0),
                         batch_sizes=batch_sizes, vmap_splits=vmap_splits)


def test_leading_dims_and_vmap_equal_flat_rows():
  x, r, w, _ = _operands(96, rows=24)
  flat = jdet.rms_norm(x, w, residual=r)
  nested = jdet.rms_norm(x.reshape(2, 3, 4, 96), w, residual=r.reshape(2, 3, 4, 96))
  mapped = jax.jit(jax.vmap(lambda x, r: jdet.rms_norm(x, w, residual=r)))(
      x.reshape(3, 8, 96), r.reshape(3, 8, 96))
  for got in (nested, mapped):
    assert_bitwise_equal(jax.tree.map(lambda a: a.reshape(24, 96), got), flat,
                         what="leading dims / vmap vs flat rows")


def test_deterministic_forward_and_backward():
  x, r, w, g = _operands(200)
  assert_deterministic(lambda x, r, w: jdet.rms_norm(x, w, residual=r), x, r, w, runs=3)
  assert_deterministic(grads, x, r, w, g, runs=3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_fused_residual_equals_unfused_bitwise(dtype):
  x, r, w, _ = _operands(200, dtype)
  weight = w if dtype == jnp.bfloat16 else w.astype(dtype)
  y, total = jdet.rms_norm(x, weight, residual=r)
  assert_bitwise_equal(total, x + r, what="fused sum vs x + residual")
  assert_bitwise_equal(y, jdet.rms_norm(x + r, weight), what="fused vs unfused norm")


@pytest.mark.parametrize("dtype,h", [(jnp.bfloat16, 200), (jnp.float16, 7),
                                     (jnp.float32, 200)])
def test_accuracy_vs_float64(dtype, h):
  x, r, w, _ = _operands(h, dtype, rows=9)
  scale = np.linspace(1e-3, 30.0, 9)[:, None]  # rows of very different magnitudes
  x = (x.astype(jnp.float32) * scale).astype(dtype)
  for residual in (None, r):
    out = jdet.rms_norm(x, w, residual=residual)
    y = out if residual is None else out[0]
    h64 = np.asarray(x if residual is None else out[1], np.float64)
    want = h64 / np.sqrt(np.mean(h64 * h64, -1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
    assert y.dtype == dtype and y.shape == x.shape
    assert relative_error(y, want) < TOLERANCE[dtype], (dtype, h, residual is None)
    ref = jdet.rms_norm_reference(x, w, residual=residual)
    assert relative_error(y, want) <= 2 * relative_error(
        ref if residual is None else ref[0], want) + TOLERANCE[dtype] / 4


@pytest.mark.parametrize("h,weight_dtype", [(7, jnp.float32), (200, jnp.bfloat16)])
def test_gradients_match_reference(h, weight_dtype):
  x, r, w, g = _operands(h, jnp.float32, rows=13)
  w = w.astype(weight_dtype)

  def loss(fn, x, r, w):
    y, total = fn(x, w, residual=r)
    plain = fn(x, w)
    return (jnp.sum(y * g) + jnp.sum(jnp.sin(total)) + jnp.sum(plain * g[::-1])
            + jnp.mean(plain))

  got = jax.jit(jax.grad(lambda *a: loss(jdet.rms_norm, *a), argnums=(0, 1, 2)))(x, r, w)
  want = jax.grad(lambda *a: loss(jdet.rms_norm_reference, *a), argnums=(0, 1, 2))(x, r, w)
  for name, a, b in zip(("dx", "dresidual", "dweight"), got, want):
    assert a.dtype == b.dtype, name
    assert relative_error(a, b) < (1e-5 if weight_dtype == jnp.float32 else 1e-2), name


def test_bf16_gradient_dtypes_and_accuracy():
  x, r, w, g = _operands(200)
  dx, dr, dw = grads(x, r, w, g)
  assert dx.dtype == dr.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  assert_bitwise_equal(dx, dr, what="dx vs dresidual")
  f32 = lambda a: a.astype(jnp.float32)
  want = jax.grad(lambda x, w: _per_row_loss(jdet.rms_norm_reference(x, w, residual=f32(r))[0],
                                             g) + _per_row_loss(f32(x) + f32(r), g * g),
                  argnums=(0, 1))(f32(x), w)
  assert relative_error(dx, want[0]) < 1e-2
  assert relative_error(dw, want[1]) < 1e-2


def test_nan_and_inf_stay_in_their_rows():
  x, r, w, g = _operands(200)
  bad = x.at[3, 17].set(jnp.nan).at[11, 150].set(jnp.inf).at[12].set(0.0)
  keep = np.setdiff1d(np.arange(ROWS), [3, 11, 12])
  for fn in (lambda x: jdet.rms_norm(x, w), lambda x: jdet.rms_norm(x, w, residual=r),
             lambda x: plain_grads(x, w, g)[0], lambda x: grads(x, r, w, g)[:2]):
    got, want = fn(bad), fn(x)
    assert_bitwise_equal(jax.tree.map(lambda a: a[keep], got),
                         jax.tree.map(lambda a: a[keep], want), what="rows without NaN/inf")
    assert np.isnan(np.asarray(jax.tree.leaves(got)[0][3], np.float32)).any()
  assert np.isfinite(np.asarray(jdet.rms_norm(bad, w)[12], np.float32)).all()  # zero row


def test_dweight_unchanged_by_zero_cotangent_rows():
  x, r, w, g = _operands(200)
  for m in (1, 17):  # one row; a chunk of 16 and a partial step
    zero_g = jnp.concatenate([g[:m], jnp.zeros_like(g[m:])])
    assert_bitwise_equal(plain_grads(x, w, zero_g)[1], plain_grads(x[:m], w, g[:m])[1],
                         what=f"dweight with {ROWS - m} zero-cotangent rows after {m}")
  assert_bitwise_equal(grads(x, r, w, zero_g)[2], grads(x[:m], r[:m], w, g[:m])[2],
                       what=f"fused dweight with {ROWS - m} zero-cotangent rows after {m}")


def test_inside_a_jitted_model():
  """rms_norm -> jdet.matmul -> rms_norm with residual, under jit, with several output sets."""
  x, r, w, _ = _operands(96)
  proj = random_normal(7, (96, 96), jnp.bfloat16) * 0.1
  w2 = random_normal(8, (96,), jnp.bfloat16)

  def model(x, r):
    a = jdet.rms_norm(x, w)
    b = jdet.matmul(a, proj)
    y, hidden = jdet.rms_norm(b, w2, residual=r)
    return {"a": a, "b": b, "y": y, "hidden": hidden}

  def with_grads(x, r):
    loss = lambda x, r: jnp.sum(model(x, r)["y"].astype(jnp.float32) ** 2)
    return model(x, r), jax.grad(loss, argnums=(0, 1))(x, r)

  assert_batch_invariant(with_grads, x, r, batch_sizes=(1, 17), pad=0, vmap_splits=())
  assert_batch_invariant(lambda x, r: model(x, r)["y"], x, r, batch_sizes=(17,),
                         single_rows=(), pad=3, vmap_splits=())


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=jnp.float32(1.0)), ValueError, "x must have shape"),
    (dict(x=jnp.zeros((3, 0))), ValueError, "H >= 1"),
    (dict(weight=jnp.ones(7)), ValueError, "weight must have shape"),
    (dict(weight=jnp.ones((1, 8))), ValueError, "weight must have shape"),
    (dict(residual=jnp.ones((3, 7))), ValueError, "residual must have x's shape"),
    (dict(residual=jnp.ones((3, 8), jnp.bfloat16)), TypeError, "residual must have x's dtype"),
    (dict(residual=jnp.ones((3, 8), jnp.int32)), TypeError, "residual must be"),
    (dict(x=jnp.ones((3, 8), jnp.int32)), TypeError, "x must be"),
    (dict(weight=jnp.ones(8, jnp.int32)), TypeError, "weight must be"),
    (dict(x=np.ones((3, 8))), TypeError, "x must be.*float64"),
    (dict(weight=np.ones(8)), TypeError, "weight must be.*float64"),
    (dict(x="abc"), TypeError, "x must be an array"),
    (dict(eps=0.0), ValueError, "eps must be"),
    (dict(eps=-1e-6), ValueError, "eps must be"),
    (dict(eps=1e-50), ValueError, "eps must be"),  # 0 in float32
    (dict(eps=float("nan")), ValueError, "eps must be"),
    (dict(eps=float("inf")), ValueError, "eps must be"),
    (dict(eps="1e-6"), TypeError, "eps must be"),
])
def test_bad_input_raises(kwargs, error, match):
  args = dict(x=jnp.ones((3, 8)), weight=jnp.ones(8), eps=1e-6, residual=None)
  args.update(kwargs)
  x, weight = args.pop("x"), args.pop("weight")
  with pytest.raises(error, match=match):
    jdet.rms_norm(x, weight, **args)


def test_empty_rows_and_reference_semantics():
  w = jnp.ones(8)
  assert jdet.rms_norm(jnp.zeros((0, 8)), w).shape == (0, 8)
  y, total = jdet.rms_norm(jnp.zeros((2, 0, 8), jnp.bfloat16), w,
                           residual=jnp.zeros((2, 0, 8), jnp.bfloat16))
  assert y.shape == total.shape == (2, 0, 8) and y.dtype == jnp.bfloat16
  x = random_normal(0, (4, 8), jnp.bfloat16)
  assert jdet.rms_norm_reference(x, w).dtype == jnp.bfloat16


def test_tile_rule_depends_on_h_only_and_suits_triton():
  for h in (1, 7, 96, 1000, 4096, 8192, 16384, 40000):
    tiles = kernels.rms_norm_tiles(h, interpret=False)
    for n in (tiles.block_rows, tiles.chunk, tiles.num_warps):
      assert n & (n - 1) == 0, (h, tiles)
    assert tiles.chunk >= min(h, kernels.GPU_MAX_CHUNK) and tiles.num_warps <= 16
    assert tiles.block_rows * tiles.chunk >= kernels.GPU_ROW_BLOCK_ELEMENTS or h > 4096
    # At most 16 float32 values of a row block a thread, so rows stay in registers.
    assert tiles.block_rows * tiles.chunk <= 16 * 32 * tiles.num_warps, (h, tiles)
    assert tiles.chunk_rows % tiles.block_rows == 0 and tiles.chunk_rows >= 8, (h, tiles)
    dw = kernels.dweight_tiles(h, interpret=False)
    assert dw.row_step & (dw.row_step - 1) == 0
    assert dw.block_cols == min(kernels.GPU_DWEIGHT_TILES.block_cols, pl.next_power_of_2(h))


GPU_H_SWEEP = (1, 7, 96, 1000, 1001, 4096, 5000, 8192, 10001, 16384, 20000)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("h", GPU_H_SWEEP)
def test_gpu_sweep_over_h(h, dtype):
  rows = 3000  # at H >= 4096: 375 dx chunks of 8 rows, 3 steps of the partials' sum
  x, r, w, g = _operands(h, dtype, rows=rows)
  full = jax.jit(_outputs)(x, r, w, g)
  dw_full = grads(x, r, w, g)[2]
  # Sizes with and without a partial last row block (the kernels mask only then).
  for start, size in ((0, 1), (5, 1), (rows - 1, 1), (0, 33), (64, 64), (700, 1100),
                      (0, rows - 1)):
    part = jax.jit(_outputs)(x[start:start + size], r[start:start + size], w,
                             g[start:start + size])
    assert_bitwise_equal(part, jax.tree.map(lambda a: a[start:start + size], full),
                         what=f"H={h}: rows {start}:{start + size} vs {rows}")
  zero_g = g.at[1024:].set(0)
  assert_bitwise_equal(grads(x, r, w, zero_g)[2], grads(x[:1024], r[:1024], w, g[:1024])[2],
                       what=f"H={h}: dweight with zero-cotangent rows")
  assert_deterministic(grads, x, r, w, g, runs=3)
  y, total = full["y_fused"], full["sum"]
  h64 = np.asarray(total, np.float64)
  want = h64 / np.sqrt(np.mean(h64 * h64, -1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
  assert relative_error(y, want) < TOLERANCE[dtype] * 2
  ref = jax.grad(lambda x, r, w: _per_row_loss(
      jdet.rms_norm_reference(x.astype(jnp.float32), w, residual=r.astype(jnp.float32))[0], g)
      + _per_row_loss(x.astype(jnp.float32) + r.astype(jnp.float32), g * g),
      argnums=(0, 2))(x, r, w)
  assert relative_error(grads(x, r, w, g)[0], ref[0]) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
  assert relative_error(dw_full, ref[1]) < (1e-2 if dtype == jnp.bfloat16 else 1e-4)
