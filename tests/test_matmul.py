"""jdet.matmul: row invariance, determinism, backward, accuracy, errors.

The same tests run in Pallas interpret mode on CPU and natively on a GPU; the
invariance tests run once per backend available here (the ``matmul_backend``
fixture: Pallas everywhere, jax-triton on an NVIDIA GPU with jax-triton); the
``gpu``-marked sweeps cover every kernel and tile config the plan can
choose (Triton tiles, and the Mosaic GPU kernel on an H100).
"""

import dataclasses
import functools
import importlib.util
import itertools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import jdet
from jdet.testing import (assert_batch_invariant, assert_bitwise_equal, assert_deterministic,
                          cuda_lowering_available, random_normal, relative_error)
from pallas_kernels import hopper_matmul as hopper
from pallas_kernels import matmul as kernels
from pallas_kernels import matmul_plan
from pallas_kernels.matmul import Layout
from pallas_kernels.matmul_plan import Kernel
from jdet.bench import on_gpu

K, N = 96, 80  # not multiples of the tiles: edge masks and the partial K step are exercised
M_SWEEP = (1, 2, 3, 7, 16, 17, 100, 129, 200, 270)  # 200 > two 64-row tiles; 270: nine
# CPU row tiles, on a grid of ten (the row tiles are bucketed: the tenth return at once)

# Documented accuracy (relative max error vs float64, ||.||_inf / max|ref|).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
GPU_TF32_TOLERANCE = 2e-3


def _loss(backend):
  """sum(a @ b * g) through the backend's jdet.matmul."""
  matmul = functools.partial(jdet.matmul, backend=backend)
  return lambda a, b, g: jnp.sum(matmul(a, b).astype(jnp.float32) * g)


@functools.cache
def _jitted(backend):
  """(forward, (dA, dB) of sum(a @ b * g)), jitted once per backend."""
  return (jax.jit(functools.partial(jdet.matmul, backend=backend)),
          jax.jit(jax.grad(_loss(backend), (0, 1))))


@functools.cache
def _jitted_da(backend):
  """dA of sum(a @ b * g) alone: jit drops the dB kernel, which a test of dA's rows
  would otherwise compile for every row count."""
  return jax.jit(jax.grad(_loss(backend)))


mm, mm_grads = _jitted("pallas")
mm_da = _jitted_da("pallas")


@pytest.fixture(scope="module")
def operands():
  rng = np.random.default_rng(1)
  return tuple(random_normal(rng, shape, jnp.bfloat16)
               for shape in ((max(M_SWEEP), K), (K, N), (max(M_SWEEP), N)))


def test_rows_equal_single_row_calls(operands, matmul_backend):
  mm = _jitted(matmul_backend)[0]
  a, b, _ = operands
  singles = np.concatenate([np.asarray(mm(a[i:i + 1], b)) for i in range(max(M_SWEEP))])
  for m in M_SWEEP:
    assert_bitwise_equal(mm(a[:m], b), singles[:m], what=f"M={m} vs single rows")


def test_harness_slices_padding_and_vmap(operands, matmul_backend):
  mm = _jitted(matmul_backend)[0]
  a, b, _ = operands
  assert_batch_invariant(mm, a[:129], b, in_axes=(0, None), batch_sizes=M_SWEEP,
                         vmap_splits=(3,))


def test_chunked_prefill_equals_whole(operands, matmul_backend):
  mm = _jitted(matmul_backend)[0]
  a, b, _ = operands
  whole = mm(a, b)
  chunks = [mm(a[s:s + c], b) for s, c in ((0, 5), (5, 64), (69, 1), (70, a.shape[0] - 70))]
  assert_bitwise_equal(jnp.concatenate(chunks), whole, what="chunked prefill")


@pytest.mark.parametrize("vmapped_batch", [1, 3, 4])
def test_vmap_shared_and_batched_b(operands, vmapped_batch):
  a, b, _ = operands
  rng = np.random.default_rng(vmapped_batch)
  a3 = random_normal(rng, (vmapped_batch, 33, K), jnp.bfloat16)
  b3 = random_normal(rng, (vmapped_batch, K, N), jnp.bfloat16)
  shared = jax.jit(jax.vmap(jdet.matmul, in_axes=(0, None)))(a3, b)
  batched = jax.jit(jax.vmap(jdet.matmul))(a3, b3)
  leading = mm(a3, b3)
  for i in range(vmapped_batch):
    assert_bitwise_equal(shared[i], mm(a3[i], b), what=f"vmap shared b, entry {i}")
    assert_bitwise_equal(batched[i], mm(a3[i], b3[i]), what=f"vmap batched b, entry {i}")
    assert_bitwise_equal(leading[i], batched[i], what=f"leading dims vs vmap, entry {i}")
    assert_bitwise_equal(mm(a3[i, 4:9], b3[i]), batched[i, 4:9], what="row slice of batch")


def test_deterministic_forward_and_backward(operands, matmul_backend):
  mm, mm_grads = _jitted(matmul_backend)
  a, b, g = operands
  assert_deterministic(mm, a, b, runs=10)
  assert_deterministic(mm_grads, a, b, g, runs=10)


def test_da_rows_invariant(operands, matmul_backend):
  da_only = _jitted_da(matmul_backend)
  a, b, g = operands
  da_full = _jitted(matmul_backend)[1](a, b, g)[0]
  for m in (1, 3, 17, 129):
    da = da_only(a[:m], b, g[:m])
    assert_bitwise_equal(da, da_full[:m], what=f"dA rows, M={m}")


def test_db_unchanged_by_zero_cotangent_rows(operands, matmul_backend):
  mm_grads = _jitted(matmul_backend)[1]
  a, b, g = operands
  for m in (1, 17, 64, 100):
    _, db = mm_grads(a[:m], b, g[:m])
    padded_g = jnp.concatenate([g[:m], jnp.zeros_like(g[m:])])
    _, db_padded = mm_grads(a, b, padded_g)
    assert_bitwise_equal(db_padded, db, what=f"dB with {a.shape[0] - m} zero-cotangent rows")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_accuracy_vs_float64(dtype):
  rng = np.random.default_rng(2)
  a, b = random_normal(rng, (2, 37, 200), dtype), random_normal(rng, (200, 70), dtype)
  for precision in (None, jax.lax.Precision.HIGHEST):
    out = jdet.matmul(a, b, precision=precision)
    assert out.dtype == dtype and out.shape == (2, 37, 70)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    err = relative_error(out, ref)
    tol = TOLERANCE[dtype]
    if dtype == jnp.float32 and precision is None and on_gpu():
      tol = GPU_TF32_TOLERANCE
    assert err < tol, (dtype, precision, err)


def test_preferred_element_type_and_mixed_dtypes():
  rng = np.random.default_rng(3)
  a, b = random_normal(rng, (5, 64), jnp.bfloat16), random_normal(rng, (64, 16), jnp.float32)
  out = jdet.matmul(a, b)
  assert out.dtype == jnp.float32
  out16 = jdet.matmul(a, b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
  assert out16.dtype == jnp.float32
  ref = np.asarray(a, np.float64) @ np.asarray(b.astype(jnp.bfloat16), np.float64)
  assert np.abs(np.asarray(out16) - ref).max() < 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("a_shape,b_shape", [
    ((37, 48), (48, 24)),
    ((2, 3, 5, 48), (48, 24)),
    ((3, 5, 48), (3, 48, 24)),
    ((1, 4, 5, 48), (3, 1, 48, 24)),
    ((5, 48), (2, 48, 24)),
])
def test_gradients_match_jnp_reference(a_shape, b_shape):
  rng = np.random.default_rng(4)
  a, b = random_normal(rng, a_shape), random_normal(rng, b_shape)
  out_shape = jnp.matmul(a, b).shape
  g = random_normal(rng, out_shape)
  hi = jax.lax.Precision.HIGHEST

  def loss(fn, a, b):
    return jnp.sum(fn(a, b, precision=hi) * g) + jnp.mean(fn(a, b, precision=hi))

  got = jax.jit(jax.grad(functools.partial(loss, jdet.matmul), argnums=(0, 1)))(a, b)
  want = jax.grad(functools.partial(loss, jdet.matmul_reference), argnums=(0, 1))(a, b)
  assert jdet.matmul(a, b).shape == out_shape
  for x, y in zip(got, want):
    assert x.shape == y.shape
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)


def test_empty_and_tiny_shapes():
  a = jnp.zeros((0, 10), jnp.float32)
  b = jnp.ones((10, 3), jnp.float32)
  out = jdet.matmul(a, b)
  assert out.shape == (0, 3) and out.dtype == jnp.float32
  one = jdet.matmul(jnp.full((1, 1), 2.0), jnp.full((1, 1), 3.0))
  assert float(one[0, 0]) == 6.0


def test_k_zero_padding_does_not_change_rows(operands):
  a, b, _ = operands
  padded = mm(jnp.pad(a, ((0, 0), (0, 32))), jnp.pad(b, ((0, 32), (0, 0))))
  assert_bitwise_equal(padded, mm(a, b), what="K zero-padded by 32")


@pytest.mark.parametrize("a,b,error,match", [
    (np.ones((3,), np.float32), np.ones((3, 2), np.float32), ValueError, "a must have shape"),
    (np.ones((2, 3), np.float32), np.ones((3,), np.float32), ValueError, "b must have shape"),
    (np.ones((2, 3), np.float32), np.ones((4, 2), np.float32), ValueError, "K = 3"),
    (np.ones((2, 2, 3), np.float32), np.ones((3, 3, 2), np.float32), ValueError, "broadcast"),
    (np.ones((2, 3), np.int32), np.ones((3, 2), np.float32), TypeError, "a must be"),
    (np.ones((2, 3), np.float32), np.ones((3, 2), np.complex64), TypeError, "b must be"),
    (np.ones((2, 3), np.float64), np.ones((3, 2), np.float32), TypeError, "float64"),
    ("x", np.ones((3, 2), np.float32), TypeError, "a must be an array"),
])
def test_bad_input_raises(a, b, error, match):
  with pytest.raises(error, match=match):
    jdet.matmul(a, b)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"preferred_element_type": jnp.int32}, TypeError, "preferred_element_type"),
    ({"preferred_element_type": "foo"}, TypeError, "preferred_element_type"),
    ({"preferred_element_type": 0}, TypeError, "preferred_element_type"),
    ({"precision": "ultra"}, ValueError, "precision must be"),
    ({"precision": ("highest", "default")}, ValueError, "precision must name one precision"),
    ({"precision": jax.lax.DotAlgorithmPreset.F32_F32_F32}, ValueError, "precision must be"),
    ({"precision": 3}, ValueError, "precision must be"),
    ({"interpret": "no"}, TypeError, "interpret must be"),
    ({"backend": "cuda"}, ValueError, "backend must be"),
])
def test_bad_options_raise(kwargs, error, match):
  with pytest.raises(error, match=match):
    jdet.matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), **kwargs)


def test_precision_and_dtype_spellings():
  """What jnp.dot takes for one precision, plus the member names, and dtype names."""
  a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
  want = jdet.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
  for spelling in ("HIGHEST", "highest", "float32", ("highest", "HIGHEST")):
    assert_bitwise_equal(jdet.matmul(a, b, precision=spelling), want, what=repr(spelling))
  assert jdet.matmul(a, b, preferred_element_type="bfloat16").dtype == jnp.bfloat16


GPU_SWEEP_ROWS = 16411  # odd, past the largest benchmark M


H100 = matmul_plan.Device("gpu", "9.0", 132)
bf16 = jnp.dtype(jnp.bfloat16)


def _plan(layout, rows, cols, contraction, dtype=bf16, **options):
  return matmul_plan.plan(layout, rows, cols, contraction, dtype=dtype,
                          out_dtype=options.pop("out_dtype", dtype),
                          device=options.pop("device", H100), **options)


DEFAULT_STRIPS = hopper.HopperTiles()  # the tiles' own order: strips of row tiles


def _in_row_strips(plan):
  """``plan`` with a Mosaic GPU tile's strip order set back to the tiles' own
  (``matmul_plan.mosaic_strips`` may change it; the order changes no sum)."""
  if plan.kernel is not Kernel.MOSAIC_GPU:
    return plan
  return dataclasses.replace(plan, tiles=dataclasses.replace(
      plan.tiles, strip_dim=DEFAULT_STRIPS.strip_dim, strip_width=DEFAULT_STRIPS.strip_width))


def test_plan_interpret_and_backend_choices():
  """Interpret mode: one tile for every GEMM; backend="triton": jax-triton with the
  tiles Pallas Triton would use, in BLOCK_K steps and at the ladder tile's warps
  (it plans without the contraction, so without the deep steps and warps of rows of
  odd length); float32 and grouped GEMMs: Pallas Triton."""
  for layout in Layout:
    for rows, cols, contraction in ((1, 1, 1), (300, 4096, 3000), (16411, 32000, 4096)):
      assert _plan(layout, rows, cols, contraction, interpret=True) == matmul_plan.Plan(
          Kernel.PALLAS_TRITON, kernels.INTERPRET_TILES, interpret=True)
      f32 = _plan(layout, rows, cols, contraction, jnp.dtype(jnp.float32))
      assert f32.kernel is Kernel.PALLAS_TRITON
      assert f32.kernel is _plan(layout, rows, cols, contraction, groups=2).kernel
      on_a100 = _plan(layout, rows, cols, contraction, device=matmul_plan.Device("gpu", "8.0"))
      jax_triton = _plan(layout, rows, cols, contraction, backend="triton")
      assert on_a100.kernel is Kernel.PALLAS_TRITON and jax_triton.kernel is Kernel.JAX_TRITON
      assert jax_triton.tiles == dataclasses.replace(
          on_a100.tiles, step_k=kernels.BLOCK_K, num_warps=_ladder_tile(on_a100.tiles).num_warps)
  with pytest.raises(ValueError, match="backend must be one of"):
    _plan(Layout.NN, 1, 1, 1, backend="cublas")


def _contraction_walk(k: int, **options):
  """The steps ``kernels.contraction_loop`` takes over ``k`` indices: per index,
  the sum of ``10 * width + masked`` over the steps that cover it (0: none), and
  without ``chunk`` the (start, width, masked) of each step in order (a chunk's
  sum starts from ``zeros_like`` of one array, so there the order is not kept)."""
  size = kernels.cdiv(k, 256) * 256 + 256
  def step(ks, k_mask, acc):
    covered, order, count = acc
    code = 10 * ks.size + (k_mask is not None)
    covered = covered + lax.dynamic_update_slice(
        jnp.zeros_like(covered), jnp.full((ks.size,), code, jnp.int32), (ks.start,))
    order = order.at[count].set(jnp.array([ks.start, ks.size, k_mask is not None]))
    return covered, order, count + 1
  if "chunk" in options:
    def chunk_step(ks, k_mask, covered):
      return step(ks, k_mask, (covered, jnp.zeros((64, 3), jnp.int32), 0))[0]
    return np.asarray(jax.jit(lambda: kernels.contraction_loop(
        k, chunk_step, jnp.zeros(size, jnp.int32), **options))()), None
  covered, order, count = jax.jit(lambda: kernels.contraction_loop(
      k, step, (jnp.zeros(size, jnp.int32), jnp.zeros((64, 3), jnp.int32), 0), **options))()
  return np.asarray(covered), [tuple(map(int, row)) for row in np.asarray(order)[:int(count)]]


def test_contraction_loop_deep_steps_in_order():
  """With ``depth`` (MatmulTiles.step_k) the contraction runs in deep steps while
  whole ones remain, then in BLOCK_K steps, then the masked partial step: every
  index once, in increasing order, the partial step's zeros where they were;
  chunks run the same within each chunk. A run that holds a single deep step
  (fewer than MIN_DEEP_STEPS) takes BLOCK_K steps."""
  covered, order = _contraction_walk(1000, depth=256)
  assert order == [(0, 256, 0), (256, 256, 0), (512, 256, 0), (768, 64, 0), (832, 64, 0),
                   (896, 64, 0), (960, 64, 1)]
  assert (covered[:768] == 2560).all() and (covered[768:960] == 640).all()
  assert (covered[960:1024] == 641).all() and not covered[1024:].any()
  assert _contraction_walk(1000)[1] == [(s, 64, s == 960) for s in range(0, 1000, 64)]
  assert kernels.MIN_DEEP_STEPS == 2
  assert _contraction_walk(448, depth=256)[1] == [(s, 64, 0) for s in range(0, 448, 64)]
  covered, _ = _contraction_walk(1000, depth=256, chunk=640)
  assert (covered[:512] == 2560).all() and (covered[512:960] == 640).all()
  assert (covered[960:1024] == 641).all() and not covered[1024:].any()
  covered, _ = _contraction_walk(1000, depth=256, chunk=320)
  assert (covered[:960] == 640).all() and (covered[960:1024] == 641).all()
  with pytest.raises(ValueError, match="step_k must be a multiple of BLOCK_K"):
    kernels.MatmulTiles(16, 16, 2, 10, step_k=96)


def test_deep_steps_run_the_kernel_in_interpret_mode():
  """The Pallas Triton kernel with 256-deep steps (``MatmulTiles.step_k``), NN and
  NT, over a contraction of whole deep steps, single steps and a partial step, with
  and without chunks: every index summed once (the float64 product to float32
  accuracy; on the GPU the bits are the 64-deep steps', which the GPU envelope
  checks)."""
  rng = np.random.default_rng(256)
  lhs = random_normal(rng, (1, 5, 1000), jnp.bfloat16)
  rhs = random_normal(rng, (1, 1000, 24), jnp.bfloat16)
  want = np.asarray(lhs, np.float64)[0] @ np.asarray(rhs, np.float64)[0]
  deep = dataclasses.replace(kernels.INTERPRET_TILES, step_k=256)
  for transpose_b, operand in ((False, rhs), (True, jnp.swapaxes(rhs, 1, 2))):
    for chunk in (None, 640):
      got = kernels.matmul(lhs, operand, transpose_b=transpose_b, out_dtype=jnp.float32,
                           precision=None, tiles=deep, interpret=True, contraction_chunk=chunk)
      assert relative_error(got[0], jnp.asarray(want, jnp.float32)) < 1e-6, (transpose_b, chunk)


def test_fixed_contraction_chunk_follows_the_result_columns_alone():
  """Results narrower than CHUNKED_BELOW_COLUMN_TILES column tiles sum their
  contraction in chunks of CHUNK_PER_COLUMN_TILE indices per column tile, in
  CHUNK_GRANULE multiples, at least MIN_CHUNK; the chunk never depends on the
  contraction (only whether it is shorter), and dB (TN) has none."""
  chunk = matmul_plan.fixed_contraction_chunk
  for cols, want in ((1, 1024), (16, 1024), (512, 1024), (513, 1280), (727, 1536),
                     (1024, 2048), (2032, 4096)):
    for contraction in (want + 1, 3 * want + 17, 100_000):
      assert chunk(Layout.NN, cols, contraction) == chunk(Layout.NT, cols, contraction) == want
    assert chunk(Layout.NN, cols, want) is None, cols
  for cols in (2033, 2048, 4096, 128256):
    assert chunk(Layout.NN, cols, 100_000) is None, cols
  assert chunk(Layout.TN, 512, 100_000) is None


def test_plan_runs_chunks_on_every_kernel():
  """A chunked contraction (the fixed chunk of a narrow result, or one asked
  for) is planned on tiles whose accumulator fits twice, on the Mosaic GPU kernel
  where it takes the sizes; a single problem of at most SPLIT_CHUNK_ROWS rows over
  at least SPLIT_MIN_CHUNKS chunks runs its chunks on programs of their own, on
  any tile (of the Mosaic GPU kernel where its units fill the SMs), and so does
  one of more rows over at least MANY_ROWS_SPLIT_MIN_CHUNKS chunks whose
  in-program Mosaic GPU tiles leave the SMs half idle.
  A chunk that covers the contraction plans as no chunk; dB and chunks that are
  not whole BLOCK_K steps are refused."""
  limit = kernels.CHUNK_ACCUMULATOR_REGISTERS
  for layout in (Layout.NN, Layout.NT):
    for rows, cols, contraction, chunk, kernel, split in (
        (1, 512, 4096, None, Kernel.PALLAS_TRITON, True),
        (64, 1024, 4096, None, Kernel.PALLAS_TRITON, True),
        (256, 1024, 4096, None, Kernel.PALLAS_TRITON, True),
        (202, 1024, 4608, None, Kernel.MOSAIC_GPU, True),
        (257, 1024, 4096, None, Kernel.MOSAIC_GPU, True),  # 5 x 8 tiles in-program
        (1000, 1024, 4096, None, Kernel.MOSAIC_GPU, False),  # 16 x 8 tiles
        (64, 1024, 4088, None, Kernel.PALLAS_TRITON, True),
        (64, 1024, 3072, None, Kernel.PALLAS_TRITON, True),  # 1.5 chunks of 2048
        (64, 1024, 3064, None, Kernel.MOSAIC_GPU, False),  # stream tiles, shares of 8 rows
        (256, 1024, 3072, None, Kernel.PALLAS_TRITON, True),
        (256, 1024, 3064, None, Kernel.MOSAIC_GPU, False),
        (257, 1024, 4088, None, Kernel.MOSAIC_GPU, False),  # 5 x 8 tiles, under 2 chunks
        (300, 512, 4096, None, Kernel.MOSAIC_GPU, True),
        (4096, 1024, 4096, None, Kernel.MOSAIC_GPU, False),
        # Rows of 1001 elements: the NN rhs's are copied to 16-byte pitches
        # (matmul_plan.pitch_padded_plan); only NT's result has them, and stays.
        (4096, 1001, 4096, None,
         Kernel.PALLAS_TRITON if layout is Layout.NT else Kernel.MOSAIC_GPU, False),
        (1, 4096, 20000, 8192, Kernel.PALLAS_TRITON, True),
        (4096, 4096, 20000, 8192, Kernel.MOSAIC_GPU, False)):
      chosen = _plan(layout, rows, cols, contraction, contraction_chunk=chunk)
      want_chunk = chunk or matmul_plan.fixed_contraction_chunk(layout, cols, contraction)
      assert (chosen.kernel, chosen.split_chunks, chosen.contraction_chunk) == (
          kernel, split, want_chunk), (layout, rows, cols, chosen)
      assert split or chosen.tiles.accumulator_registers <= limit, chosen
      assert _plan(layout, rows, cols, contraction, backend="triton",
                   contraction_chunk=chunk).contraction_chunk == want_chunk
    for contraction, chunk in ((8192, 8192), (8192, 8256), (20, 32)):
      assert _plan(layout, 300, 4096, contraction, contraction_chunk=chunk) == _plan(
          layout, 300, 4096, contraction)
  for layout, chunk in ((Layout.TN, 8192), (Layout.NT, 100)):
    with pytest.raises(ValueError, match="contraction_chunk needs"):
      _plan(layout, 300, 4096, 20000, contraction_chunk=chunk)


def test_split_chunks_overrides_the_rule():
  """plan's split_chunks forces either place for the chunks of one chunked problem
  (what tune_matmul.py --split-m times), on the kernel the split's rule picks,
  and is refused where no split can run: an unchunked contraction, groups, or
  the jax-triton backend."""
  in_program = _plan(Layout.NN, 100, 1024, 4096, split_chunks=False)
  assert not in_program.split_chunks and in_program.contraction_chunk == 2048
  assert in_program.tiles.accumulator_registers <= kernels.CHUNK_ACCUMULATOR_REGISTERS
  assert _plan(Layout.NN, 100, 1024, 4096) == _plan(Layout.NN, 100, 1024, 4096,
                                                     split_chunks=True)
  forced = _plan(Layout.NT, 4096, 1024, 4096, split_chunks=True)
  assert forced.split_chunks and forced.kernel is Kernel.MOSAIC_GPU
  forced = _plan(Layout.NT, 4096, 1001, 4096, split_chunks=True)
  assert forced.split_chunks and forced.kernel is Kernel.PALLAS_TRITON
  for options in (dict(cols=4096), dict(groups=2), dict(backend="triton")):
    cols = options.pop("cols", 1024)
    with pytest.raises(ValueError, match="split_chunks needs"):
      _plan(Layout.NN, 100, cols, 4096, split_chunks=True, **options)


def test_plan_splits_on_the_mosaic_kernel_where_its_units_fill_the_sms():
  """A split runs on the Mosaic GPU kernel where it takes the sizes and the
  units of its pick (a chunk of a tile each, tiles that are not transposed, of
  any accumulator) fill at least MOSAIC_SPLIT_FILL of the H100's 132 SMs, else
  on the Triton ladder, whose tiles go down to 16 columns. Above
  SPLIT_CHUNK_ROWS rows, up to TALL_SPLIT_ROWS unless the in-program tiles fill
  FULL_WAVE_FILL of them over fewer than FULL_WAVE_SPLIT_MIN_CHUNKS chunks, above
  TALL_SPLIT_ROWS only where they fill less than IN_PROGRAM_SPLIT_FILL: shapes
  from the H200 draws (benchmarks/results/h100.md, forty-fourth, fifty-third and
  sixty-fourth sections)."""
  for rows, cols, contraction, want in (
      (202, 1024, 4608, hopper.HopperTiles(64, 64, 8, throughput=0.75)),  # 96 units
      (208, 1664, 9952, hopper.HopperTiles(128, 64, 6)),  # 2 x 13 tiles x 3 chunks
      (149, 1864, 9984, hopper.HopperTiles(128, 64, 6, multicast=True)),  # 1864: off the lines
      (188, 256, 3200, None),  # 3 x 2 tiles x 4 chunks: 24 units
      (256, 1024, 4096, None),  # 64 units
      (100, 1024, 8192, None)):  # 2 x 8 tiles x 4 chunks
    for layout in (Layout.NN, Layout.NT):
      chosen = _plan(layout, rows, cols, contraction)
      assert chosen.split_chunks, (layout, rows, cols, contraction, chosen)
      if want is None:
        assert chosen.kernel is Kernel.PALLAS_TRITON, (layout, rows, cols, chosen)
        continue
      assert chosen.kernel is Kernel.MOSAIC_GPU, (layout, rows, cols, chosen)
      if layout is Layout.NN:  # NT's rhs rows are the contraction's, on other lines
        assert chosen.tiles == kernels.fit_stages(want, bf16, jnp.float32), chosen
      chunks = kernels.cdiv(contraction, chosen.contraction_chunk)
      units = chosen.tiles.tile_count(rows, cols) * chunks
      assert units >= matmul_plan.MOSAIC_SPLIT_FILL * 132, (rows, cols, units)
  for options in (dict(dtype=jnp.dtype(jnp.float32)), dict(device=matmul_plan.Device("cpu"))):
    chosen = _plan(Layout.NN, 202, 1024, 4608, **options)
    assert chosen.split_chunks and chosen.kernel is Kernel.PALLAS_TRITON, (options, chosen)
  # Above SPLIT_CHUNK_ROWS: up to TALL_SPLIT_ROWS unless the in-program pick's
  # tiles fill FULL_WAVE_FILL of the SMs over fewer than FULL_WAVE_SPLIT_MIN_CHUNKS
  # chunks, above them where those tiles fill less than IN_PROGRAM_SPLIT_FILL.
  for rows, cols, contraction, split in ((466, 256, 3872, True),  # 8 x 2 tiles in-program
                                         (512, 1536, 151936, True),  # 8 x 12 tiles of 132: 0.73
                                         (509, 1856, 19200, True),  # 8 x 15 of 132: 0.91, 5 chunks
                                         (509, 1856, 19192, False),  # 4.998 chunks of 3840
                                         (464, 1856, 8064, False),  # 2.1 chunks
                                         (429, 1632, 11264, True),  # 0.79, 3.4 chunks
                                         (513, 1536, 151936, False),  # 9 x 12 of 132: 0.82
                                         (513, 1024, 8192, True),  # 9 x 8 of 132: 0.545
                                         (700, 896, 8192, False),  # 11 x 7 of 132: 0.583
                                         (968, 720, 10976, False),  # 16 x 6 tiles of 120: 0.80
                                         (640, 1536, 18944, False),  # 10 x 12 tiles of 132: 0.91
                                         (948, 1152, 4736, False),  # T72 x 128: 14 x 9
                                         (969, 1024, 15360, False)):  # 16 x 8
    chosen = _plan(Layout.NN, rows, cols, contraction)
    assert (chosen.kernel, chosen.split_chunks) == (Kernel.MOSAIC_GPU, split), (rows, chosen)


def test_chunks_on_programs_of_their_own_give_the_in_program_bits():
  """matmul_chunks (each chunk on a program of its own, the float32 partials
  added in order by a second kernel) gives the bits of matmul with the same
  chunks in one program, NN and NT, over whole chunks and a last chunk with a
  partial step, at a row count that fills no tile."""
  rng = np.random.default_rng(31)
  lhs = random_normal(rng, (1, 37, 680), jnp.bfloat16)
  rhs = random_normal(rng, (1, 680, 40), jnp.bfloat16)
  for transpose_b, operand in ((False, rhs), (True, jnp.swapaxes(rhs, 1, 2))):
    options = dict(transpose_b=transpose_b, out_dtype=jnp.float32, precision=None,
                   tiles=kernels.INTERPRET_TILES, interpret=True, contraction_chunk=256)
    assert_bitwise_equal(kernels.matmul_chunks(lhs, operand, **options),
                         kernels.matmul(lhs, operand, **options), what=f"transpose_b={transpose_b}")


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_chunk_total_adds_the_partials_in_chunk_order(out_dtype):
  """chunk_total (on its own tiles, whatever the GEMM's) gives the float32 sum
  of the partials from the first chunk to the last, rounded once, at a result
  that fills no tile of CHUNK_TOTAL_TILES."""
  partials = random_normal(np.random.default_rng(7), (9, 37, 70), jnp.float32)
  want = partials[0]
  for partial in partials[1:]:
    want = want + partial
  assert_bitwise_equal(kernels.chunk_total(partials, out_dtype=out_dtype, interpret=True),
                       want.astype(out_dtype), what="chunk_total")


def _chunked_equals_loop_of_gemms(rows, cols, contraction, chunk, *, interpret):
  """NN and NT with ``contraction_chunk`` against one GEMM per chunk (each as the
  plan runs it, in one sum) whose float32 results are added in order from zeros,
  bitwise."""
  rng = np.random.default_rng(contraction)
  lhs = random_normal(rng, (1, rows, contraction), jnp.bfloat16)
  rhs_nn = random_normal(rng, (1, contraction, cols), jnp.bfloat16)
  run = functools.partial(matmul_plan.run, out_dtype=jnp.float32, interpret=interpret)
  for layout, rhs, window in ((Layout.NN, rhs_nn, lambda x, s: x[:, s, :]),
                              (Layout.NT, jnp.swapaxes(rhs_nn, 1, 2), lambda x, s: x[:, :, s])):
    want = jnp.zeros((1, rows, cols), jnp.float32)
    for first in range(0, contraction, chunk):
      part = slice(first, first + chunk)
      want = want + run(layout, lhs[:, :, part], window(rhs, part), contraction_chunk=chunk)
    got = run(layout, lhs, rhs, contraction_chunk=chunk)
    assert_bitwise_equal(got, want, what=f"{layout.name} in chunks of {chunk}")


@pytest.mark.parametrize("where", ["here", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_chunked_contraction_equals_a_loop_of_gemms(where):
  """Interpret mode: 2 full chunks and a tail with a partial step; the GPU: the
  chunks (split on the Triton ladder at 16 rows and on the Mosaic GPU kernel at
  200, in its programs at 300) against per-chunk GEMMs that the plan sends to
  Mosaic GPU (200 and 300 rows) and to the Triton ladder (16 rows)."""
  if where == "here":
    _chunked_equals_loop_of_gemms(5, 40, 300, 128, interpret=True)
  else:
    for rows in (16, 200, 300):
      _chunked_equals_loop_of_gemms(rows, 1024, 2 * 8192 + 1000, 8192, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [7, 8, 64])
def test_gpu_a_chunk_of_one_step_is_summed_from_zero(tail):
  """Two 1024-long chunks and a last chunk of one step (``tail`` indices): every
  kernel sums the lone step from zero and then adds it
  (``pallas_kernels.matmul.add_chunk_sum``; Triton's combiner would fold it into
  the running total), NN and NT: the Triton kernels in each program at 64- and
  256-deep steps and split, jax-triton where installed, and the plan's own pick,
  against per-chunk GEMMs added in order, float32 results."""
  rows, cols, chunk = 300, 256, 1024
  contraction = 2 * chunk + tail
  rng = np.random.default_rng(tail)
  lhs = random_normal(rng, (1, rows, contraction), jnp.bfloat16)
  rhs_nn = random_normal(rng, (1, contraction, cols), jnp.bfloat16)
  f32 = jnp.dtype(jnp.float32)
  tiles = kernels.fit_stages(next(t for t in kernels.GPU_MATMUL_LADDER
                                  if (t.block_m, t.block_n) == (64, 128)), bf16, f32)
  in_program = matmul_plan.Plan(Kernel.PALLAS_TRITON, tiles, contraction_chunk=chunk)
  plans = [in_program,
           dataclasses.replace(in_program, tiles=kernels.fit_stages(
               dataclasses.replace(tiles, step_k=kernels.DEEP_STEP_K), bf16, f32)),
           dataclasses.replace(in_program, split_chunks=True)]
  if importlib.util.find_spec("jax_triton"):
    plans.append(dataclasses.replace(in_program, kernel=Kernel.JAX_TRITON))
  for layout, rhs, window in ((Layout.NN, rhs_nn, lambda x, s: x[:, s, :]),
                              (Layout.NT, jnp.swapaxes(rhs_nn, 1, 2), lambda x, s: x[:, :, s])):
    want = jnp.zeros((1, rows, cols), f32)
    for first in range(0, contraction, chunk):
      part = slice(first, first + chunk)
      want = want + matmul_plan.run(layout, lhs[:, :, part], window(rhs, part), out_dtype=f32)
    pick = matmul_plan.plan(layout, rows, cols, contraction, dtype=bf16, out_dtype=f32,
                            contraction_chunk=chunk)
    for p in [*plans, pick]:
      assert_bitwise_equal(matmul_plan.launch(p, lhs, rhs, layout=layout, out_dtype=f32), want,
                           what=f"{layout.name}, {p}")


def test_plan_sends_mosaic_only_what_tma_takes():
  """The Mosaic GPU kernel runs 16-bit GEMMs of one problem with a result no
  smaller than one of its tiles and 16-byte row pitches (every operand's and the
  result's minor dimension a multiple of 8): the forward and dA above LADDER_ROWS
  rows (but where the plan keeps the ladder: matmul_plan.ladder_keeps), up to
  LADDER_ROWS over contractions of STREAM_MIN_CONTRACTION or more in one wave of
  stream tiles (hopper_matmul.stream_tiles: 64 columns, any rows, above
  STREAM_ROWS over a share of them; where the ladder picks its 16 x 16 tile, over
  1536 or more in NN, 2560 in NT, 1664 in NT where the ladder's programs fill at
  most half the SMs), a
  chunked contraction's split where its pick's units fill the SMs
  (matmul_plan.mosaic_split_tiles), dB whatever the token count. (Operands
  copied to those pitches: test_plan_pads_operand_rows_to_the_tma_pitch_where_it_pays.)"""
  for layout in Layout:
    for rows in (1, 48, 49, 64, 65, 100, 128, 129, 192, 300, 777, 1000, 1001, 4096):
      for cols in (64, 128, 192, 320, 1000, 1004, 1024, 1536, 4096, 8448, 8456, 13824, 28672):
        for contraction in (100, 777, 1800, 2048, 3000, 4096, 4100):
          chosen = _plan(layout, rows, cols, contraction)
          if chosen.pitch_padded:
            continue
          if layout is Layout.TN:
            mosaic_fits = (rows % 8 == 0 and cols % 8 == 0
                           and any(t.fits(rows, cols) for t in hopper.ROW_TILES))
            assert _in_row_strips(chosen) == _in_row_strips(_plan(layout, rows, cols, 1)), (
                "dB's tile sees the token count (only its strip order may)")
          else:
            ladder = matmul_plan.triton_tiles(layout, rows, cols, bf16, bf16,
                                              contraction=contraction,
                                              chunked=chosen.contraction_chunk is not None)
            takes = (cols % 8 == 0 and contraction % 8 == 0
                     and any(t.fits(rows, cols) for t in hopper.ROW_TILES))
            smallest_bound = (1536 if layout is Layout.NN
                              else 1664 if -(-rows // 16) * -(-cols // 16) <= 66 else 2560)
            smallest = (ladder.block_m, ladder.block_n) == (16, 16)
            streams = (cols % 8 == 0 and contraction % 8 == 0 and 64 <= cols <= 132 * 64
                       and contraction >= matmul_plan.STREAM_MIN_CONTRACTION
                       and not (smallest and contraction < smallest_bound))
            mosaic_fits = (takes and rows > hopper.LADDER_ROWS
                           or streams and rows <= hopper.LADDER_ROWS)
            if chosen.split_chunks:
              mosaic_fits = takes and matmul_plan.mosaic_split_tiles(
                  layout, rows, cols, contraction, chosen.contraction_chunk, bf16, H100,
                  132) is not None
            elif mosaic_fits and rows > hopper.LADDER_ROWS:
              pick = matmul_plan.mosaic_pick(layout, rows, cols, contraction, bf16, 132,
                                             chunked=chosen.contraction_chunk is not None)
              mosaic_fits = not matmul_plan.ladder_keeps(ladder, pick, rows, cols, contraction,
                                                         132)
          assert (chosen.kernel is Kernel.MOSAIC_GPU) == mosaic_fits, (
              layout, rows, cols, contraction, chosen)
          if chosen.kernel is Kernel.MOSAIC_GPU:
            assert chosen.tiles.fits(rows, cols), (layout, rows, cols, chosen)
          assert kernels.fit_stages(chosen.tiles, bf16, bf16) == chosen.tiles


def test_plan_keeps_the_ladder_where_it_streams_the_weight_once():
  """From 65 rows the forward and dA run on the Mosaic GPU kernel, but where the
  ladder's tiles hold every row and the Mosaic pick's do not, over a contraction
  of at least LADDER_MIN_CONTRACTION, on waves at least LADDER_WAVE_FILL full and
  as full as the pick's (matmul_plan.ladder_keeps); GEMMs of the H200 sweeps
  (benchmarks/results/h100.md, forty-third section)."""
  kernel = lambda rows, k, n, layout=Layout.NN: _plan(
      layout, rows, *((n, k) if layout is Layout.NN else (k, n))).kernel
  for k, n in ((4096, 28672), (4096, 128256), (8192, 57344), (5120, 13824), (4096, 14336),
               (3072, 26624), (13056, 54272), (9088, 27392)):
    assert kernel(100, k, n) is Kernel.PALLAS_TRITON, (k, n)  # waves as full as the pick's
    assert kernel(128, k, n) is Kernel.MOSAIC_GPU, (k, n)     # 128-row Mosaic tiles
  for k, n in ((3584, 37888), (8192, 10240)):  # 56-61% of the ladder's waves
    assert kernel(100, k, n) is Kernel.MOSAIC_GPU, (k, n)
  assert kernel(87, 6784, 101888) is Kernel.MOSAIC_GPU   # waves 75% full, the pick's 86%
  assert kernel(110, 1280, 13824) is Kernel.MOSAIC_GPU   # a short contraction
  assert kernel(80, 11776, 80512) is Kernel.MOSAIC_GPU   # an 80-row transposed Mosaic tile
  for k, n in ((4096, 4096), (14336, 4096), (13824, 5120), (4096, 6144), (768, 2048)):
    assert kernel(100, k, n) is Kernel.MOSAIC_GPU, (k, n)  # 64-row ladder tiles
  assert kernel(64, 1016, 4096) is Kernel.PALLAS_TRITON  # LADDER_ROWS over a contraction
  # the stream tiles leave (test_plan_streams_few_rows_through_one_consumer_tiles)
  assert kernel(129, 4096, 128256) is kernel(65, 768, 2048) is Kernel.MOSAIC_GPU
  # dA into a wide activation gradient ([100, 28672] over 8192) keeps the ladder too.
  assert kernel(100, 28672, 8192, Layout.NT) is Kernel.PALLAS_TRITON
  assert kernel(100, 8192, 28672, Layout.NT) is Kernel.MOSAIC_GPU


def test_plan_streams_few_rows_through_one_consumer_tiles():
  """Up to STREAM_ROWS rows the forward and dA over a contraction of at least
  STREAM_MIN_CONTRACTION run on the Mosaic GPU kernel's stream tiles (one
  consumer warpgroup, 64 weight columns, the rows rounded up to 8 on wgmma's N
  side) where those fill at most one wave of 132 SMs (above, up to LADDER_ROWS,
  those of a share of the rows: matmul_plan.row_stream_tiles), but where the
  ladder picks its smallest tile (16 x 16) over
  SMALLEST_TILE_STREAM_MIN_CONTRACTION (in NT on at most half the SMs' programs,
  HALF_WAVE_NT_STREAM_MIN_CONTRACTION); GEMMs of the H200 probes
  (benchmarks/results/h100.md, fifty-fifth to fifty-eighth and sixty-eighth
  sections)."""
  def tiles(rows, cols, contraction, layout=Layout.NN, **options):
    chosen = _plan(layout, rows, cols, contraction, **options)
    return chosen.tiles if chosen.kernel is Kernel.MOSAIC_GPU else None

  for rows, block_m in ((1, 8), (5, 8), (8, 8), (9, 16), (31, 32), (41, 48), (48, 48)):
    for layout in (Layout.NN, Layout.NT):
      streamed = tiles(rows, 4096, 14336, layout)
      assert (streamed.block_m, streamed.block_cols, streamed.consumers) == (block_m, 64, 1)
      assert streamed.transposed and streamed.streams and streamed.fits(rows, 4096)
      assert streamed == kernels.fit_stages(hopper.stream_tiles(rows), bf16, bf16)
  assert tiles(1, 4096, 14336).num_stages == hopper.STREAM_STAGES
  assert tiles(48, 4096, 14336).num_stages < hopper.STREAM_STAGES  # shared memory
  # Above STREAM_ROWS, up to LADDER_ROWS, a share of the rows (row_stream_tiles): the most
  # CTAs one wave holds.
  shares = lambda rows: kernels.fit_stages(hopper.stream_tiles(rows), bf16, bf16)
  for layout in (Layout.NN, Layout.NT):
    assert tiles(49, 4096, 14336, layout) == tiles(64, 4096, 14336, layout) == shares(32)
  assert tiles(64, 4096, 14336).tile_count(64, 4096) == 128
  assert tiles(57, 1080, 2048) == shares(16)      # 4 x 17 = 68 CTAs (8 rows: 136, past a wave)
  assert tiles(64, 5120, 14336) == shares(64)                  # 80 CTAs whole
  assert tiles(64, 132 * 64, 14336) == shares(64)
  assert tiles(64, 132 * 64 + 8, 14336) is None                # 133 CTAs: the ladder
  assert tiles(64, 4096, 1016) is None                          # STREAM_MIN_CONTRACTION
  assert tiles(65, 4224, 14336).consumers == 2  # 66 CTAs (fewer: row_stream_tiles)
  assert tiles(16, 4096, 1024).consumers == 1                   # STREAM_MIN_CONTRACTION
  assert tiles(16, 4096, 1016) is None
  # The ladder's 16 x 16 tile: 16 rows of at most 132 sixteen-column programs.
  assert matmul_plan.SMALLEST_LADDER_TILE == (16, 16)
  assert tiles(16, 1536, 2048).consumers == 1                # the MoE expert's gate_up
  assert tiles(16, 2048, 1536).consumers == 1   # SMALLEST_TILE_STREAM_MIN_CONTRACTION
  assert tiles(16, 2048, 1528) is None
  assert tiles(16, 2048, 1536, Layout.NT) is None             # the expert gate_up's dA
  assert tiles(16, 1536, 2560, Layout.NT).consumers == 1
  assert tiles(16, 1536, 2552, Layout.NT) is None
  # NT where the 16 x 16 programs fill at most half the SMs (66 of 132):
  # HALF_WAVE_NT_STREAM_MIN_CONTRACTION.
  assert tiles(16, 768, 2048, Layout.NT).consumers == 1        # the expert down's dA
  assert tiles(16, 66 * 16, 1664, Layout.NT).consumers == 1
  assert tiles(16, 66 * 16, 1656, Layout.NT) is None
  assert tiles(16, 66 * 16 + 8, 1664, Layout.NT) is None       # 67 programs
  assert tiles(17, 2048, 1536, Layout.NT).consumers == 1              # a 64 x 16 pick
  assert tiles(16, 132 * 16 + 8, 1024, Layout.NT).consumers == 1      # a 16 x 32 pick
  assert tiles(16, 132 * 64, 28672).consumers == 1                     # one wave
  assert tiles(16, 132 * 64 + 8, 28672) is None
  assert tiles(16, 14336, 4096) is None                                # 224 tiles
  assert tiles(16, 4096, 14336, out_dtype=jnp.float32) is None         # not transposed
  assert tiles(16, 4096, 4100) is None      # up to 16 rows no pitch-padded stream tiles
  assert tiles(16, 4100, 14336) is None     # nor of a weight of unaligned width
  assert _plan(Layout.NN, 16, 4096, 14336, groups=2).kernel is Kernel.PALLAS_TRITON
  assert _plan(Layout.NN, 16, 4096, 14336, device=matmul_plan.Device("gpu", "8.0", 108)
               ).kernel is Kernel.PALLAS_TRITON
  # The plain and transposed tile tables keep two consumers.
  assert not any(t.streams or t.consumers != 2
                 for t in hopper.ROW_TILES + hopper.TRANSPOSED_TILES)
  assert not hopper.HopperTiles(8, 64, transposed=True).fits(1, 4096)  # two consumers
  for bad in (dict(consumers=3), dict(consumers=1), dict(split_rows=True, consumers=1)):
    with pytest.raises(ValueError, match="consumers must be 2, or 1 in a transposed tile"):
      hopper.HopperTiles(**bad)


def test_plan_triton_tile_rule():
  """Every 16-bit Triton choice is a ladder tile at one of its stage counts (or
  its deep steps' and warps where rows are of odd length, as n = 1's are),
  float32 the same tile with fewer stages if needed to fit shared memory (its
  rows are whole words: no deep steps, the tile's own warps; past one wave it
  may keep its own stages where too few would let its programs share the SMs),
  up to 64 rows one row of tiles; dB's tile is the forward's pick for its
  [K, N] result, at the ladder tile's own stages."""
  launch_params = lambda t: (t.block_m, t.block_n, t.num_warps, t.num_stages)
  configs = {launch_params(kernels.fit_stages(config, bf16, bf16))
             for config in _gpu_ladder_configs(words_missed=True)}
  f32 = jnp.dtype(jnp.float32)
  for m in (1, 5, 16, 17, 64, 65, 128, 256, 1000, 4096):
    for n in (1, 100, 1000, 4096, 12288, 32000):
      half = _plan(Layout.NN, m, n, 64, groups=2).tiles
      single = _plan(Layout.NN, m, n, 64, f32, groups=2).tiles
      assert launch_params(half) in configs, (m, n, half)
      assert launch_params(single)[:2] == launch_params(half)[:2]
      assert single.num_warps == half.num_warps or (
          half.step_k == kernels.DEEP_STEP_K
          and half.num_warps == matmul_plan.sync_load_warps(_ladder_tile(half)))
      own_stages = lambda dtype: kernels.fit_stages(_ladder_tile(half), dtype, dtype).num_stages
      # bf16 at resident stages, float32 at its own: too few of its stages share an SM.
      assert (single.num_stages <= half.num_stages or single.step_k < half.step_k
              or (half.num_stages < own_stages(bf16) and single.num_stages == own_stages(f32)))
      assert single.stage_bytes(f32) * single.num_stages <= kernels.GPU_SHARED_MEMORY_BYTES
      assert m > kernels.GPU_ONE_ROW_OF_TILES or half.block_m >= m, (m, n, half)
      at_b = _plan(Layout.TN, m, n, 64, groups=2).tiles
      assert launch_params(at_b)[:3] == launch_params(
          matmul_plan.triton_tiles(Layout.NN, m, n, bf16, bf16, 2))[:3], (m, n, at_b)
      assert at_b in {kernels.fit_stages(t, bf16, bf16) for t in kernels.GPU_MATMUL_LADDER}


def test_plan_triton_ladder_picks():
  """The Triton ladder rule (matmul_plan.triton_tiles) makes the picks the H100
  sweeps found fastest (benchmarks/results/h100.md, twenty-ninth and thirty-sixth
  sessions): more, narrower programs where the grid would not fill a wave, fewer
  waves of wide ones on wide results, and deep pipelines for one-wave grids. A
  grouped GEMM counts every group's programs (not yet timed on the GPU)."""
  def pick(rows, cols, layout=Layout.NN, groups=1):
    tiles = matmul_plan.triton_tiles(layout, rows, cols, bf16, bf16, groups, contraction=2048)
    return tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages

  assert pick(16, 1536) == pick(1, 2050) == (16, 16, 2, 10)    # 96 / 129 programs
  assert pick(16, 4096) == (16, 32, 4, 12)                     # 128 programs, one wave
  assert pick(16, 5120) == pick(16, 6144) == (16, 64, 4, 10)   # 80 / 96 programs
  assert pick(16, 10240) == (16, 128, 4, 6)                    # 80 programs
  assert pick(16, 18944) == (16, 128, 4, 4)                    # 2 waves
  # Past one wave, the programs each SM gets share its shared memory at once, at no
  # fewer than RESIDENT_MIN_STAGES: 448 programs of 16 x 128 (four to an SM) at 3
  # stages, 296 of 64 x 128 (three) at 3, where two of them fit at 4 (on an H200 at
  # 31 rows of 3584 x 37888, 1.00x of cuBLAS against 0.80x; benchmarks/results/
  # h100.md, forty-ninth session); 1002 of 64 x 128 would fit only at 2, so keep 4.
  assert pick(16, 57344) == (16, 128, 4, 3)
  assert pick(31, 37888) == pick(64, 37888) == (64, 128, 4, 3)
  assert pick(31, 28672) == (64, 128, 4, 4) and pick(31, 128256) == (64, 128, 4, 4)
  assert pick(64, 1536) == pick(31, 2050) == (64, 16, 4, 10)   # 96 / 129 programs
  assert pick(100, 2050) == (64, 32, 4, 10)                    # 130 programs
  assert pick(100, 1000) == (16, 64, 4, 10)   # 112 programs; 64 x 16 ties and was slower
  assert pick(64, 5120) == pick(100, 4096) == (64, 64, 4, 10)  # 80 / 128 programs
  assert pick(100, 5120, Layout.NT) == (64, 128, 4, 8)         # 80 programs
  assert pick(100, 28672) == (128, 256, 8, 3)
  assert pick(2048, 4100, Layout.NT) == (128, 128, 8, 3)       # a Triton-only pitch
  # 64 experts' 16-row GEMMs fill 6 waves with 16 x 128 tiles; one alone takes 16 x 16.
  assert pick(16, 1536, groups=64) == (16, 128, 4, 4)
  # dB: the same rule over its [K, N] result, at the tiles' own stages (on an H200 at
  # 819 and 1775 rows, 1.9x and 2.7x faster than one 128 x 256 tile for every size;
  # benchmarks/results/h100.md, forty-seventh session).
  assert pick(440, 1059, Layout.TN) == (64, 64, 4, 4)
  assert pick(482, 464, Layout.TN) == (64, 32, 4, 6)
  assert pick(2080, 5625, Layout.TN) == (128, 256, 8, 3)
  # A one-wave grid of 16 x 16 stages over a contraction of at least 2048 loads it
  # in 256-deep steps where its 10 stages hold them all (NN: 8 of them, at most
  # 2048; the expert 16-22% faster on the H100), else in 128-deep steps where
  # every row is a multiple of 16 bytes; shorter contractions, wider
  # tiles and grids of two waves keep 64-deep steps.
  depth = lambda rows, cols, contraction, groups=1, layout=Layout.NN: matmul_plan.triton_tiles(
      layout, rows, cols, bf16, bf16, groups, contraction=contraction).step_k
  assert depth(16, 1536, 2048) == depth(8, 2048, 2048) == 256
  assert depth(1, 816, 2240, layout=Layout.NT) == depth(16, 1536, 2560, layout=Layout.NT) == 256
  assert depth(1, 816, 2240) == depth(16, 1536, 2600) == depth(2, 1000, 3000) == 128
  assert depth(16, 1536, 2600, layout=Layout.NT) == depth(1, 2048, 14336) == 128
  assert depth(1, 2050, 4100) == depth(1, 2050, 4100, layout=Layout.NT) == 64  # 16-byte rows
  assert depth(16, 1536, 1536) == depth(16, 4096, 2048) == 64
  assert depth(16, 1536, 2048, groups=2) == depth(31, 1536, 2048) == 64
  assert _plan(Layout.NN, 16, 1536, 2048, backend="triton").tiles.step_k == 64
  assert _plan(Layout.NN, 16, 1536, 2048, jnp.float32).tiles.step_k == 64
  # Operand rows that are not whole 4-byte words (an odd length of 16-bit
  # elements) take 256-deep steps on tiles of at most 64 rows in a single wave,
  # whatever the contraction (NN: K or N odd; NT: K odd); over more waves (GPT-2's
  # 50,257-column head) they keep the resident stages' 64-deep steps; rows of
  # whole words keep the rules above, and so do 128-row tiles and float32.
  assert depth(1, 2048, 2187) == depth(7, 727, 3456) == depth(64, 4097, 300) == 256
  assert depth(16, 1481, 2187, groups=4) == depth(300, 1205, 8320) == 256
  assert depth(8, 50257, 768) == depth(32, 50257, 1600) == 64
  assert depth(13, 37536, 1369, layout=Layout.NT) == 64
  assert depth(2, 727, 3456, layout=Layout.NT) == 64 != depth(2, 3456, 727, layout=Layout.NT)
  assert depth(1, 4258, 1536) == depth(16, 2050, 4100) == 64
  assert matmul_plan.triton_tiles(Layout.NN, 2048, 1205, bf16, bf16, contraction=8320).step_k == 64
  assert _plan(Layout.NN, 7, 727, 3456, jnp.float32).tiles.step_k == 64
  # Those deep steps run at least 4 warps: the 16 x 16 tile's 2 warps issued the
  # synchronous 2-byte loads more slowly (on an H200 1.01-1.38x faster at 37 GEMMs);
  # over rows of whole words it keeps its 2 warps.
  warps = lambda rows, cols, contraction, groups=1, layout=Layout.NN: matmul_plan.triton_tiles(
      layout, rows, cols, bf16, bf16, groups, contraction=contraction).num_warps
  assert warps(1, 158, 2007) == warps(2, 1362, 1563, layout=Layout.NT) == 4
  assert warps(16, 1536, 2048) == warps(2, 1360, 1672, layout=Layout.NT) == 2  # whole words
  assert warps(64, 4097, 300) == warps(7, 3456, 727) == 4  # the tile's own 4 warps
  # 16 x 64 and 16 x 128 (four and eight times as wide as tall) run 8 warps there (on an
  # H200 1.17x faster at 30 GEMMs drawn after the rule); 16 x 32 and 64 x 16 keep 4, rows
  # of whole words and grids of more waves the tile's own.
  assert warps(16, 5120, 2047) == warps(3, 10240, 2047) == warps(16, 5119, 2048) == 8
  assert warps(16, 4096, 2047) == warps(31, 2050, 2047) == 4
  assert warps(16, 5120, 2048) == warps(16, 10240, 2048) == warps(16, 57343, 2048) == 4
  small = _plan(Layout.NN, 1, 158, 2007).tiles
  assert (small.block_m, small.block_n, small.num_warps, small.step_k) == (16, 16, 4, 256)
  split = _plan(Layout.NN, 7, 727, 3457)
  assert split.split_chunks and split.tiles.step_k == 256
  # Waves are the device's: 128 programs of 16 x 32 are two waves on 108 SMs.
  on_108_sms = _plan(Layout.NN, 16, 4096, 2048, device=matmul_plan.Device("gpu", "8.0", 108))
  assert (on_108_sms.tiles.block_n, on_108_sms.tiles.num_stages) == (64, 10)


def test_plan_mosaic_row_tile_rule():
  """The Mosaic kernel's tile rule (132 SMs): the picks the H100 sweeps found
  fastest."""
  pick = lambda rows, cols: matmul_plan.mosaic_row_tiles(rows, cols, num_sms=132)
  big, narrow, square, wide, small = hopper.ROW_TILES
  assert pick(192, 4096) == pick(256, 4096) == small    # 96 / 128 programs of 64 x 128
  assert pick(384, 4096) == pick(512, 4096) == square   # 96 / 128 programs of 128 x 128
  assert pick(320, 12288) == wide                       # 240 programs of 64 x 256
  assert pick(640, 4096) == pick(256, 12288) == narrow  # 110 / 128 programs of 128 x 192
  assert pick(640, 12288) == pick(512, 32000) == pick(16384, 4096) == big
  assert _plan(Layout.NN, 4096, 4096, 4096).tiles == pick(4096, 4096)
  assert pick(4096, 192).fits(4096, 192) and pick(4096, 64) is None  # only tiles that fit
  assert not any(pick(m, n).multicast for m in (129, 300, 1000, 4096) for n in (256, 4096))
  # Operand rows off the 128-byte lines cap the rate (HopperTiles.rate); an rhs's
  # tiles get multicast twins, unless the repeated odd row block costs a wave.
  # Where the lhs's rows miss the lines too, also 2 x 2 twins that share the lhs,
  # of which at most QUAD_CLUSTERS run at once (120 of 132 SMs).
  assert all(t.rate(True, True) == t.throughput for t in hopper.ROW_TILES)
  # The rule as such, without the chunks a 1000-column result's contraction runs
  # in (those keep to tiles that fit two accumulators: test_plan_runs_chunks_on_every_kernel).
  unchunked = lambda layout, rows, cols, contraction: _plan(layout, rows, cols, contraction,
                                                            contraction_chunk=contraction)
  misaligned = lambda rows, cols, lhs_aligned=False: matmul_plan.mosaic_row_tiles(
      rows, cols, num_sms=132, lhs_aligned=lhs_aligned, rhs_aligned=False)
  twin = lambda tiles: dataclasses.replace(tiles, multicast=True)
  quad = lambda tiles: dataclasses.replace(tiles, multicast=True, multicast_lhs=True)
  assert misaligned(1000, 1000) == misaligned(300, 1000, lhs_aligned=True) == twin(small)
  assert misaligned(2048, 1000) == twin(square)
  assert misaligned(1000, 3000) == misaligned(2048, 3000) == twin(narrow)
  assert misaligned(4096, 1000) == misaligned(6000, 1000) == misaligned(16384, 3000) == twin(big)
  assert misaligned(300, 1000) == quad(small)   # 24 clusters of four, one wave
  assert misaligned(300, 3000) == quad(square)
  # Both 128 x 256 twins run at the throughput cap over 2820 x 1000 (88 tiles, one
  # wave either way): the tie goes to the smaller cluster.
  assert misaligned(2820, 1000) == twin(big)
  assert quad(small).concurrent_ctas(132) == 4 * hopper.QUAD_CLUSTERS == 120
  assert twin(small).concurrent_ctas(132) == small.concurrent_ctas(132) == 132
  assert unchunked(Layout.NN, 4096, 1000, 3000).tiles == twin(big)
  assert _plan(Layout.NN, 4096, 4096, 1000).tiles == big  # only the rhs's pitch counts
  assert _plan(Layout.NT, 4096, 4096, 1000).tiles == twin(big)
  assert _plan(Layout.TN, 3000, 1000, 16384).tiles == twin(big)
  # The forward and dA also take the transposed tiles' twins, whose row counts
  # fill the wave: 6000 x 1000 in 128 tiles of 192 x 256 (one wave), not 192 of
  # the paired 128 x 256 (two).
  shape = lambda t: (t.block_m, t.block_cols, t.transposed, t.cluster_size)
  assert shape(unchunked(Layout.NN, 6000, 1000, 3000).tiles) == (192, 256, True, 2)
  assert shape(unchunked(Layout.NT, 6000, 1000, 3000).tiles) == (192, 256, True, 2)
  # Where a paired plain tile fills the wave too, the twins' line bound decides:
  # 2000 x 1000 over K = 4096 in 120 tiles of 136 x 128 rather than 128 of the
  # paired 128 x 128.
  assert shape(unchunked(Layout.NN, 2000, 1000, 4096).tiles) == (136, 128, True, 2)
  # With both operands off the lines, the 2 x 2 twins: 2048 x 1000 in 28 clusters
  # of 152 x 128 tiles; 136 x 128 would take 32, two waves (0.59x of cuBLAS on
  # the H100 against 1.02x).
  assert shape(unchunked(Layout.NN, 2048, 1000, 3000).tiles) == (152, 128, True, 4)
  assert shape(_plan(Layout.NN, 384, 3000, 1000).tiles) == (96, 128, True, 4)
  assert shape(unchunked(Layout.NN, 3000, 1000, 3000).tiles) == (104, 256, True, 4)
  assert not any(t.multicast for t in matmul_plan.mosaic_tile_candidates(True, True))
  assert not any(t.multicast_lhs for t in matmul_plan.mosaic_tile_candidates(False, True))
  with pytest.raises(ValueError, match="split_rows needs block_m = 128"):
    hopper.HopperTiles(64, 128, split_rows=True)
  with pytest.raises(ValueError, match="multicast_lhs needs multicast"):
    hopper.HopperTiles(64, 128, multicast_lhs=True)


def test_plan_transposed_tile_rule():
  """Where the plain tiles leave rows or the last wave part empty, the rule
  (132 SMs) picks the transposed tile whose row count fills the wave: the picks
  the H100 timed fastest at mid M (benchmarks/results/h100.md,
  thirty-fourth section), and the plain tiles where they fill it already. Only
  the forward and dA with a 16-bit result take transposed tiles."""
  pick = lambda rows, cols: matmul_plan.mosaic_row_tiles(rows, cols, num_sms=132,
                                                         transposed=True)
  shape = lambda t: (t.block_m, t.block_cols, t.transposed)
  assert shape(pick(777, 4096)) == (200, 128, True)    # 128 tiles for 7 x 16 of 128 x 256
  assert shape(pick(300, 8192)) == (152, 128, True)
  assert shape(pick(640, 8192)) == (160, 256, True)
  assert shape(pick(777, 8192)) == (200, 256, True)
  assert shape(pick(448, 10240)) == (152, 256, True)
  assert shape(pick(1536, 1536)) == (144, 128, True)   # 132 tiles, one wave
  assert shape(pick(2000, 6144)) == (184, 256, True)
  assert pick(8192, 4096) == hopper.TILES               # 8 full waves of 128 x 256
  assert pick(200, 4096) == hopper.ROW_TILES[4]         # 128 tiles of 64 x 128
  assert shape(pick(300, 4096)) == (80, 128, True)
  assert shape(pick(200, 5120)) == (72, 128, True)     # 120 tiles for 80 of 128 x 128
  # Tied estimates go to the largest tile: 57 waves of 200 x 256 over 95 of 120 x 256
  # (8% faster on a 3000-row LM head), 2 of 168 x 256 over 3 of 112 x 256 (7%).
  assert shape(pick(3000, 128256)) == (200, 256, True)
  assert shape(pick(1000, 10240)) == (168, 256, True)
  plain_shapes = {(t.block_m, t.block_cols) for t in hopper.ROW_TILES}
  assert all(64 <= t.block_m <= 256 and t.block_m % 8 == 0 and t.block_n % 64 == 0
             and t.block_n * t.block_m <= 128 * 200
             and (t.block_m, t.block_cols) not in plain_shapes for t in hopper.TRANSPOSED_TILES)
  assert _plan(Layout.NN, 777, 4096, 4096).tiles.transposed
  assert _plan(Layout.NT, 777, 4096, 4096).tiles.transposed
  assert not _plan(Layout.NN, 777, 4096, 4096, out_dtype=jnp.float32).tiles.transposed
  for rows in (304, 776, 4096):
    for cols in (1536, 4096):
      db_plan = _plan(Layout.TN, rows, cols, 777)
      assert db_plan.kernel is Kernel.MOSAIC_GPU and not db_plan.tiles.transposed
  with pytest.raises(ValueError, match="transposed tiles need"):
    hopper.HopperTiles(60, 64, transposed=True)
  with pytest.raises(ValueError, match="transposed tiles need"):
    hopper.HopperTiles(128, 96, split_rows=True, transposed=True)
  sd = jax.ShapeDtypeStruct
  tiles = kernels.fit_stages(pick(777, 4096), bf16, bf16)
  for layout, out_dtype in ((Layout.TN, bf16), (Layout.NN, jnp.float32)):
    gemm = functools.partial(hopper.matmul, layout=layout, out_dtype=out_dtype, tiles=tiles)
    with pytest.raises(ValueError, match="transposed tiles take layouts NN and NT"):
      jax.jit(gemm).trace(sd((777, 4096), bf16), sd((777, 4096), bf16))


def test_plan_short_contraction_strip_rule():
  """Over a contraction of at most SHORT_CONTRACTION, a result with more tile
  columns than tile rows is walked in column strips (``mosaic_strips``): dB over
  a few hundred tokens into a wide weight; a tall weight, a longer contraction and
  a result with fewer tile columns keep the row strips."""
  strips = lambda layout, rows, cols, contraction: (
      lambda t: (t.strip_dim, t.strip_width))(_plan(layout, rows, cols, contraction).tiles)
  columns = (1, hopper.COLUMN_STRIP_WIDTH)
  rows_first = (DEFAULT_STRIPS.strip_dim, DEFAULT_STRIPS.strip_width)
  assert strips(Layout.TN, 4096, 128256, 300) == strips(Layout.TN, 3584, 37888, 300) == columns
  assert strips(Layout.TN, 4096, 28672, hopper.SHORT_CONTRACTION) == columns
  assert strips(Layout.TN, 4096, 28672, hopper.SHORT_CONTRACTION + 1) == rows_first
  assert strips(Layout.TN, 14336, 4096, 300) == strips(Layout.TN, 4096, 6144, 300) == rows_first
  assert strips(Layout.NN, 4096, 28672, 256) == columns
  tiles = hopper.TILES
  assert matmul_plan.mosaic_strips(tiles, 4096, 4096, 300) == tiles  # 32 tile rows, 16 columns
  assert matmul_plan.mosaic_strips(tiles, 4096, 4096 * 3, 4096) == tiles


def test_mosaic_kernel_rejects_sizes_it_does_not_take():
  """A row pitch TMA cannot take (an operand's or the result's minor dimension
  not a multiple of 8) is a ValueError at trace time, before any kernel."""
  sd = jax.ShapeDtypeStruct
  for layout, lhs, rhs in ((Layout.NN, (300, 1001), (1001, 1024)),
                           (Layout.NN, (300, 1024), (1024, 1004)),
                           (Layout.NT, (300, 1004), (1024, 1004)),
                           (Layout.NT, (300, 1024), (1004, 1024)),
                           (Layout.TN, (300, 1004), (300, 1024))):
    tiles = kernels.fit_stages(hopper.TILES if layout is Layout.TN else hopper.ROW_TILES[2],
                               bf16, bf16)
    gemm = functools.partial(hopper.matmul, layout=layout, out_dtype=bf16, tiles=tiles)
    with pytest.raises(ValueError, match=f"the {layout.name} kernel does not take"):
      jax.jit(gemm).trace(sd(lhs, bf16), sd(rhs, bf16))


@pytest.mark.skipif(on_gpu(), reason="the GPU tests compile the kernel for real")
def test_mosaic_kernel_lowers_for_cuda(monkeypatch):
  """Each Mosaic GPU tile, its multicast and 2 x 2 twins and the sampled
  transposed tiles (forward and dA; the others with split chunks too), and the
  stream tiles over fewer rows than theirs and as many, lower for
  an H100 (132 SMs) in each layout, with operand
  blocks copied whole (tiled: 64-aligned weight columns, a token count that 8
  divides) and one column tile at a time (1000 weight columns, 301 tokens), and
  a contraction that 64 does not divide."""
  if not cuda_lowering_available():
    pytest.skip("jax's CUDA lowering is not installed")
  h100 = type("H100", (), {"core_count": 132})()
  monkeypatch.setattr(jax, "devices", lambda *_: [h100])
  sd = jax.ShapeDtypeStruct
  operands = [(Layout.NN, (1001, 3000), (3000, 1024)), (Layout.NN, (1001, 3000), (3000, 1000)),
              (Layout.NT, (999, 1000), (3000, 1000)), (Layout.TN, (304, 1024), (304, 1000)),
              (Layout.TN, (301, 1000), (301, 1024))]
  for layout, lhs, rhs in operands:
    candidates = matmul_plan.mosaic_tile_candidates(
        rhs_aligned=False, transposed=hopper.transposed_takes(layout, bf16), lhs_aligned=False)
    for candidate in _sampled(matmul_plan.Plan(Kernel.MOSAIC_GPU, t) for t in candidates):
      tiles = kernels.fit_stages(candidate.tiles, bf16, bf16)
      gemm = functools.partial(hopper.matmul, layout=layout, out_dtype=bf16, tiles=tiles)
      jax.jit(gemm).trace(sd(lhs, bf16), sd(rhs, bf16)).lower(lowering_platforms=("cuda",))
      if layout is not Layout.TN and not tiles.transposed:
        split = functools.partial(gemm, tiles=kernels.fit_stages(tiles, bf16, jnp.float32),
                                  contraction_chunk=1024, split_chunks=True)
        jax.jit(split).trace(sd(lhs, bf16), sd(rhs, bf16)).lower(lowering_platforms=("cuda",))
  for layout, lhs, rhs in ((Layout.NN, (5, 3000), (3000, 1000)), (Layout.NT, (1, 3000),
                                                                  (1000, 3000)),
                           (Layout.NN, (48, 4096), (4096, 1024))):
    tiles = kernels.fit_stages(hopper.stream_tiles(lhs[0]), bf16, bf16)
    gemm = functools.partial(hopper.matmul, layout=layout, out_dtype=bf16, tiles=tiles)
    jax.jit(gemm).trace(sd(lhs, bf16), sd(rhs, bf16)).lower(lowering_platforms=("cuda",))


def test_plan_shares_rows_among_stream_tiles_where_the_pick_leaves_sms_idle():
  """Above LADDER_ROWS rows, up to ROW_STREAM_MAX_ROWS, the forward and dA whose
  Mosaic GPU pick fills less than ROW_STREAM_FILL of the SMs' CTA slots (on an
  H100, fewer than 66 of 132) run on stream tiles over a share of the rows: the
  most CTAs one wave holds (matmul_plan.row_stream_tiles), in a chunked
  contraction only tiles whose accumulator fits twice; never dB, a float32
  result or groups. GEMMs of the H200 draws (benchmarks/results/h100.md,
  sixty-fifth section)."""
  def tiles(rows, cols, contraction, layout=Layout.NN, **options):
    return _plan(layout, rows, cols, contraction, **options).tiles

  def shared(rows, share):
    return kernels.fit_stages(hopper.stream_tiles(-(-rows // share)), bf16, bf16)

  for layout in (Layout.NN, Layout.NT):
    # The pick's 64 x 128 tiles: 2 x 32 = 64 CTAs (0.48 of 132): two shares of 56 rows.
    assert tiles(100, 4096, 4096, layout) == shared(100, 2)
    assert shared(100, 2).tile_count(100, 4096) == 128
    assert tiles(100, 4224, 4096, layout).consumers == 2         # 66 CTAs: half of 132
    # On 130 SMs 64 CTAs fill 0.49, 66 fill 0.51.
    gpu130 = matmul_plan.Device("gpu", "9.0", 130)
    assert tiles(100, 4096, 4096, layout, device=gpu130) == shared(100, 2)
    assert tiles(100, 4224, 4096, layout, device=gpu130).consumers == 2
    # Up to ROW_STREAM_MAX_ROWS: 256 rows of 4 x 12 = 48 CTAs in five shares of 56.
    assert tiles(256, 1536, 1024, layout) == shared(256, 5)
    assert tiles(257, 1536, 1024, layout).consumers == 2
    # A chunked contraction summed in each program (1.17 chunks of 3840): 30 CTAs
    # of the pick, four shares of 32 rows in 120.
    chunked = _plan(layout, 127, 1872, 4480)
    assert (chunked.tiles, chunked.contraction_chunk, chunked.split_chunks) == (
        shared(127, 4), 3840, False)
  assert matmul_plan.row_stream_tiles(200, 4352, 132) == hopper.stream_tiles(200)   # 68 CTAs
  assert matmul_plan.row_stream_tiles(200, 4352, 132, chunked=True) is None  # 100 registers
  assert matmul_plan.row_stream_tiles(64, 132 * 64 + 8, 132) is None         # 133 CTAs
  assert not tiles(100, 4096, 4096, Layout.TN).transposed
  assert not tiles(100, 4096, 4096, out_dtype=jnp.float32).transposed
  assert _plan(Layout.NN, 100, 4096, 4096, groups=2).kernel is Kernel.PALLAS_TRITON


def _ladder_tile(tiles):
  """The GPU_MATMUL_LADDER entry of ``tiles``' block shape."""
  return next(t for t in kernels.GPU_MATMUL_LADDER
              if (t.block_m, t.block_n) == (tiles.block_m, tiles.block_n))


def test_plan_pads_operand_rows_to_the_tma_pitch_where_it_pays():
  """A single 16-bit GEMM on a Hopper GPU whose lhs or rhs rows miss 16 bytes
  runs on operands padded to 16-byte pitches exactly where it does at least
  PITCH_PAD_MIN_MACS multiply-adds and the plan of the padded sizes is the Mosaic
  GPU kernel's, its stream tiles of up to LADDER_ROWS rows
  (hopper_matmul.stream_tiles, whole or over shares of the rows) only above 16 rows
  of odd length, operand rows of odd length in NN and TN only over 512 indices or
  more, operand rows of
  even length only over 1024 indices or more and, in NN, above 128 rows; or the
  Triton ladder's for an unchunked NT GEMM of 17-64 rows of odd length: that plan,
  with the unpadded GEMM's chunks (which padding does not move). A result whose
  rows alone miss, groups, float32 operands and other GPUs are never padded."""
  ampere = matmul_plan.Device("gpu", "8.0", 108)
  padded_somewhere, padded_streams, padded_ladders = set(), set(), set()
  for layout, groups, dtype in itertools.product(Layout, (1, 8), (bf16, jnp.dtype(jnp.float32))):
    for rows in (1, 16, 17, 48, 64, 100, 300, 1001, 4096):
      for cols in (64, 727, 1000, 1004, 4096):
        for contraction in (100, 487, 1000, 3000, 4099):
          chosen = _plan(layout, rows, cols, contraction, dtype=dtype, groups=groups)
          sizes = matmul_plan.pitch_padded_sizes(layout, rows, cols, contraction)
          chunk = matmul_plan.fixed_contraction_chunk(layout, cols, contraction)
          assert matmul_plan.fixed_contraction_chunk(layout, *sizes[1:]) == chunk
          padded = _plan(layout, *sizes, dtype=dtype, contraction_chunk=chunk or sizes[2])
          odd_rows = any(minor % 2 for minor in layout.minor_dims(rows, cols, contraction))
          odd_rows_pay = odd_rows and (layout is Layout.NT or contraction >= 512)
          even_rows_pay = contraction >= 1024 and (layout is not Layout.NN or rows > 128)
          mosaic_pays = (padded.kernel is Kernel.MOSAIC_GPU
                         and (rows > 16 and odd_rows_pay
                              or (not padded.tiles.streams or rows > hopper.LADDER_ROWS)
                              and (odd_rows_pay or even_rows_pay)))
          ladder_pays = (padded.kernel is Kernel.PALLAS_TRITON and layout is Layout.NT
                         and 16 < rows <= 64 and chunk is None and odd_rows)
          pays = (groups == 1 and dtype == bf16 and (mosaic_pays or ladder_pays)
                  and rows * cols * contraction >= matmul_plan.PITCH_PAD_MIN_MACS
                  and matmul_plan.operand_rows_miss_pitch(layout, rows, cols, contraction))
          assert chosen.pitch_padded == pays, (layout, groups, dtype, rows, cols, contraction)
          if pays:
            assert chosen == dataclasses.replace(padded, pitch_padded=True)
            assert hopper.takes(layout, *sizes) and chosen.contraction_chunk == chunk
            padded_somewhere.add(layout)
            if chosen.kernel is Kernel.PALLAS_TRITON:
              padded_ladders.add(rows)
            elif chosen.tiles.streams:
              padded_streams.add(rows)
          assert not _plan(layout, rows, cols, contraction, dtype=dtype, groups=groups,
                           device=ampere).pitch_padded
  # 64 and 100 rows: the padded sizes' stream tiles over a share of the rows
  # (row_stream_tiles).
  assert padded_somewhere == set(Layout) and padded_streams == {17, 48, 64, 100}
  assert not padded_ladders
  # Past one wave of stream tiles (132 x 64 columns), NT of 17-64 rows pads for the ladder;
  # NN, 16 rows and a chunked contraction (chunks of 2048 here) do not.
  wide = 132 * 64 + 8
  for rows in (17, 64):
    assert _plan(Layout.NT, rows, wide, 4099).pitch_padded
    assert _plan(Layout.NT, rows, wide, 4099).kernel is Kernel.PALLAS_TRITON
  assert not _plan(Layout.NN, 17, wide, 4099).pitch_padded
  assert not _plan(Layout.NT, 16, wide, 16411).pitch_padded
  assert not _plan(Layout.NT, 48, 1000, 16411).pitch_padded
  assert not _plan(Layout.NT, 4096, 1001, 4096).pitch_padded  # only the result's rows miss
  # Above 16 rows the stream tiles take copies only of rows that are not whole words.
  assert _plan(Layout.NN, 48, 4101, 4096).pitch_padded
  assert _plan(Layout.NN, 48, 4101, 4096).tiles.streams
  assert not _plan(Layout.NN, 48, 4100, 4096).pitch_padded
  # Rows of even length pay for the copies over 1024 indices or more (dB: tokens), and in
  # NN above 128 rows.
  for layout, rows, cols in ((Layout.NT, 300, 4096), (Layout.TN, 4100, 4096)):
    assert _plan(layout, rows, cols, 1028).pitch_padded
    assert not _plan(layout, rows, cols, 1020).pitch_padded
  assert _plan(Layout.NN, 129, 4100, 4096).pitch_padded
  assert not _plan(Layout.NN, 128, 4100, 4096).pitch_padded
  assert _plan(Layout.NT, 100, 4100, 2050).pitch_padded
  # Rows of odd length pay for the copies in NN and TN over 512 indices or more (dB:
  # tokens), in NT over any.
  for layout, rows, cols in ((Layout.NN, 1999, 1017), (Layout.TN, 4101, 4096)):
    assert _plan(layout, rows, cols, 512).pitch_padded
    assert not _plan(layout, rows, cols, 504).pitch_padded
  assert _plan(Layout.NT, 4096, 4096, 129).pitch_padded


@pytest.mark.parametrize("layout", list(Layout))
def test_pitch_padded_launch_gives_the_unpadded_bits(layout):
  """matmul_plan.launch of a pitch-padded plan pads the operands
  (matmul_plan.pad_to_pitch), runs the plan's kernel and slices the result: the
  bits of the same kernel on the unpadded operands, chunked or not (interpret
  mode, where the padded plan runs the Triton kernel)."""
  rng = np.random.default_rng(3)
  rows, cols, contraction = 37, 45, 301
  shapes = {Layout.NN: ((rows, contraction), (contraction, cols)),
            Layout.NT: ((rows, contraction), (cols, contraction)),
            Layout.TN: ((contraction, rows), (contraction, cols))}[layout]
  lhs, rhs = (random_normal(rng, (1, *shape), bf16) for shape in shapes)
  for chunk in (None, 128) if layout is not Layout.TN else (None,):
    unpadded = _plan(layout, rows, cols, contraction, interpret=True, contraction_chunk=chunk)
    padded = dataclasses.replace(unpadded, pitch_padded=True)
    want = matmul_plan.launch(unpadded, lhs, rhs, layout=layout, out_dtype=bf16)
    got = matmul_plan.launch(padded, lhs, rhs, layout=layout, out_dtype=bf16)
    assert got.shape == (1, rows, cols)
    assert_bitwise_equal(got, want, what=f"{layout.name}, chunk {chunk}")


def _gpu_ladder_configs(words_missed: bool = False):
  """Every ladder tile, with its usual stage count and its one-wave stage count,
  and those whose stages are small enough with DEEP_STEP_K- and
  STREAMED_STEP_K-deep steps too; with ``words_missed`` (operand rows that are
  not whole words: ``matmul_plan.rows_miss_words``) every tile of at most
  GPU_ONE_ROW_OF_TILES rows with DEEP_STEP_K-deep steps on
  ``matmul_plan.sync_load_warps``' warps too; and every tile at
  the stages at which 2-32 of its programs share an SM (``triton_tiles``' resident
  stages, at least RESIDENT_MIN_STAGES)."""
  configs = [config for tiles in kernels.GPU_MATMUL_LADDER
             for config in (tiles, dataclasses.replace(tiles, num_stages=tiles.one_wave_stages))
             if config.num_stages]
  deep = [dataclasses.replace(config, step_k=step_k) for config in configs
          for step_k in (kernels.DEEP_STEP_K, kernels.STREAMED_STEP_K)
          if config.stage_bytes(bf16) <= kernels.DEEP_STEP_STAGE_BYTES]
  if words_missed:
    deep += [dataclasses.replace(config, step_k=kernels.DEEP_STEP_K,
                                 num_warps=matmul_plan.sync_load_warps(config))
             for config in configs if config.block_m <= kernels.GPU_ONE_ROW_OF_TILES]
  resident = (kernels.fit_stages(tiles, bf16, bf16, programs_per_sm)
              for tiles in kernels.GPU_MATMUL_LADDER for programs_per_sm in range(2, 33))
  return list(dict.fromkeys(configs + deep + [
      tiles for tiles in resident if tiles.num_stages >= kernels.RESIDENT_MIN_STAGES]))


def _every_plan(layout: Layout, rows: int, cols: int, contraction: int, dtype, device=None):
  """Every plan the plan could make for a GEMM of these sizes, in the contraction's
  chunks (``matmul_plan.fixed_contraction_chunk``): each Triton ladder tile at each
  stage count (for a chunked contraction, those whose accumulator fits twice, and
  every tile with the chunks on programs of their own), jax-triton where it is
  installed, and, where the Mosaic GPU kernel serves the sizes, each of its
  candidate tiles (``matmul_plan.mosaic_tile_candidates``), for a chunked
  contraction with the chunks split too (up to STREAM_ROWS rows its stream tiles:
  ``hopper_matmul.stream_tiles``; above, with those, the plan's stream tiles over a
  share of the rows: ``matmul_plan.row_stream_tiles``); where the plan pads the
  operands to 16-byte pitches (``matmul_plan.pitch_padded_plan``), the padded sizes'
  plans of the Mosaic GPU kernel and of the padded plan's kernel, padded.
  ``device``: the plan's (default: the current one)."""
  chunk = matmul_plan.fixed_contraction_chunk(layout, cols, contraction)
  words_missed = matmul_plan.rows_miss_words(layout, rows, cols, contraction, dtype)
  ladder = (_gpu_ladder_configs(words_missed) if layout is not Layout.TN
            else list(kernels.GPU_MATMUL_LADDER))
  plans = [matmul_plan.Plan(Kernel.PALLAS_TRITON, kernels.fit_stages(t, dtype, dtype),
                            contraction_chunk=chunk)
           for t in ladder if chunk is None or kernels.holds_two_accumulators(t)]
  if chunk is not None:
    plans += [matmul_plan.Plan(Kernel.PALLAS_TRITON, kernels.fit_stages(t, dtype, jnp.float32),
                               contraction_chunk=chunk, split_chunks=True) for t in ladder]
  if importlib.util.find_spec("jax_triton"):
    plans.append(dataclasses.replace(plans[0], kernel=Kernel.JAX_TRITON))
  chosen = matmul_plan.plan(layout, rows, cols, contraction, dtype=dtype, out_dtype=dtype,
                            device=device)
  if chosen.pitch_padded:
    sizes = matmul_plan.pitch_padded_sizes(layout, rows, cols, contraction)
    plans += [dataclasses.replace(p, pitch_padded=True)
              for p in _every_plan(layout, *sizes, dtype, device=device)
              if p.kernel in (Kernel.MOSAIC_GPU, chosen.kernel)]
  elif (chosen.kernel is Kernel.MOSAIC_GPU and chosen.tiles.streams
        and rows <= matmul_plan.STREAM_ROWS):
    plans.append(chosen)  # the stream tiles, the one Mosaic GPU tile of these rows
  elif chosen.kernel is Kernel.MOSAIC_GPU:
    if chosen.tiles.streams:
      plans.append(chosen)  # a share of the rows (matmul_plan.row_stream_tiles)
    lhs_aligned, rhs_aligned = hopper.lines_aligned(layout, rows, cols, contraction)
    candidates = matmul_plan.mosaic_tile_candidates(
        rhs_aligned, transposed=hopper.transposed_takes(layout, dtype), lhs_aligned=lhs_aligned,
        chunked=chunk is not None)
    plans += [matmul_plan.Plan(Kernel.MOSAIC_GPU, kernels.fit_stages(
                  matmul_plan.mosaic_strips(t, rows, cols, contraction), dtype, dtype),
                               contraction_chunk=chunk)
              for t in candidates if t.fits(rows, cols)]
    if chunk is not None:
      plans += [matmul_plan.Plan(Kernel.MOSAIC_GPU, kernels.fit_stages(t, dtype, jnp.float32),
                                 contraction_chunk=chunk, split_chunks=True)
                for t in matmul_plan.mosaic_tile_candidates(rhs_aligned, lhs_aligned=lhs_aligned)
                if t.fits(rows, cols)]
  return plans


# The transposed tiles' row counts the GPU envelope runs: the smallest and the
# largest, and between them tiles of 6, 5, 4 and 3 stages. A transposed tile's
# row count is wgmma's N, which changes no sum: 148 runs of these tiles at 21
# shapes gave the plain tiles' bits (benchmarks/results/h100.md, thirty-fourth
# session), so the envelope samples them rather than compiling each of the 39
# at full size.
TRANSPOSED_SAMPLE_ROWS = (72, 104, 152, 200, 256)


def _sampled(plans):
  """``plans`` without the two-consumer transposed Mosaic GPU tiles whose row
  count is not in TRANSPOSED_SAMPLE_ROWS (the stream tiles, one consumer, all
  stay: the few rows they serve compile and run fast)."""
  return [p for p in plans if not getattr(p.tiles, "transposed", False)
          or p.tiles.block_m in TRANSPOSED_SAMPLE_ROWS or p.tiles.streams]


def test_envelope_plan_list_holds_every_plan_choice():
  """The plans the GPU envelope compares (:func:`_every_plan`) include the one
  plan() makes on an H100 for each layout over a grid of sizes, so the GPU sweep
  covers every kernel and tile the plan can choose, grouped GEMMs' included."""
  for layout, groups in itertools.product(Layout, (1, 8)):
    for rows in (1, 16, 64, 129, 200, 300, 1000, 4096):
      for cols in (192, 727, 1000, 3000, 4096, 32000):
        for contraction in (300, 1000, 2048, 2187, 3000, 4096, 6144):
          chosen = _plan(layout, rows, cols, contraction, groups=groups)
          assert chosen in _every_plan(layout, rows, cols, contraction, bf16, device=H100), (
              layout, groups, rows, cols, contraction, chosen)


def test_envelope_runs_mosaic_steps_in_flight_and_waited():
  """The GPU envelope's Mosaic GPU plans (:func:`_every_plan` at EVERY_PLAN_KN,
  forward, dA and dB) include tiles whose consumers leave a step's wgmma in flight
  (``hopper_matmul.IN_FLIGHT_MIN_STAGES`` stages or more) and tiles that wait for
  each step, so the bit comparisons run both consumer loops."""
  stage_counts = set()
  for k, n in EVERY_PLAN_KN:
    for layout, rows, cols, contraction in ((Layout.NN, GPU_SWEEP_ROWS, n, k),
                                            (Layout.NT, GPU_SWEEP_ROWS, k, n),
                                            (Layout.TN, k, n, GPU_SWEEP_ROWS)):
      stage_counts |= {min(p.tiles.num_stages, kernels.cdiv(contraction, kernels.BLOCK_K))
                       for p in _sampled(_every_plan(layout, rows, cols, contraction, bf16,
                                                     device=H100))
                       if p.kernel is Kernel.MOSAIC_GPU}
  assert max(stage_counts) >= hopper.IN_FLIGHT_MIN_STAGES > min(stage_counts), stage_counts


@functools.cache
def _plans_taken(rows_limit: int, cols: int, contraction: int, layout) -> dict:
  """Each plan (kernel and tiles) jdet.matmul takes for the forward or dA at some
  row count up to ``rows_limit``, with the smallest row count that takes it."""
  first = {}
  for m in range(1, rows_limit + 1):
    first.setdefault(_plan(layout, m, cols, contraction, device=None), m)
  return first


# Weights at which the envelope compares every plan the plan could make, not only
# those it takes for that weight: aligned, unaligned K and N, and 64 columns.
EVERY_PLAN_KN = ((4096, 4096), (1000, 3000), (64, 192))
# And the weights at which it compares the plans jdet.matmul takes: the mirrored
# unaligned weight, a long contraction, a 64-misaligned result, few columns, rows
# of odd length (deep steps, chunks that end in a single deep step), and a chunk
# and a tail summed in each program of the stream tiles up to STREAM_ROWS rows.
ENVELOPE_KN = EVERY_PLAN_KN + ((3000, 1000), (14336, 4096), (5120, 13824), (192, 320),
                               (4096, 512), (3373, 727), (7232, 1856))


def _gpu_every_kernel_agrees(k, n, dtype=jnp.bfloat16):
  """Full-size forward, dA and dB from every plan (:func:`_every_plan`) for the
  weights in EVERY_PLAN_KN, else from every plan jdet.matmul takes for this weight
  at some row count. Asserts they all agree and returns (a, b, g, forward, dA, dB)."""
  rng = np.random.default_rng(5)
  a = random_normal(rng, (GPU_SWEEP_ROWS, k), dtype)
  b = random_normal(rng, (k, n), dtype)
  g = random_normal(rng, (GPU_SWEEP_ROWS, n), dtype)
  operands = {"forward": (Layout.NN, a, b), "dA": (Layout.NT, g, b), "dB": (Layout.TN, a, g)}
  results = {}
  for name, (layout, lhs, rhs) in operands.items():
    rows = lhs.shape[1] if layout is Layout.TN else lhs.shape[0]
    cols = rhs.shape[0] if layout is Layout.NT else rhs.shape[1]
    contraction = lhs.shape[0] if layout is Layout.TN else lhs.shape[1]
    plans = _sampled(_every_plan(layout, rows, cols, contraction, jnp.dtype(dtype)))
    if (k, n) not in EVERY_PLAN_KN:  # dB's plan sees the weight's sizes, not the token count
      taken = ({_plan(layout, rows, cols, contraction, device=None)} if layout is Layout.TN
               else _plans_taken(GPU_SWEEP_ROWS, cols, contraction, layout))
      plans = [p for p in plans if p in taken]
    run = lambda p: matmul_plan.launch(p, lhs[None], rhs[None], layout=layout,
                                       out_dtype=dtype)[0]
    reference = np.asarray(run(plans[0]))
    for p in plans[1:]:
      assert_bitwise_equal(run(p), reference, what=f"{name}, {p} vs {plans[0]}")
    results[name] = reference
  return a, b, g, results["forward"], results["dA"], results["dB"]


@pytest.mark.gpu
@pytest.mark.long
@pytest.mark.parametrize("k,n", ENVELOPE_KN)
def test_gpu_invariance_envelope_every_kernel(k, n):
  """Every kernel and tile the plan can choose gives the same bits at full size,
  forward, dA and dB, and every plan jdet.matmul takes for M from 1 to 16411 gives
  a prefix of them (each at the smallest M that takes it, plus edge sizes); of the
  transposed Mosaic GPU tiles, those at TRANSPOSED_SAMPLE_ROWS."""
  a, b, g, forward, da_reference, db_reference = _gpu_every_kernel_agrees(k, n)
  taken = [_plans_taken(GPU_SWEEP_ROWS, n, k, Layout.NN), _plans_taken(GPU_SWEEP_ROWS, k, n,
                                                                       Layout.NT)]
  sizes = sorted({1, 7, 777, 4097, GPU_SWEEP_ROWS}
                 | {plans[p] for plans in taken for p in _sampled(plans)})
  for m in sizes:
    assert_bitwise_equal(mm(a[:m], b), forward[:m], what=f"forward M={m}")
    assert_bitwise_equal(mm_da(a[:m], b, g[:m]), da_reference[:m], what=f"dA M={m}")
  _, db = mm_grads(a, b, g)
  assert_bitwise_equal(db, db_reference, what="dB")
  for i in range(0, GPU_SWEEP_ROWS, 1999):
    assert_bitwise_equal(mm(a[i:i + 1], b), forward[i:i + 1], what=f"row {i} alone")


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 4096), (14336, 4096), (1000, 3000)])
def test_gpu_db_deterministic_and_unchanged_by_zero_cotangent_rows(k, n):
  """dB is run-to-run deterministic and unchanged by appended rows whose
  cotangent is zero, for row counts on both sides of every 8- and 64-row step."""
  rng = np.random.default_rng(7)
  total = 4161
  a, b, g = (random_normal(rng, (total, k), jnp.bfloat16), random_normal(rng, (k, n), jnp.bfloat16),
             random_normal(rng, (total, n), jnp.bfloat16))
  assert_deterministic(mm_grads, a, b, g, runs=5)
  for m in (1, 7, 8, 9, 63, 64, 65, 1000, 4096):
    _, db = mm_grads(a[:m], b, g[:m])
    zero_rows = jnp.concatenate([g[:m], jnp.zeros_like(g[m:])])
    _, db_padded = mm_grads(a, b, zero_rows)
    assert_bitwise_equal(db_padded, db, what=f"dB, M={m} plus {total - m} zero-cotangent rows")


@pytest.mark.gpu
def test_gpu_deep_steps_give_the_64_deep_bits():
  """128- and 256-deep steps (``MatmulTiles.step_k``) give the 64-deep steps'
  bits, in each tile's program and with the chunks split, over contractions
  and chunks that end in a single deep step (run as 64-deep steps:
  ``MIN_DEEP_STEPS``), in two, or in single and partial steps, on the 16 x 16
  tile at its 2 warps and at the SYNC_LOAD_MIN_WARPS of rows of odd length
  (2467 indices here), on 16 x 64 at SYNC_LOAD_WIDE_WARPS and on 64 x 16;
  NN and NT, every plan against one."""
  rng = np.random.default_rng(10)
  for rows, contraction, cols, chunk in ((8, 2944, 1328, 2816), (56, 3072, 1328, 2816),
                                         (8, 2467, 1328, 1024), (56, 448, 96, None)):
    lhs = random_normal(rng, (1, rows, contraction), jnp.bfloat16)
    rhs = random_normal(rng, (1, contraction, cols), jnp.bfloat16)
    for layout, operand in ((Layout.NN, rhs), (Layout.NT, jnp.swapaxes(rhs, 1, 2))):
      plans = [matmul_plan.Plan(Kernel.PALLAS_TRITON, kernels.fit_stages(
                   dataclasses.replace(tiles, step_k=step_k), jnp.bfloat16,
                   jnp.float32 if split else jnp.bfloat16),
                                contraction_chunk=chunk, split_chunks=split)
               for tiles, split, step_k in itertools.product(
                   (kernels.MatmulTiles(16, 16, 2, 10),
                    kernels.MatmulTiles(16, 16, matmul_plan.SYNC_LOAD_MIN_WARPS, 10),
                    kernels.MatmulTiles(16, 64, matmul_plan.SYNC_LOAD_WIDE_WARPS, 10),
                    kernels.MatmulTiles(64, 16, 4, 10)),
                   (False, True) if chunk else (False,),
                   (kernels.BLOCK_K, kernels.STREAMED_STEP_K, kernels.DEEP_STEP_K))]
      run = lambda p: matmul_plan.launch(p, lhs, operand, layout=layout,
                                         out_dtype=jnp.bfloat16)
      reference = run(plans[0])
      for p in plans[1:]:
        assert_bitwise_equal(run(p), reference, what=f"{layout.name} {rows} x {contraction} "
                             f"x {cols} in chunks of {chunk}, {p} vs {plans[0]}")


@pytest.mark.gpu
def test_gpu_pitch_padded_plans_give_the_unpadded_bits():
  """Above 16 rows, a forward and a dA whose operand rows miss 16 bytes run on
  copies padded to 16-byte pitches (``matmul_plan.pitch_padded_plan``): of a 6351 x
  4657 weight at 17, 48 and 64 rows on the Mosaic GPU kernel's stream tiles; the dA
  (NT) at 64 rows into a result wider than one wave of them (8457 columns) on the
  Triton ladder. jdet.matmul gives the bits of the unpadded Triton ladder plan and
  of the same rows in a 4096-row GEMM."""
  rng = np.random.default_rng(11)
  many = 4096
  streamed = [(rows, name, Kernel.MOSAIC_GPU) for rows in (17, 48, 64)
              for name in ("forward", "dA")]
  past_a_wave = [(64, "dA", Kernel.PALLAS_TRITON)]
  for (k, n), cases in (((6351, 4657), streamed), ((8457, 1031), past_a_wave)):
    a = random_normal(rng, (many, k), bf16)
    b = random_normal(rng, (k, n), bf16)
    g = random_normal(rng, (many, n), bf16)
    forward, da = mm(a, b), mm_da(a, b, g)
    for rows, name, kernel in cases:
      layout, lhs, cols, contraction, got, want = (
          (Layout.NN, a[:rows], n, k, mm(a[:rows], b), forward[:rows]) if name == "forward" else
          (Layout.NT, g[:rows], k, n, mm_da(a[:rows], b, g[:rows]), da[:rows]))
      chosen = _plan(layout, rows, cols, contraction, device=None)
      assert chosen.pitch_padded and chosen.kernel is kernel, (name, rows, chosen)
      ladder = dataclasses.replace(chosen, kernel=Kernel.PALLAS_TRITON, pitch_padded=False,
                                   tiles=matmul_plan.triton_tiles(
                                       layout, rows, cols, bf16, bf16, contraction=contraction,
                                       chunked=chosen.contraction_chunk is not None))
      unpadded = matmul_plan.launch(ladder, lhs[None], b[None], layout=layout, out_dtype=bf16)
      assert_bitwise_equal(got, unpadded[0], what=f"{name} M={rows} against {ladder}")
      assert_bitwise_equal(got, want, what=f"{name} M={rows} against M={many}")


@pytest.mark.gpu
def test_gpu_column_strips_give_the_row_strips_bits():
  """A short contraction into a wide result walks column strips
  (``matmul_plan.mosaic_strips``): dB over 300 tokens and a forward over 256
  give the bits of the row strips."""
  rng = np.random.default_rng(9)
  for layout, (contraction, rows, cols) in ((Layout.TN, (300, 1024, 8192)),
                                            (Layout.NN, (256, 1024, 8192))):
    lhs_shape = (contraction, rows) if layout is Layout.TN else (rows, contraction)
    lhs = random_normal(rng, lhs_shape, jnp.bfloat16)[None]
    rhs = random_normal(rng, (contraction, cols), jnp.bfloat16)[None]
    plan = _plan(layout, rows, cols, contraction, device=None)
    assert (plan.tiles.strip_dim, plan.tiles.strip_width) == (1, hopper.COLUMN_STRIP_WIDTH)
    run = lambda p: matmul_plan.launch(p, lhs, rhs, layout=layout, out_dtype=jnp.bfloat16)
    assert_bitwise_equal(run(plan), run(_in_row_strips(plan)), what=f"{layout.name} column strips")


@pytest.mark.gpu
def test_gpu_mosaic_kernel_under_vmap_and_other_dtypes():
  """Under vmap the Mosaic GPU kernel's GEMMs give the bits of the unbatched calls
  (shared b folds into rows; a batched b or a dB batch becomes groups), and
  float16 inputs and a float32 result match the Triton kernel."""
  rng = np.random.default_rng(8)
  k, n = 1024, 3072
  a3, b3, g3 = (random_normal(rng, shape, jnp.bfloat16)
                for shape in ((3, 1100, k), (3, k, n), (3, 1100, n)))
  assert _plan(Layout.NN, 1100, n, k, device=None).kernel is Kernel.MOSAIC_GPU
  shared = jax.jit(jax.vmap(jdet.matmul, in_axes=(0, None)))(a3, b3[0])
  batched = jax.jit(jax.vmap(jdet.matmul))(a3, b3)
  per_example = jax.jit(jax.vmap(mm_grads, in_axes=(0, None, 0)))(a3, b3[0], g3)
  for i in range(3):
    assert_bitwise_equal(shared[i], mm(a3[i], b3[0]), what=f"vmap shared b, entry {i}")
    assert_bitwise_equal(batched[i], mm(a3[i], b3[i]), what=f"vmap batched b, entry {i}")
    assert_bitwise_equal(jax.tree.map(lambda x: x[i], per_example),
                         mm_grads(a3[i], b3[0], g3[i]), what=f"per-example grads, entry {i}")
  a, b = a3[0], b3[0]
  for dtype, out_dtype in ((jnp.float16, jnp.float16), (jnp.bfloat16, jnp.float32)):
    got = jdet.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)
    want = kernels.matmul(
        a.astype(dtype)[None], b.astype(dtype)[None], transpose_b=False, out_dtype=out_dtype,
        precision=None, tiles=kernels.GPU_MATMUL_LADDER[0], interpret=False)[0]
    assert_bitwise_equal(got, want, what=f"{jnp.dtype(dtype).name} in, "
                                         f"{jnp.dtype(out_dtype).name} out")


@pytest.mark.gpu
def test_gpu_float32_large_tiles_fit_and_match_fewer_stages():
  """float32 at large M (128 x 256 tiles) fits shared memory, with any stage count."""
  rng = np.random.default_rng(6)
  a, b = random_normal(rng, (2048, 1024)), random_normal(rng, (1024, 2048))
  hi = jax.lax.Precision.HIGHEST
  out = jdet.matmul(a, b, precision=hi)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert np.abs(np.asarray(out) - ref).max() < TOLERANCE[jnp.float32] * np.abs(ref).max()
  da, db = jax.grad(lambda a, b: jnp.sum(jdet.matmul(a, b, precision=hi) ** 2), (0, 1))(a, b)
  assert np.isfinite(np.asarray(da)).all() and np.isfinite(np.asarray(db)).all()
  tiles = _plan(Layout.NN, 2048, 2048, 1024, jnp.dtype(jnp.float32), device=None).tiles
  launch = functools.partial(kernels.matmul, transpose_b=False, out_dtype=jnp.float32,
                             precision=hi, interpret=False)
  fewer = dataclasses.replace(tiles, num_stages=1)
  assert_bitwise_equal(launch(a[None], b[None], tiles=fewer)[0], out, what="1 stage vs fitted")
