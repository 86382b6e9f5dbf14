"""jdet.matmul(..., backend="triton") and jdet.interop.torch_matmul.

On CPU: the errors (no jax-triton, no torch, no GPU, unknown backend). On an
NVIDIA GPU with jax-triton installed (``gpu`` marker): the Triton GEMM is
batch-invariant forward and backward, under jit, vmap and grad, and gives the
same bits as the Pallas backend; the PyTorch launch gives the same bits as the
JAX launch.
"""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet import interop
from jdet.bench import on_gpu
from jdet.testing import assert_batch_invariant, assert_bitwise_equal, random_normal
from pallas_kernels import jax_triton_matmul as triton_backend
from pallas_kernels import matmul as kernels
from pallas_kernels import matmul_plan
from pallas_kernels.matmul import Layout


def test_unknown_backend_raises():
  with pytest.raises(ValueError, match="backend must be one of"):
    jdet.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), backend="cublas")


def test_triton_backend_without_jax_triton_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax_triton", None)
  with pytest.raises(ImportError, match=r"pip install 'jdet\[triton\]'"):
    jdet.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), backend="triton")


@pytest.mark.skipif(on_gpu(), reason="checks the error raised without a GPU")
def test_triton_backend_on_cpu_raises(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax_triton", types.ModuleType("jax_triton"))
  monkeypatch.setitem(sys.modules, "pallas_kernels.triton_matmul",
                      types.ModuleType("pallas_kernels.triton_matmul"))
  with pytest.raises(ValueError, match="only on an NVIDIA GPU"):
    jdet.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), backend="triton")
  with pytest.raises(ValueError, match="no interpret mode"):
    jdet.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), backend="triton",
                interpret=True)


def test_torch_matmul_without_torch_says_what_it_needs(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(ImportError, match="needs PyTorch"):
    interop.torch_matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))


@pytest.fixture
def host_triton(monkeypatch):
  """jax_triton and the Triton kernels replaced by an exact host matmul that, like
  ``triton_call``, refuses to be batched: only the launchers' vmap rules can run it."""

  def triton_call(*arrays, kernel, out_shape, grid, num_warps, num_stages, name, **params):
    def host(x, y):
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      if kernel == "at_b":
        x = x.swapaxes(1, 2)
      elif params["TRANSPOSE_B"]:
        y = y.swapaxes(1, 2)
      return (x @ y).astype(out_shape.dtype)
    return jax.pure_callback(host, out_shape, *arrays)

  kernels_module = types.SimpleNamespace(
      matmul_kernel="matmul", at_b_kernel="at_b", matmul_at_b_kernel="at_b",
      matmul_launch=lambda *shape, transpose_b, **_: ((1,), {"TRANSPOSE_B": transpose_b}),
      matmul_at_b_launch=lambda *shape, **_: ((1,), {}))
  monkeypatch.setattr(triton_backend, "load",
                      lambda: (types.SimpleNamespace(triton_call=triton_call), kernels_module))
  triton_backend._matmul_launcher.cache_clear()
  triton_backend._at_b_launcher.cache_clear()
  yield
  triton_backend._matmul_launcher.cache_clear()
  triton_backend._at_b_launcher.cache_clear()


def test_triton_launchers_refuse_deep_steps():
  """The Triton kernel loads 64-deep steps only: a tile with ``step_k`` (the Pallas
  Triton kernel's) is refused before anything is loaded or launched."""
  deep = kernels.MatmulTiles(16, 16, 4, 10, step_k=256)
  a = np.ones((1, 16, 512), np.float32)
  with pytest.raises(ValueError, match="takes step_k = 64 tiles"):
    triton_backend.matmul(a, a.swapaxes(1, 2), transpose_b=False, out_dtype=jnp.float32,
                          precision=None, tiles=deep)
  with pytest.raises(ValueError, match="takes step_k = 64 tiles"):
    triton_backend.matmul_at_b(a, a, out_dtype=jnp.float32, precision=None, tiles=deep)


@pytest.mark.parametrize("transpose_b", [False, True])
def test_triton_launcher_vmap_rules_keep_every_entry(host_triton, transpose_b):
  """Every way of mapping (a, b) folds into groups or rows and gives each entry the
  unbatched result (integer-valued data: the host matmul is exact)."""
  rng = np.random.default_rng(15)
  ints = lambda *shape: jnp.asarray(rng.integers(-4, 5, shape), jnp.float32)  # noqa: E731
  tiles = kernels.MatmulTiles(16, 16, 4, 1)
  launch = functools.partial(triton_backend.matmul, transpose_b=transpose_b,
                             out_dtype=jnp.float32, precision=None, tiles=tiles)
  a = ints(3, 2, 5, 64)
  b_shape = (8, 64) if transpose_b else (64, 8)
  for b in (ints(3, 1, *b_shape), ints(3, 2, *b_shape)):
    for in_axes in ((0, 0), (0, None), (None, 0)):
      got = jax.jit(jax.vmap(launch, in_axes=in_axes))(a if in_axes[0] == 0 else a[0],
                                                       b if in_axes[1] == 0 else b[0])
      for i in range(3):
        want = launch(a[i] if in_axes[0] == 0 else a[0], b[i] if in_axes[1] == 0 else b[0])
        assert_bitwise_equal(got[i], want, what=f"in_axes={in_axes}, Gb={b.shape[1]}, {i}")
  x, d = a.swapaxes(2, 3), ints(3, 2, 64, 8)
  at_b = functools.partial(triton_backend.matmul_at_b, out_dtype=jnp.float32, precision=None,
                           tiles=tiles)
  for in_axes in ((0, 0), (0, None), (None, 0)):
    got = jax.vmap(at_b, in_axes=in_axes)(x if in_axes[0] == 0 else x[0],
                                          d if in_axes[1] == 0 else d[0])
    for i in range(3):
      want = at_b(x[i] if in_axes[0] == 0 else x[0], d[i] if in_axes[1] == 0 else d[0])
      assert_bitwise_equal(got[i], want, what=f"dB in_axes={in_axes}, entry {i}")


triton_mm = jax.jit(functools.partial(jdet.matmul, backend="triton"))
pallas_mm = jax.jit(jdet.matmul)


def _grads(backend, argnums=(0, 1)):
  def loss(a, b, g):
    return jnp.sum(jdet.matmul(a, b, backend=backend).astype(jnp.float32) * g)
  return jax.jit(jax.grad(loss, argnums=argnums))


@pytest.fixture(scope="module")
def jax_triton():
  return pytest.importorskip("jax_triton")


@pytest.mark.gpu
@pytest.mark.long
@pytest.mark.parametrize("k,n", [(4096, 4096), (1000, 3000)])
def test_gpu_triton_rows_invariant_and_equal_to_pallas(jax_triton, k, n):
  """Forward and dA rows across every dispatch boundary up to M = 2100; dB with
  zero-cotangent rows (its tiles never see the row count: a few counts, partial
  64-row steps among them); every result bitwise equal to the Pallas backend's."""
  rng = np.random.default_rng(11)
  total = 2100
  a, b, g = (random_normal(rng, shape, jnp.bfloat16) for shape in ((total, k), (k, n), (total, n)))
  reference = np.asarray(triton_mm(a, b))
  assert_bitwise_equal(reference, pallas_mm(a, b), what="triton vs pallas forward")
  triton_grads, pallas_grads = _grads("triton"), _grads("pallas")
  da_reference, db_reference = triton_grads(a, b, g)
  da_pallas, db_pallas = pallas_grads(a, b, g)
  assert_bitwise_equal(da_reference, da_pallas, what="triton vs pallas dA")
  assert_bitwise_equal(db_reference, db_pallas, what="triton vs pallas dB")
  plan = lambda m, cols, contraction: matmul_plan.plan(  # noqa: E731
      Layout.NN, m, cols, contraction, dtype=jnp.bfloat16, out_dtype=jnp.bfloat16,
      backend="triton")
  changes = [m for m in range(2, total + 1) for cols, contraction in ((n, k), (k, n))
             if plan(m, cols, contraction) != plan(m - 1, cols, contraction)]
  triton_da = _grads("triton", argnums=0)
  for m in sorted({1, 2, 3, 7, 100, total} | {c for m in changes for c in (m - 1, m)}):
    assert_bitwise_equal(triton_mm(a[:m], b), reference[:m], what=f"forward M={m}")
    assert_bitwise_equal(triton_da(a[:m], b, g[:m]), da_reference[:m], what=f"dA M={m}")
  for m in (1, 7, 100, total - 1):
    padded_g = g.at[m:].set(0)
    assert_bitwise_equal(triton_grads(a, b, padded_g)[1], triton_grads(a[:m], b, g[:m])[1],
                         what=f"dB, {total - m} zero rows")


@pytest.mark.gpu
def test_gpu_triton_under_vmap_and_harness(jax_triton):
  """custom_vmap folds mapped axes into groups or rows without changing a bit."""
  rng = np.random.default_rng(12)
  a3, b, b3, g3 = (random_normal(rng, shape, jnp.bfloat16)
                   for shape in ((3, 33, 96), (96, 80), (3, 96, 80), (3, 33, 80)))
  shared = jax.jit(jax.vmap(triton_mm, in_axes=(0, None)))(a3, b)
  batched = jax.jit(jax.vmap(triton_mm))(a3, b3)
  grouped_shared = jax.jit(jax.vmap(triton_mm, in_axes=(None, 0)))(a3, b3)
  per_example = jax.jit(jax.vmap(_grads("triton")))(a3, b3, g3)
  pallas_grads = _grads("pallas")
  for i in range(3):
    assert_bitwise_equal(shared[i], pallas_mm(a3[i], b), what=f"vmap shared b, entry {i}")
    assert_bitwise_equal(batched[i], pallas_mm(a3[i], b3[i]), what=f"vmap batched, entry {i}")
    assert_bitwise_equal(grouped_shared[i], pallas_mm(a3, b3[i]), what=f"vmap over b, {i}")
    for got, want in zip(per_example, pallas_grads(a3[i], b3[i], g3[i])):
      assert_bitwise_equal(got[i], want, what=f"per-example gradient, entry {i}")
  assert_batch_invariant(triton_mm, a3[0], b, in_axes=(0, None), batch_sizes=(1, 2, 7, 33))


@pytest.mark.gpu
def test_gpu_triton_db_every_ladder_tile_equals_pallas(jax_triton):
  """dB (Aᵀ @ D) picks any ladder tile for its [K, N] result: on each, the
  Triton kernel gives the Pallas kernel's bits, over a partial last 64-row step
  and partial edge tiles."""
  rng = np.random.default_rng(14)
  a, d = random_normal(rng, (1, 201, 150), jnp.bfloat16), random_normal(rng, (1, 201, 300),
                                                                        jnp.bfloat16)
  for tiles in kernels.GPU_MATMUL_LADDER:
    tiles = kernels.fit_stages(tiles, jnp.bfloat16, jnp.float32)
    got = triton_backend.matmul_at_b(a, d, out_dtype=jnp.float32, precision=None, tiles=tiles)
    want = kernels.matmul_at_b(a, d, out_dtype=jnp.float32, precision=None, tiles=tiles,
                               interpret=False)
    assert_bitwise_equal(got, want, what=f"dB on {tiles}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [None, jax.lax.Precision.HIGHEST])
def test_gpu_triton_float32_equals_pallas(jax_triton, precision):
  rng = np.random.default_rng(13)
  a, b = random_normal(rng, (300, 200), jnp.float32), random_normal(rng, (200, 130), jnp.float32)
  assert_bitwise_equal(jdet.matmul(a, b, precision=precision, backend="triton"),
                       jdet.matmul(a, b, precision=precision), what=f"float32, {precision}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 300, 2100])
def test_gpu_torch_launch_equals_jax_launch(jax_triton, m, monkeypatch, tmp_path):
  torch = pytest.importorskip("torch")
  # Importing jax_triton sets TRITON_CACHE_DIR to "", which Triton's own launcher rejects.
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
  rng = np.random.default_rng(14)
  a, b = (random_normal(rng, shape, jnp.bfloat16) for shape in ((2100, 4096), (4096, 1000)))
  to_torch = lambda x: torch.from_dlpack(x)  # noqa: E731 (shares the buffer, exact)
  got = interop.torch_matmul(to_torch(a[:m]), to_torch(b))
  want = triton_mm(a[:m], b)
  assert got.dtype == torch.bfloat16 and tuple(got.shape) == (m, 1000)
  assert_bitwise_equal(np.asarray(jnp.from_dlpack(got)), want, what=f"torch vs jax, M={m}")
  alone = interop.torch_matmul(to_torch(a[m - 1:m]), to_torch(b))
  assert torch.equal(alone[0], got[m - 1]), "torch launch: last row alone vs in the batch"


@pytest.mark.gpu
def test_gpu_torch_matmul_bad_input():
  torch = pytest.importorskip("torch")
  a = torch.ones((4, 8), device="cuda")
  with pytest.raises(ValueError, match="K = 8"):
    interop.torch_matmul(a, torch.ones((7, 2), device="cuda"))
  with pytest.raises(ValueError, match="CUDA device"):
    interop.torch_matmul(a.cpu(), torch.ones((8, 2)))
  with pytest.raises(TypeError, match="float16 or float32"):
    interop.torch_matmul(a.to(torch.int32), torch.ones((8, 2), device="cuda"))
