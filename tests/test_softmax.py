"""jdet.softmax / log_softmax / logsumexp: row invariance, accuracy, gradients,
-inf / NaN rows, axes, errors.

On CPU the tile rule's interpret branch reads rows in 128-wide sub-chunks, so a
300-column row takes the loop, the peeled last sub-chunk and its column mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.testing import assert_batch_invariant, assert_bitwise_equal, random_normal, relative_error
from jax.experimental import pallas as pl
from pallas_kernels import softmax as kernels
from pallas_kernels._common import pairwise_row_sum

OPS = {"softmax": jdet.softmax, "log_softmax": jdet.log_softmax, "logsumexp": jdet.logsumexp}
REFERENCES = {"softmax": jdet.softmax_reference, "log_softmax": jdet.log_softmax_reference,
              "logsumexp": jdet.logsumexp_reference}
JAX_NN = {"softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax,
          "logsumexp": functools.partial(jax.nn.logsumexp, axis=-1)}
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}
ROWS, LENGTH = 24, 300


def _normal(rng, shape, dtype=jnp.float32, scale=3.0):
  return (random_normal(rng, shape) * scale).astype(dtype)


def _everything(x, g, gl):
  """All three ops and their input gradients for cotangents g (gl for logsumexp)."""
  outs, grads = [], []
  for fn, cotangent in zip(OPS.values(), (g, g, gl)):
    out, vjp = jax.vjp(fn, x)
    outs.append(out)
    grads.append(vjp(cotangent.astype(out.dtype))[0])
  return tuple(outs) + tuple(grads)


everything = jax.jit(_everything)
forward_all = jax.jit(lambda x: tuple(fn(x) for fn in OPS.values()))


@pytest.fixture(scope="module")
def data():
  rng = np.random.default_rng(0)
  x = _normal(rng, (ROWS, LENGTH)).at[3, 7:200].set(-jnp.inf)
  return x, _normal(rng, (ROWS, LENGTH), scale=1.0), _normal(rng, (ROWS,), scale=1.0)


def test_tile_rule_depends_on_row_length_only():
  assert kernels.softmax_tiles(LENGTH, interpret=True).block_cols == 128  # 3 sub-chunks
  for length in (1, 7, 100, 1000, 2048, 8192, 8193, 32000, 128256, 151936, 262144):
    tiles = kernels.softmax_tiles(length, interpret=False)
    assert tiles.block_rows * tiles.block_cols >= kernels.GPU_MIN_BLOCK or length > 8192
    assert tiles.block_cols >= min(length, kernels.GPU_ONE_BLOCK) or length > 8192
    chunk = kernels.token_chunk_cols(length, interpret=False)
    assert chunk % tiles.block_cols == 0
  assert kernels.token_chunk_cols(151936, interpret=False) == 8192
  for length, interpret in ((LENGTH, True), (296, True), (50257, False), (151936, False)):
    assert kernels.softmax_tiles(length, interpret=interpret).pairwise_sums == (length % 8 != 0)


def _float32_tree(values):
  """Far-halves-first pairwise sum in NumPy float32, level by level."""
  values = np.asarray(values, np.float32)
  while values.shape[-1] > 1:
    half = values.shape[-1] // 2
    values = values[..., :half] + values[..., half:]
  return values


def test_pairwise_row_sum_is_the_fixed_tree():
  """Bit for bit the far-halves-first tree (not a tolerance: the order is the
  contract), in a kernel and under XLA alike; wrong widths raise."""
  x = _normal(np.random.default_rng(1), (16, 64))
  want = _float32_tree(x)
  assert_bitwise_equal(jax.jit(functools.partial(pairwise_row_sum, native=False))(x), want,
                       what="jitted")

  def kernel(x_ref, o_ref):
    o_ref[...] = pairwise_row_sum(x_ref[...], native=False)

  in_kernel = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 1), jnp.float32),
                             interpret=True)(x)
  assert_bitwise_equal(in_kernel, want, what="interpreted kernel")
  sequential = functools.reduce(np.add, np.asarray(x, np.float32).T)[:, None]
  assert not np.array_equal(want, sequential), "the data must tell the orders apart"
  with pytest.raises(ValueError, match="power-of-two"):
    pairwise_row_sum(x[:, :48], native=False)


def test_forward_and_grads_batch_invariant(data):
  """Slices, single rows, padding and vmap give every row the same bits, forward and
  backward (the harness jits each call)."""
  x, g, gl = data
  assert_batch_invariant(_everything, x, g, gl, batch_sizes=(1,), single_rows=(0, 3, 23),
                         pad=3, vmap_splits=(2,))


def test_deterministic(data):
  x, g, gl = data
  first = everything(x, g, gl)
  for _ in range(3):
    assert_bitwise_equal(everything(x, g, gl), first, what="rerun")


@pytest.mark.parametrize("dtype,length", [(jnp.float32, LENGTH), (jnp.float32, 1),
                                          (jnp.float32, 296), (jnp.bfloat16, LENGTH),
                                          (jnp.float16, LENGTH)])
def test_accuracy_vs_float64_and_dtype(dtype, length):
  rng = np.random.default_rng(length)
  x = _normal(rng, (ROWS, length), dtype)
  x64 = np.asarray(x, np.float64)
  top = x64.max(-1, keepdims=True)
  lse = top + np.log(np.exp(x64 - top).sum(-1, keepdims=True))
  want = {"softmax": np.exp(x64 - lse), "log_softmax": x64 - lse, "logsumexp": lse[:, 0]}
  for name, out in zip(OPS, forward_all(x)):
    assert out.dtype == JAX_NN[name](x).dtype == dtype
    assert relative_error(out, want[name]) < TOLERANCE[dtype], (name, dtype, length)


def test_grads_match_reference(data):
  x, g, gl = data
  x = jnp.where(jnp.isfinite(x), x, -50.0)  # jax.grad of the reference is NaN-free here too
  got = everything(x, g, gl)[3:]
  for (name, ref), cot, dx in zip(REFERENCES.items(), (g, g, gl), got):
    want = jax.grad(lambda x: jnp.sum(ref(x) * cot))(x)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want), rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_inf_and_nan_rows_match_jax_nn_and_stay_in_their_row(data):
  x, g, gl = data
  x = x.at[0].set(-jnp.inf).at[1, 5].set(jnp.nan).at[2, 250].set(jnp.inf)
  clean = everything(data[0], g, gl)
  got = everything(x, g, gl)
  for out, ref_fn in zip(got[:3], JAX_NN.values()):
    want = np.asarray(ref_fn(x))
    out = np.asarray(out)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isinf(out), np.isinf(want))
    np.testing.assert_allclose(out[finite], want[finite], rtol=1e-5, atol=1e-6)
  for out in got[3:]:
    assert np.isnan(np.asarray(out[:2])).all()  # all -inf and NaN rows: NaN, as jax.grad
  # Rows 3.. are bitwise those of the batch without the bad rows.
  assert_bitwise_equal(tuple(v[3:] for v in got), tuple(v[3:] for v in clean),
                       what="rows next to -inf/NaN/+inf rows")


def test_all_neg_inf_row_exact_values():
  x = jnp.full((ROWS, LENGTH), -jnp.inf).at[1, :3].set(jnp.array([0.0, 1.0, -jnp.inf]))
  x = x.at[2, 200].set(jnp.inf).at[2, 0].set(1.0)
  for name, got in zip(OPS, forward_all(x)):
    got, want = np.asarray(got), np.asarray(JAX_NN[name](x))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-6)
  lse = forward_all(x)[2]
  assert float(lse[0]) == -np.inf and float(lse[2]) == np.inf


@pytest.mark.parametrize("shape,axis", [((5, 3, 5), 0), ((3, 5, 5), -2)])
def test_axes_and_keepdims(shape, axis):
  rng = np.random.default_rng(7)
  x = _normal(rng, shape)
  for name, fn in OPS.items():
    got = fn(x, axis=axis)
    want = REFERENCES[name](x, axis=axis)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    moved = fn(jnp.moveaxis(x, axis, -1))
    if name == "logsumexp":
      assert_bitwise_equal(got, moved, what=f"{name} axis {axis}")
      kept = jdet.logsumexp(x, axis=axis, keepdims=True)
      assert kept.shape == jax.nn.logsumexp(x, axis=axis, keepdims=True).shape
    else:
      assert_bitwise_equal(got, jnp.moveaxis(moved, -1, axis), what=f"{name} axis {axis}")


def test_empty_rows():
  x = jnp.zeros((0, 5), jnp.bfloat16)
  assert jdet.softmax(x).shape == (0, 5) and jdet.logsumexp(x).shape == (0,)
  assert jdet.log_softmax(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("x,kwargs,error,match", [
    (np.float32(1.0), {}, ValueError, "rank >= 1"),
    (np.ones((2, 0), np.float32), {}, ValueError, "length >= 1"),
    (np.ones((2, 3), np.int32), {}, TypeError, "x must be"),
    (np.ones((2, 3), np.float64), {}, TypeError, "float64"),
    (np.ones((2, 3), np.float32), {"axis": 2}, ValueError, "out of range"),
    (np.ones((2, 3), np.float32), {"axis": (0, 1)}, TypeError, "axis must be an int"),
    (np.ones((2, 3), np.float32), {"axis": 1.0}, TypeError, "axis must be an int"),
    ("x", {}, TypeError, "x must be an array"),
])
def test_bad_input_raises(x, kwargs, error, match):
  for fn in OPS.values():
    with pytest.raises(error, match=match):
      fn(x, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [5, 1000, 8192, 8193, 50257, 128256, 151936, 262144])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_rows_alone_equal_the_batch(length, dtype):
  """Realistic row lengths: rows 1..300 in batches of several sizes vs alone, forward
  and backward, every op."""
  rng = np.random.default_rng(length)
  x = _normal(rng, (300, length), dtype)
  g = _normal(rng, (300, length), jnp.float32, scale=1.0)
  gl = _normal(rng, (300,), scale=1.0)
  full = everything(x, g, gl)
  for m in (1, 17, 64, 129, 255):
    assert_bitwise_equal(everything(x[:m], g[:m], gl[:m]), tuple(v[:m] for v in full),
                         what=f"L={length}, first {m} rows")
  for i in (0, 150, 299):
    assert_bitwise_equal(everything(x[i:i + 1], g[i:i + 1], gl[i:i + 1]),
                         tuple(v[i:i + 1] for v in full), what=f"L={length}, row {i} alone")
  want = REFERENCES["log_softmax"](x)
  assert relative_error(full[1], want) < TOLERANCE[dtype] * 4
