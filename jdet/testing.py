"""Bitwise invariance checks for functions built on jdet (or on anything else).

``audit(fn, *args)`` reads ``fn``'s jaxpr and lists the operations outside
jdet's ops that can make a result depend on the batch; the assertions run
``fn`` and compare bits. Use them in pytest like any assertion::

    def test_my_layer_is_batch_invariant():
      x = jax.random.normal(jax.random.key(0), (64, 512))
      jdet.testing.assert_batch_invariant(lambda x: my_layer(params, x), x)

For per-example gradients, check the function that returns them, e.g.
``jax.vmap(jax.grad(loss), in_axes=(None, 0))`` or
``lambda x: jax.grad(lambda x: loss(x).sum())(x)`` (each row's gradient
depends on its own row only).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import os
import sysconfig
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from pallas_kernels import clear_interpret_executables, synchronous_cpu_dispatch

__all__ = ["assert_batch_invariant", "assert_deterministic", "assert_bitwise_equal",
           "audit", "Finding", "bits", "cuda_lowering_available", "random_normal",
           "relative_error", "release_compiled_programs", "synchronous_cpu_dispatch"]


def release_compiled_programs() -> None:
  """Drops jax's compiled programs and jdet's interpret-mode kernels. Every compiled
  XLA:CPU program keeps JIT code mapped, and a process may map only so many regions
  (vm.max_map_count): a long CPU run that compiles new shapes (a test suite, the
  fuzz) must release them now and then, or a later compile fails."""
  jax.clear_caches()
  clear_interpret_executables()


def bits(x) -> np.ndarray:
  """The array's raw bits as unsigned integers (+0.0 and -0.0 differ; NaN == NaN)."""
  x = np.asarray(x)
  if x.dtype.kind in "fc" or x.dtype.name in ("bfloat16", "float16"):
    return x.view(f"u{x.dtype.itemsize}")
  return x


def random_normal(seed: int | np.random.Generator, shape, dtype=jnp.float32) -> jax.Array:
  """Standard-normal test input: drawn in float32 by NumPy (from a seed or a
  ``np.random.Generator``), then cast to ``dtype``. The one input builder of
  jdet's tests, checks and benchmarks."""
  rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


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
    compile_workers: int = 1,
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

  ``compile_workers > 1`` first compiles every batch shape's program ahead of time
  on that many threads (XLA compiles without the GIL): the same comparisons in
  less wall time where compilation dominates, as on a GPU with many cores.
  """
  axes = _normalize_axes(in_axes, len(args))
  sizes = {jax.tree.leaves(a)[0].shape[ax] for a, ax in zip(args, axes) if ax is not None}
  if len(sizes) != 1:
    raise ValueError(f"batched arguments must share one batch size, got {sorted(sizes)}")
  (total,) = sizes
  jfn = jax.jit(fn)
  keep = lambda out: out
  # (jitted program, its arguments, what turns its output into the full batch's
  # slice ``part``, part, label)
  runs = []
  for size in sorted({s for s in batch_sizes if 0 < s <= total}):
    for part in (slice(0, size), slice(total - size, total)):
      runs.append((jfn, _take(args, axes, part), keep, part,
                   f"prefix of {size}" if part.start == 0 else f"slice [{part.start}:{total}] "
                   f"of {size}"))
  rows = single_rows if single_rows is not None else sorted({0, total // 2, total - 1})
  for i in rows:
    runs.append((jfn, _take(args, axes, slice(i, i + 1)), keep, slice(i, i + 1),
                 f"row {i} alone"))
  if pad:
    flipped = _take(args, axes, slice(None, None, -1))
    extra = _take(flipped, axes, slice(0, pad))
    padded = tuple(a if ax is None else jax.tree.map(
        lambda x, e, ax=ax: jnp.concatenate([x, e], axis=ax), a, p)
        for a, p, ax in zip(args, extra, axes))
    runs.append((jfn, padded, lambda out: _out_slice(out, out_axis, slice(0, total)),
                 slice(0, total), f"padded batch of {total + pad}"))
  vm_axes = tuple(None if ax is None else 0 for ax in axes)
  vmapped = jax.jit(jax.vmap(lambda *xs: _moveaxis_tree(fn(*_restore(xs, axes)), out_axis),
                             in_axes=vm_axes))
  for splits in vmap_splits:
    if splits < 1 or total % splits:
      continue
    split_args = tuple(a if ax is None else jax.tree.map(
        lambda x, ax=ax: jnp.reshape(jnp.moveaxis(x, ax, 0), (splits, -1) + x.shape[:ax]
                                     + x.shape[ax + 1:]), a)
        for a, ax in zip(args, axes))
    merge = lambda moved: jax.tree.map(
        lambda x: jnp.moveaxis(x.reshape((total,) + x.shape[2:]), 0, out_axis), moved)
    runs.append((vmapped, split_args, merge, slice(0, total),
                 f"vmap over {splits} chunks of {total // splits}"))
  if compile_workers > 1:
    _compile_ahead([(jfn, args)] + [(program, run_args) for program, run_args, *_ in runs],
                   compile_workers)
  full = jfn(*args)
  for program, run_args, finish, part, label in runs:
    assert_bitwise_equal(finish(program(*run_args)), _out_slice(full, out_axis, part),
                         what=f"batch of {total} vs {label}")


def _compile_ahead(programs, workers: int) -> None:
  """Compiles each distinct (jitted fn, argument shapes) once, on ``workers`` threads;
  jax keeps the executables, so the calls that follow only run."""
  distinct = {}
  for jitted, call_args in programs:
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), call_args)
    distinct.setdefault((id(jitted), str(shapes)), (jitted, call_args))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for done in [pool.submit(lambda j, a: j.lower(*a).compile(), *p)
                 for p in distinct.values()]:
      done.result()


def _restore(xs, axes):
  return tuple(x if ax is None else jax.tree.map(lambda y, ax=ax: jnp.moveaxis(y, 0, ax), x)
               for x, ax in zip(xs, axes))


def _moveaxis_tree(tree, axis):
  return jax.tree.map(lambda y: jnp.moveaxis(y, axis, 0), tree)


def cuda_lowering_available() -> bool:
  """Whether this jax can lower programs for an NVIDIA GPU (``lowering_platforms=
  ("cuda",)``) on this machine, GPU or not."""
  try:
    jax.jit(lambda x: x).trace(jnp.zeros(1)).lower(lowering_platforms=("cuda",))
    return True
  except Exception:  # noqa: BLE001 - no CUDA lowering rules installed
    return False


def lowered_triton_kernels(fn: Callable[..., Any], *args) -> list[str]:
  """What XLA compiles ``jax.jit(fn)(*args)``'s Triton kernels from, lowered for an
  NVIDIA GPU on any machine (``args`` may be ``jax.ShapeDtypeStruct``): each
  Triton call's backend config (the kernel's IR, its grid and warps), in program
  order, without the operands. Two programs whose lists agree run the same compiled
  kernels, and XLA's kernel cache can serve one from the other."""
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "@__gpu$xla.gpu.triton(" in line]
  return [line[line.index("{"):].rsplit(" : ", 1)[0] for line in calls]


def assert_deterministic(fn: Callable[..., Any], *args, runs: int = 10) -> None:
  """Asserts ``jax.jit(fn)(*args)`` gives the same bits on every one of ``runs`` runs."""
  jfn = jax.jit(fn)
  first = jax.block_until_ready(jfn(*args))
  for run in range(1, runs):
    assert_bitwise_equal(jfn(*args), first, what=f"run {run} vs run 0")


_REDUCTION_HINT = ("XLA may change this sum's order with the batch shape: use the jdet op "
                   "that computes it (rms_norm, softmax, log_softmax, logsumexp, "
                   "token_logprobs)")
_SCATTER_HINT = ("adds colliding updates in an order XLA picks (atomics on the GPU); the "
                 "gradient of a gather is one: write it as a one-hot jdet.matmul")
_COLLECTIVE_HINT = ("a cross-device reduction in an order the collective picks: gather the "
                    "per-device values and add them in a fixed order")
_SOLVE_HINT = ("a factorization/solve whose blocking XLA may change with the batch "
               "(unit-lower-triangular inverses: jdet.tri_inverse)")

# The primitives whose result can depend on the batch around a row, with what to do
# instead. Exact in any order, and so absent: max/min/argmax/argmin and their
# cumulative, windowed and collective forms, and/or/xor, gather, plain scatter.
_HINTS = {
    "dot_general": "use jdet.matmul (attention: jdet.dot_product_attention; LM-head "
                   "log-probs: jdet.token_logprobs)",
    "ragged_dot": "use jdet.matmul per group",
    "ragged_dot_general": "use jdet.matmul per group",
    "conv_general_dilated": "XLA picks the convolution algorithm by shape; jdet has no "
                            "convolution (write it as a jdet.matmul of patches)",
    "reduce_sum": _REDUCTION_HINT,
    "reduce_prod": "a product whose order XLA may change with the batch shape",
    "reduce": "a custom reduction whose order XLA may change with the batch shape",
    "reduce_window_sum": "a windowed sum whose order XLA may change with the batch shape",
    "reduce_window": "a windowed reduction whose order XLA may change with the batch shape",
    "select_and_scatter_add": _SCATTER_HINT,
    "cumsum": "a prefix sum whose association XLA picks by shape",
    "cumprod": "a prefix product whose association XLA picks by shape",
    "cumlogsumexp": "a prefix sum whose association XLA picks by shape",
    "sort": "values are exact, but the order of equal keys (and any index output) is not "
            "promised: break ties with a second key",
    "top_k": "values are exact, but which of equal values comes first is not promised",
    "approx_top_k": "approximate: its result may change with the batch",
    "scatter-add": _SCATTER_HINT,
    "scatter_add": _SCATTER_HINT,
    "scatter-sub": _SCATTER_HINT,
    "scatter_sub": _SCATTER_HINT,
    "scatter-mul": _SCATTER_HINT,
    "scatter_mul": _SCATTER_HINT,
    "psum": _COLLECTIVE_HINT,
    "psum2": _COLLECTIVE_HINT,
    "psum_invariant": _COLLECTIVE_HINT,
    "reduce_scatter": _COLLECTIVE_HINT,
    "custom_linear_solve": _SOLVE_HINT,
    "triangular_solve": _SOLVE_HINT,
    "lu": _SOLVE_HINT,
    "cholesky": _SOLVE_HINT,
    "qr": _SOLVE_HINT,
    "householder_product": _SOLVE_HINT,
    "eig": _SOLVE_HINT,
    "eigh": _SOLVE_HINT,
    "svd": _SOLVE_HINT,
    "schur": _SOLVE_HINT,
    "tridiagonal": _SOLVE_HINT,
    "tridiagonal_solve": _SOLVE_HINT,
    "fft": "XLA's FFT plan may change with the batch shape",
}
# Primitives audit does not look inside: a Pallas kernel is its author's business
# (jdet's own are checked by its tests), and a flagged solve is one finding.
_OPAQUE = {"pallas_call", "custom_linear_solve"}


@dataclasses.dataclass(frozen=True)
class Finding:
  """One operation that can make a result depend on the batch.

  ``file``/``line``/``function`` name the innermost frame of user code (outside jax
  and the standard library) that created it; ``where`` names the primitives it sits
  inside (e.g. ``("jit", "scan")``).
  """
  primitive: str
  file: str
  line: int
  function: str
  hint: str
  where: tuple[str, ...] = ()

  def __str__(self) -> str:
    inside = f" [in {'/'.join(self.where)}]" if self.where else ""
    return f"{self.file}:{self.line} ({self.function}): {self.primitive}{inside}: {self.hint}"


def audit(fn: Callable[..., Any], *args, **kwargs) -> list[Finding]:
  """Lists the operations of ``fn(*args, **kwargs)`` that can break batch invariance.

  ``fn`` is traced with :func:`jax.make_jaxpr` (nothing runs): array leaves of
  ``args``/``kwargs`` (or ``jax.ShapeDtypeStruct``s) are traced, other leaves are
  passed as they are. The jaxpr is walked into every sub-jaxpr (``jit``, ``scan``,
  ``while``, ``cond``, ``custom_jvp``/``custom_vjp``, ``remat``, ``shard_map``, ...),
  and every operation whose result can depend on the other rows of the batch gives
  one :class:`Finding`: ``dot_general``, convolutions, sums and products
  (``reduce_sum`` over more than one element, cumulative sums), ``sort``/``top_k``,
  scatter-adds, cross-device sums, linear solves and FFTs. Max/min reductions are
  exact in any order and are not listed.

  Operations created while a jdet op runs (its argument handling, kernels,
  ``custom_vjp`` rules and, under ``jax.grad``, its backward) are jdet's and are
  not listed: jax records the Python stack of every operation, and an operation
  belongs to jdet when a frame of that stack is a public jdet op (anything the
  ``jdet`` package exports except the ``*_reference`` functions) or lies in
  ``pallas_kernels``. Everything under an operation that belongs to jdet does too.

  Returns ``[]`` for a function built only from jdet ops and elementwise math.
  To audit a training step, audit the function that computes the gradient: the
  backward exists only there. An empty list is not a proof of invariance (XLA
  can still fuse elementwise math differently per program); check the bits with
  :func:`assert_batch_invariant`.
  """
  leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
  traced = [i for i, leaf in enumerate(leaves) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]

  def call(*arrays):
    full = list(leaves)
    for i, array in zip(traced, arrays):
      full[i] = array
    call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, full)
    return fn(*call_args, **call_kwargs)

  closed = jax.make_jaxpr(call)(*[leaves[i] for i in traced])
  findings: list[Finding] = []
  _walk(closed.jaxpr, findings, owned=False, outer=None, where=())
  return findings


def _walk(jaxpr, findings, *, owned, outer, where):
  jdet_code = _jdet_code()
  for eqn in _live(jaxpr):
    frames = _frames(eqn)
    eqn_owned = owned or any((f.file_name, f.function_start_line) in jdet_code
                             or f.file_name.startswith(_KERNEL_DIR) for f in frames)
    frame = _user_frame(frames) or outer
    name = eqn.primitive.name
    if not eqn_owned and name in _HINTS and _reduces(eqn):
      file, line, function = frame or ("<unknown>", 0, "<unknown>")
      findings.append(Finding(name, file, line, function, _HINTS[name], where))
    if name in _OPAQUE:
      continue
    label = f"{name}({eqn.params['name']})" if isinstance(eqn.params.get("name"), str) else name
    for sub in _sub_jaxprs(eqn.params.values()):
      _walk(sub, findings, owned=eqn_owned, outer=frame, where=where + (label,))


def _live(jaxpr):
  """The equations whose results reach an output or that have effects (XLA drops the
  rest; e.g. ``jax.grad`` of ``jnp.max`` traces a count it never uses)."""
  used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  live = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in used for v in eqn.outvars):
      live.append(eqn)
      used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
  return live[::-1]


def _frames(eqn):
  traceback = eqn.source_info.traceback
  return traceback.frames if traceback is not None else ()


def _reduces(eqn) -> bool:
  """False where the arithmetic is exact in any order: integer or boolean results, and
  sums of a single element (over size-1 axes)."""
  name = eqn.primitive.name
  if name not in ("sort", "top_k", "approx_top_k") and not any(
      jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars
      if hasattr(v.aval, "dtype")):
    return False
  if name in ("reduce_sum", "reduce_prod"):
    shape = eqn.invars[0].aval.shape
    return int(np.prod([shape[a] for a in eqn.params["axes"]], dtype=np.int64)) > 1
  if name == "dot_general":
    (contract, _), _ = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    return int(np.prod([shape[a] for a in contract], dtype=np.int64)) > 1
  if name in ("cumsum", "cumprod", "cumlogsumexp"):
    return eqn.invars[0].aval.shape[eqn.params["axis"]] > 1
  return True


def _sub_jaxprs(values):
  for value in values:
    if isinstance(value, jex_core.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
      yield value
    elif isinstance(value, (tuple, list)):
      yield from _sub_jaxprs(value)


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KERNEL_DIR = os.path.join(_PACKAGE_ROOT, "pallas_kernels") + os.sep
# Frames of these files are the machinery, never the user's line.
_NOT_USER = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (jax, np)) + (os.path.dirname(os.__file__) + os.sep,
                                         sysconfig.get_path("stdlib") + os.sep)


def _user_frame(frames):
  """(file, line, function) of the innermost frame outside jax, NumPy and the stdlib."""
  for f in frames:
    if not f.file_name.startswith(_NOT_USER):
      return f.file_name, f.line_num, f.function_name
  return None


@functools.cache
def _jdet_code() -> frozenset[tuple[str, int]]:
  """(file, first line) of every public jdet op: jax's frames record both."""
  import jdet
  code = set()
  for name in dir(jdet):
    op = getattr(jdet, name)
    while isinstance(op, functools.partial):
      op = op.func
    op = inspect.unwrap(op)
    if (name.startswith("_") or name.endswith("_reference") or not inspect.isfunction(op)
        or not op.__module__.startswith("jdet.")):
      continue
    code.add((op.__code__.co_filename, op.__code__.co_firstlineno))
  return frozenset(code)
