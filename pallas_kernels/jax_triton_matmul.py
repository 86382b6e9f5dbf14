"""``Kernel.JAX_TRITON``: the Triton GEMM of :mod:`pallas_kernels.triton_matmul`
launched by jax-triton (``jdet.matmul(..., backend="triton")``).

``jax_triton.triton_call`` has no batching rule, so each launcher is a
``jax.custom_batching.custom_vmap`` that folds the mapped axis into the
kernel's group axis (or, where ``b`` is shared, into its rows): either way a
row's arithmetic is unchanged, so the bits are those of the unbatched call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import BLOCK_K

INSTALL_HINT = ("python3 -m pip install 'jdet[triton]' (jax-triton >= 0.3.1 with triton >= 3.6, "
                "and a CUDA build of jax: 'jdet[cuda,triton]')")


def load():
  """Imports jax_triton and the Triton kernels, or raises ImportError saying how to install them."""
  try:
    import jax_triton
    from pallas_kernels import triton_matmul
  except ImportError as err:
    raise ImportError(
        f"jdet.matmul(..., backend='triton') needs jax-triton and triton: {INSTALL_HINT}. "
        f"Import failed with: {err}") from err
  return jax_triton, triton_matmul


def _check_steps(tiles):
  """The Triton kernel loads BLOCK_K-deep steps only (``MatmulTiles.step_k`` is the
  Pallas Triton kernel's); refuses other tiles rather than running them with stages
  fitted to deeper steps."""
  if tiles.step_k != BLOCK_K:
    raise ValueError(f"the jax-triton kernel takes step_k = {BLOCK_K} tiles, got {tiles}")


def matmul(a, b, *, transpose_b: bool, out_dtype, precision, tiles,
           contraction_chunk: int | None = None):
  """Same contract and shapes as :func:`pallas_kernels.matmul.matmul`, on the Triton kernel.

  a: [G, M, K]; b: [Gb, K, N] (or [Gb, N, K] if transpose_b), Gb in {1, G}.
  ``contraction_chunk``: K summed in chunks (``pallas_kernels.matmul.contraction_loop``).
  """
  _check_steps(tiles)
  return _matmul_launcher(transpose_b, jnp.dtype(out_dtype), precision, tiles,
                          contraction_chunk)(a, b)


def matmul_at_b(a, d, *, out_dtype, precision, tiles):
  """Same contract and shapes as :func:`pallas_kernels.matmul.matmul_at_b`, on Triton."""
  _check_steps(tiles)
  return _at_b_launcher(jnp.dtype(out_dtype), precision, tiles)(a, d)


@functools.cache
def _matmul_launcher(transpose_b, out_dtype, precision, tiles, contraction_chunk):
  jax_triton, triton_matmul = load()

  @jax.custom_batching.custom_vmap
  def launch(a, b):
    g, m, k = a.shape
    n = b.shape[1] if transpose_b else b.shape[2]
    grid, params = triton_matmul.matmul_launch(
        g, m, n, k, transpose_b=transpose_b, shared_b=b.shape[0] == 1, tiles=tiles,
        precision=precision, contraction_chunk=contraction_chunk)
    return jax_triton.triton_call(
        a, b, kernel=triton_matmul.matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((g, m, n), out_dtype), grid=grid,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        name="jdet_triton_matmul_t" if transpose_b else "jdet_triton_matmul", **params)

  @launch.def_vmap
  def launch_batched(axis_size, in_batched, a, b):
    a_batched, b_batched = in_batched
    g, m = a.shape[-3:-1]
    if not a_batched:
      a = jnp.broadcast_to(a, (axis_size, *a.shape))
    if not b_batched and b.shape[0] != 1:
      # b is one [Gb = G] set shared by the mapped axis: the mapped axis becomes rows.
      rows = jnp.swapaxes(a, 0, 1).reshape(g, axis_size * m, -1)
      out = launch(rows, b)
      return jnp.swapaxes(out.reshape(g, axis_size, m, -1), 0, 1), True
    if not b_batched:
      return launch(a.reshape(axis_size * g, m, -1), b).reshape(axis_size, g, m, -1), True
    if b.shape[1] == 1 and g != 1:
      # Each mapped entry shares one b across its G groups: its groups become rows.
      out = launch(a.reshape(axis_size, g * m, -1), b.reshape(axis_size, *b.shape[2:]))
      return out.reshape(axis_size, g, m, -1), True
    flat_b = b.reshape(axis_size * b.shape[1], *b.shape[2:])
    return launch(a.reshape(axis_size * g, m, -1), flat_b).reshape(axis_size, g, m, -1), True

  return launch


@functools.cache
def _at_b_launcher(out_dtype, precision, tiles):
  jax_triton, triton_matmul = load()

  @jax.custom_batching.custom_vmap
  def launch(a, d):
    g, r, k = a.shape
    n = d.shape[2]
    grid, params = triton_matmul.matmul_at_b_launch(g, r, k, n, tiles=tiles,
                                                    precision=precision)
    return jax_triton.triton_call(
        a, d, kernel=triton_matmul.matmul_at_b_kernel,
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype), grid=grid,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        name="jdet_triton_matmul_at_b", **params)

  @launch.def_vmap
  def launch_batched(axis_size, in_batched, a, d):
    # The reduction runs over rows, so the mapped axis may only join the groups.
    a, d = (x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip((a, d), in_batched))
    g = a.shape[1]
    out = launch(a.reshape(axis_size * g, *a.shape[2:]), d.reshape(axis_size * g, *d.shape[2:]))
    return out.reshape(axis_size, g, *out.shape[1:]), True

  return launch
