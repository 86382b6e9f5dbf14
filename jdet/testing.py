"""Bitwise invariance checks for functions built on jdet (or on anything else).

Use them in pytest like any assertion::

    def test_my_layer_is_batch_invariant():
      x = jax.random.normal(jax.random.key(0), (64, 512))
      jdet.testing.assert_batch_invariant(lambda x: my_layer(params, x), x)

For per-example gradients, check the function that returns them, e.g.
``jax.vmap(jax.grad(loss), in_axes=(None, 0))`` or
``lambda x: jax.grad(lambda x: loss(x).sum())(x)`` (each row's gradient
depends on its own row only).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["assert_batch_invariant", "assert_deterministic", "assert_bitwise_equal",
           "bits", "relative_error"]


def bits(x) -> np.ndarray:
  """The array's raw bits as unsigned integers (+0.0 and -0.0 differ; NaN == NaN)."""
  x = np.asarray(x)
  if x.dtype.kind in "fc" or x.dtype.name in ("bfloat16", "float16"):
    return x.view(f"u{x.dtype.itemsize}")
  return x


def relative_error(got, want) -> float:
  """max |got - want| / max |want| in float64: the accuracy measure of jdet's
  tests, checks and benchmarks (0 for an all-zero or empty ``want`` matched exactly)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.size == 0 and want.size == 0:
    return 0.0
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _leaves(tree):
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(jax.tree_util.keystr(p) or "<output>", np.asarray(v)) for p, v in paths_and_leaves]


def assert_bitwise_equal(actual, expected, *, what: str = "") -> None:
  """Asserts two pytrees of arrays have the same structure, shapes and bits."""
  got, want = _leaves(actual), _leaves(expected)
  if [p for p, _ in got] != [p for p, _ in want]:
    raise AssertionError(f"{what}: output structures differ: {[p for p, _ in got]} "
                         f"vs {[p for p, _ in want]}")
  for (path, x), (_, y) in zip(got, want):
    if x.shape != y.shape or x.dtype != y.dtype:
      raise AssertionError(f"{what}: leaf {path} is {x.dtype}{list(x.shape)}, "
                           f"expected {y.dtype}{list(y.shape)}")
    bx, by = bits(x), bits(y)
    if not np.array_equal(bx, by):
      diff = np.argwhere(bx != by)
      first = tuple(int(i) for i in diff[0])
      with np.errstate(invalid="ignore"):
        max_abs = float(np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64))))
      raise AssertionError(
          f"{what}: leaf {path} differs in {len(diff)} of {bx.size} elements; first at "
          f"index {first}: {x[first]!r} vs {y[first]!r}; max abs difference {max_abs:.3g}")


def _normalize_axes(in_axes, n_args):
  if isinstance(in_axes, (int, type(None))):
    return (in_axes,) * n_args
  if len(in_axes) != n_args:
    raise ValueError(f"in_axes has {len(in_axes)} entries for {n_args} arguments")
  return tuple(in_axes)


def _take(args, axes, index):
  return tuple(a if ax is None else jax.tree.map(lambda x: _slice(x, ax, index), a)
               for a, ax in zip(args, axes))


def _slice(x, axis, index):
  return jnp.asarray(x)[(slice(None),) * (axis % jnp.ndim(x)) + (index,)]


def _out_slice(tree, out_axis, index):
  return jax.tree.map(lambda x: _slice(x, out_axis, index), tree)


def assert_batch_invariant(
    fn: Callable[..., Any],
    *args,
    in_axes: int | None | Sequence[int | None] = 0,
    out_axis: int = 0,
    batch_sizes: Sequence[int] = (1, 2, 3, 7, 16, 17),
    single_rows: Sequence[int] | None = None,
    pad: int = 5,
    vmap_splits: Sequence[int] = (2,),
) -> None:
  """Asserts each example's outputs are bitwise the same in every batch it sits in.

  ``fn`` is jitted and run on the full batch (``args`` batched along their
  ``in_axes`` entry; ``None`` marks a shared argument) and then on:
  a prefix and a suffix slice of each size in ``batch_sizes``; each example in
  ``single_rows`` alone (default: first, middle, last); the batch with ``pad``
  extra examples appended (copies of the batch reversed, so they are not zeros);
  and ``jax.vmap`` over a new leading axis that splits the batch into each of
  ``vmap_splits`` equal chunks. Every output leaf must be batched along
  ``out_axis``. Raises AssertionError naming the leaf, the batch sizes that
  disagree, the first differing index and the max abs difference.
  """
  axes = _normalize_axes(in_axes, len(args))
  sizes = {jax.tree.leaves(a)[0].shape[ax] for a, ax in zip(args, axes) if ax is not None}
  if len(sizes) != 1:
    raise ValueError(f"batched arguments must share one batch size, got {sorted(sizes)}")
  (total,) = sizes
  jfn = jax.jit(fn)
  full = jfn(*args)

  def compare(sub_args, index, label):
    assert_bitwise_equal(jfn(*sub_args), _out_slice(full, out_axis, index),
                         what=f"batch of {total} vs {label}")

  for size in sorted({s for s in batch_sizes if 0 < s <= total}):
    compare(_take(args, axes, slice(0, size)), slice(0, size), f"prefix of {size}")
    compare(_take(args, axes, slice(total - size, total)), slice(total - size, total),
            f"slice [{total - size}:{total}] of {size}")
  rows = single_rows if single_rows is not None else sorted({0, total // 2, total - 1})
  for i in rows:
    compare(_take(args, axes, slice(i, i + 1)), slice(i, i + 1), f"row {i} alone")
  if pad:
    flipped = _take(args, axes, slice(None, None, -1))
    extra = _take(flipped, axes, slice(0, pad))
    padded = tuple(a if ax is None else jax.tree.map(
        lambda x, e, ax=ax: jnp.concatenate([x, e], axis=ax), a, p)
        for a, p, ax in zip(args, extra, axes))
    assert_bitwise_equal(_out_slice(jfn(*padded), out_axis, slice(0, total)), full,
                         what=f"batch of {total} vs padded batch of {total + pad}")
  for splits in vmap_splits:
    if splits < 1 or total % splits:
      continue
    split_args = tuple(a if ax is None else jax.tree.map(
        lambda x, ax=ax: jnp.reshape(jnp.moveaxis(x, ax, 0), (splits, -1) + x.shape[:ax]
                                     + x.shape[ax + 1:]), a)
        for a, ax in zip(args, axes))
    vm_axes = tuple(None if ax is None else 0 for ax in axes)
    moved = jax.jit(jax.vmap(lambda *xs: _moveaxis_tree(fn(*_restore(xs, axes)), out_axis),
                             in_axes=vm_axes))(*split_args)
    merged = jax.tree.map(lambda x: jnp.moveaxis(x.reshape((total,) + x.shape[2:]), 0,
                                                 out_axis), moved)
    assert_bitwise_equal(merged, full,
                         what=f"batch of {total} vs vmap over {splits} chunks of "
                              f"{total // splits}")


def _restore(xs, axes):
  return tuple(x if ax is None else jax.tree.map(lambda y, ax=ax: jnp.moveaxis(y, 0, ax), x)
               for x, ax in zip(xs, axes))


def _moveaxis_tree(tree, axis):
  return jax.tree.map(lambda y: jnp.moveaxis(y, axis, 0), tree)


def assert_deterministic(fn: Callable[..., Any], *args, runs: int = 10) -> None:
  """Asserts ``jax.jit(fn)(*args)`` gives the same bits on every one of ``runs`` runs."""
  jfn = jax.jit(fn)
  first = jax.block_until_ready(jfn(*args))
  for run in range(1, runs):
    assert_bitwise_equal(jfn(*args), first, what=f"run {run} vs run 0")
