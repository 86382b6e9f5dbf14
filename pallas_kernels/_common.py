"""Helpers shared by every kernel family: sizes, padding, masks, compiler params."""

from __future__ import annotations

import collections
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def mosaic_gpu():
  """Pallas Mosaic GPU, imported on first use: it needs absl-py, which jax does
  not (the ``cuda`` extras install it). Only the H100 kernels use it."""
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ModuleNotFoundError as e:
    raise ImportError(
        f"jdet's H100 kernels need Pallas Mosaic GPU, which failed to import ({e}); "
        "install the GPU extras: python3 -m pip install -e '.[cuda]'") from e
  return plgpu


def bucketed_grid(programs: int) -> int:
  """A grid of at least ``programs`` programs, from few sizes: ``programs`` itself
  up to 8, then the next of 8, 10, 12, 14, 16, 20, 24, 28, 32, ... (four steps
  an octave, at most 25% more). A kernel that reads its row count from an operand
  and masks by it compiles to the same code for every count whose programs share
  a bucket; XLA's kernel cache (``jax_persistent_cache_enable_xla_caches =
  "xla_gpu_kernel_cache_file"``) then reuses the compiled kernel in new programs.
  The extra programs find no rows and return."""
  if programs <= 8:
    return programs
  step = 1 << (programs.bit_length() - 3)
  return cdiv(programs, step) * step


def counted_call(kernel, *, count: int, in_specs, input_output_aliases=None, **params):
  """``pl.pallas_call`` of ``kernel(count_ref, *refs)`` with ``count`` an operand
  (the kernel reads ``count_ref[0]``) rather than a constant, so that the compiled
  kernel is the same for every count whose grid (``params["grid"]``, sized by the
  caller with :func:`bucketed_grid` on the axis that grows with the count) is the
  same. The kernel masks or skips what lies past the count itself. ``in_specs``
  and ``input_output_aliases`` are those of the inputs; ``params`` go to
  ``pl.pallas_call``. Returns a function of the inputs."""
  call = pl.pallas_call(
      kernel,
      in_specs=[pl.BlockSpec((1,), lambda *_: (0,)), *in_specs],
      input_output_aliases={i + 1: o for i, o in (input_output_aliases or {}).items()},
      **params)
  return lambda *inputs: call(jnp.full((1,), count, jnp.int32), *inputs)


def counted_rows_call(kernel, *, rows: int, block_rows: int, in_specs, out_specs, out_shape,
                      input_output_aliases=None, **params):
  """:func:`counted_call` of ``kernel`` over blocks of ``block_rows`` rows (grid
  axis 0, :func:`bucketed_grid` of the blocks) of a ``rows``-row batch, so that
  the compiled kernel is the same for every count of a bucket.
  ``kernel(*refs, valid=...)`` gets its block's [block_rows] row mask and masks
  its loads and stores with it; programs past the count return at once. Every
  block carries the mask, whatever the count: a kernel whose code changed with
  the count could round differently (interpret mode showed it, XLA:CPU
  contracting multiply-adds differently in masked and unmasked code)."""
  def counted(count_ref, *refs):
    first = pl.program_id(0) * block_rows
    valid = block_mask(first, block_rows, count_ref[0])

    @pl.when(first < count_ref[0])
    def _():
      kernel(*refs, valid=valid)

  return counted_call(counted, count=rows, in_specs=in_specs, out_specs=out_specs,
                      out_shape=out_shape, input_output_aliases=input_output_aliases,
                      grid=(bucketed_grid(cdiv(rows, block_rows)),), **params)


def counted_axis_call(kernel, *, count: int, axis: int, grid: tuple[int, ...], **params):
  """:func:`counted_call` of ``kernel`` over ``grid``, whose axis ``axis`` has a
  program per item of a ``count``-item batch (sequences, say): that axis
  becomes :func:`bucketed_grid` ``(count)`` long and its programs past the
  count return at once, so every count of a bucket runs the same compiled
  kernel. ``kernel(*refs, program_ids=...)`` gets the program's grid indices,
  read before that test (Pallas interpret mode cannot read them inside one).
  ``params`` (specs, shapes, options) go to :func:`counted_call`."""
  grid = tuple(bucketed_grid(count) if a == axis else size for a, size in enumerate(grid))

  def counted(count_ref, *refs):
    program_ids = tuple(pl.program_id(a) for a in range(len(grid)))

    @pl.when(program_ids[axis] < count_ref[0])
    def _():
      kernel(*refs, program_ids=program_ids)

  return counted_call(counted, count=count, grid=grid, **params)


def pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  """Zero-pads ``x`` along ``axis`` up to the next multiple of ``multiple``."""
  size = x.shape[axis]
  extra = cdiv(size, multiple) * multiple - size
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def lookup_tiles(table, size: int):
  """The tiles of the first ``(largest size served, tiles)`` entry of ``table``
  (sorted by size) that serves ``size``: the one shape of jdet's tile tables."""
  for largest, tiles in table:
    if size <= largest:
      return tiles
  raise ValueError(f"size {size} exceeds the largest this tile table serves ({table[-1][0]})")


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


MAX_INTERPRET_EXECUTABLES = 16
_INTERPRET_EXECUTABLES = []  # every launcher's cache, for clear_interpret_executables


def clear_interpret_executables():
  """Drops the launchers' compiled interpret-mode kernels (``jax.clear_caches`` does
  not reach them)."""
  for cache in _INTERPRET_EXECUTABLES:
    cache.clear()


def synchronous_cpu_dispatch() -> None:
  """Makes XLA:CPU run each program on the thread that dispatches it
  (``jax_cpu_enable_async_dispatch=False``); call it before the process's first
  computation, as the test suite and ``python -m jdet`` do.

  An interpret-mode :func:`launcher` runs its kernel's program from a host
  callback while the program that made the callback is still running. With
  asynchronous dispatch XLA:CPU admits a bounded number of programs in flight
  per device (32 in jaxlib 0.10.2); once the caller has queued that many behind
  the running one, the kernel's program waits for a slot that never frees and
  the process deadlocks (the jdet fuzz hung after 40-988 trials; with this, 1,000
  trials of each op ran through). A jax without the option changes nothing.
  """
  if "jax_cpu_enable_async_dispatch" in jax.config.values:
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def launcher(fn):
  """Declares ``fn`` a kernel launcher: ``jax.jit`` with every keyword-only
  argument static and, with ``interpret=True``, a program of its own.

  Every launcher takes arrays positionally and its options (tiles, dtypes,
  ``interpret``) as hashable keyword-only arguments. On the GPU it is plain
  ``jax.jit``: each Triton or Mosaic kernel is compiled on its own anyway.
  In interpret mode the kernel is XLA:CPU code, and XLA:CPU contracts
  ``a*b + c`` into one FMA wherever a multiply and an add end up in one fused
  loop, which depends on the whole program: the same kernel inlined into
  ``jit(grad)``, ``vmap``, a ``lax.scan``/``fori_loop`` over chunks or a
  program with aliased inputs rounded differently. No per-compilation XLA:CPU
  option turns the contraction off (``--xla_cpu_max_isa=AVX`` does, but only
  for the whole process, and slows everything), so interpret mode calls the
  jitted launcher from a host callback instead: it is compiled once per
  shape and options, whatever program surrounds it. Under ``vmap`` the
  callback runs once per batch entry on unbatched shapes (bitwise the same as
  calling the launcher on each entry). Callbacks do not support ``jax.export``,
  and a process that runs many of them needs :func:`synchronous_cpu_dispatch`.
  """
  keyword_only = tuple(name for name, p in inspect.signature(fn).parameters.items()
                       if p.kind is inspect.Parameter.KEYWORD_ONLY)
  jitted = jax.jit(fn, static_argnames=keyword_only)
  # The most recently used compiled kernels: each holds JIT code pages, and a
  # process may map only so many (vm.max_map_count), so the cache is bounded.
  executables = collections.OrderedDict()
  _INTERPRET_EXECUTABLES.append(executables)

  @functools.wraps(fn)
  def launch(*arrays, **options):
    if not options.get("interpret"):
      return jitted(*arrays, **options)
    avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    key = (tuple(sorted(options.items())), jax.tree.structure(avals),
           tuple((a.shape, a.dtype) for a in jax.tree.leaves(avals)))
    # Compiled here, while the caller traces: compiling inside the callback, while
    # an XLA:CPU program is running, crashed the process now and then.
    if key not in executables:
      executables[key] = jitted.lower(*avals, **options).compile()
      if len(executables) > MAX_INTERPRET_EXECUTABLES:
        executables.popitem(last=False)
    executables.move_to_end(key)
    executable = executables[key]

    def host(*values):
      return jax.tree.map(np.asarray, executable(*values))

    result = jax.eval_shape(functools.partial(jitted, **options), *arrays)
    return jax.pure_callback(host, result, *arrays, vmap_method="sequential")

  return launch


def dot_f32(a, b, *, trans_a: bool = False, trans_b: bool = False, precision=None):
  """2-D ``a @ b`` (optionally transposed operands) accumulated in float32, in-kernel.

  Use this instead of ``pl.dot`` (removed in jax 0.12). ``precision=HIGHEST`` makes
  float32 products IEEE on the GPU; the default lets Triton use TF32.
  """
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision,
                         preferred_element_type=jnp.float32)


def sum_in_order(terms):
  """Left-to-right sum of a non-empty sequence of arrays: the one fixed order
  every kernel uses for sums it unrolls."""
  total = terms[0]
  for term in terms[1:]:
    total = total + term
  return total


def pairwise_row_sum(x, *, native: bool):
  """Row sums of a [rows, W] block (W a power of two) as [rows, 1]: a balanced
  tree fixed by the column index (level by level, column j adds column j + w/2
  of the w columns left). Every add has exactly two operands, so which thread
  holds which cannot change its result: the sum's bits do not depend on the
  register layout Triton picks for the block (which follows the alignment it can
  prove of the addresses and masks), unlike ``jnp.sum``'s tree. Far halves first:
  in the unvectorised layout of an unaligned row a thread holds columns one
  warp-span apart, so the first levels add within threads. In interpret mode
  each level is a value of its own (:func:`uncontracted`), or XLA:CPU merges the
  levels' reductions into one of its own order. (The H100 timings of this order
  and of neighbours first: benchmarks/results/h100.md, twentieth and twenty-first sessions.)"""
  rows, width = x.shape
  if width & (width - 1):
    raise ValueError(f"pairwise_row_sum needs a power-of-two width, got {width}")
  while width > 1:
    width //= 2
    x = uncontracted(jnp.sum(x.reshape(rows, 2, width), axis=1), native=native)
  return x


# A row of a multiple of this many elements starts 16-byte aligned (Triton's
# widest vector) wherever it lies in a row-major array of 2- or 4-byte values.
ALIGNED_ROW_ELEMENTS = 8


def pairwise_sums_for(length: int) -> bool:
  """Whether :func:`row_sum` over rows of ``length`` elements must be
  :func:`pairwise_row_sum` (see there)."""
  return length % ALIGNED_ROW_ELEMENTS != 0


def row_sum(x, *, pairwise: bool, native: bool):
  """[rows, W] -> [rows, 1]: the row sum of the row kernels, of a block of rows
  of an unpadded [M, L] array, read where they lie.

  Triton picks a block's register layout, and with it ``jnp.sum``'s tree, from
  what it can prove about the alignment of the addresses: the row at index r
  starts at r * L elements, while the same row as a one-row array (or in a
  buffer of another pitch) starts aligned. Where L is a multiple of
  ``ALIGNED_ROW_ELEMENTS`` every row is 16-byte aligned anyway, every array
  gets one layout and ``jnp.sum`` is safe. Elsewhere (``pairwise``, from
  :func:`pairwise_sums_for`) the sum must be :func:`pairwise_row_sum`, which no
  layout changes (``jnp.sum`` gave a one-row array other bits than the same row
  in a batch on the GPU; ``tests/test_softmax.py`` and ``tests/test_rms_norm.py``
  check odd lengths). The pairwise tree is slower than ``jnp.sum`` where both are
  safe, so it serves only where it must."""
  return pairwise_row_sum(x, native=native) if pairwise else jnp.sum(x, axis=1, keepdims=True)


def _ptx_f32(instruction: str, *operands):
  """One PTX float32 instruction per element (``$0`` the result, ``$1``... the
  operands, which broadcast to one shape); GPU (Triton lowering) only."""
  shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in operands))
  [result] = pltriton.elementwise_inline_asm(
      instruction, args=[jnp.broadcast_to(v, shape) for v in operands],
      constraints=",".join(["=f"] + ["f"] * len(operands)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
  return result


def reciprocal(x, *, approx: bool):
  """Elementwise float32 ``1 / x``, inside a kernel.

  ``approx=True`` (GPU only) is one ``rcp.approx.ftz.f32`` (at most 1 ulp from
  the exact reciprocal, subnormal inputs and results flushed to zero) instead of
  the IEEE division's multi-instruction sequence; interpret mode needs
  ``approx=False``. Either way a value's bits depend on that value alone.
  """
  return _ptx_f32("rcp.approx.ftz.f32 $0, $1;", x) if approx else 1.0 / x


def log2_approx(x, *, native: bool):
  """Elementwise float32 base-2 logarithm, inside a kernel. On the GPU
  (``native``) one ``lg2.approx.ftz.f32`` (at most 2^-22 from the exact value
  near 1), an instruction a Mosaic GPU kernel issues too; ``jnp.log2`` would lower
  to libdevice's longer ``log2f``. In interpret mode ``jnp.log2``, a value of its
  own (:func:`uncontracted`). Either way a value's bits depend on that value alone.
  """
  if native:
    return _ptx_f32("lg2.approx.ftz.f32 $0, $1;", x)
  return uncontracted(jnp.log2(x), native=False)


def uncontracted(x, *, native: bool):
  """``x`` as a value of its own in interpret mode, so that XLA:CPU cannot
  contract the multiply that made it into a later add or subtraction (one FMA),
  which it decides per program: a grid or loop of one trip is inlined into its
  surroundings, say. Unchanged on the GPU.

  ``lax.optimization_barrier`` does not do this: XLA:CPU fuses through it, and
  LLVM contracts any ``fmul`` that feeds an ``fadd``/``fsub`` directly. So the
  value passes through an integer select that XLA and LLVM cannot fold away (it
  maps the all-ones NaN pattern to the canonical NaN): the add then reads a
  select, not a multiply. Only that one NaN payload changes.
  """
  if native:
    return x
  bits_type = jnp.dtype(f"int{8 * jnp.dtype(x.dtype).itemsize}")
  bits = lax.bitcast_convert_type(x, bits_type)
  canonical_nan = lax.bitcast_convert_type(jnp.array(jnp.nan, x.dtype), bits_type)
  bits = jnp.where(bits == -1, canonical_nan, bits)
  return lax.bitcast_convert_type(bits, x.dtype)


def product(a, b, *, native: bool):
  """Elementwise ``a * b`` inside a kernel, for a product that an add or a sum
  consumes: in interpret mode rounded on its own (:func:`uncontracted`), so that
  XLA:CPU cannot make it one FMA in some programs and not in others; on the GPU
  a plain multiply (jaxlib's Triton pipeline does not contract it, see
  :func:`multiply_add`)."""
  return a * b if native else uncontracted(a * b, native=False)


def multiply_add(a, b, c, *, fused: bool):
  """Elementwise float32 ``a * b + c``, inside a kernel; operands broadcast.

  ``fused=True`` (GPU only) is one ``fma.rn.f32``, a single rounding: jaxlib's
  Triton pipeline does not contract a multiply and an add on its own (Nsight
  Compute counted 2 fused of ~3,800 FP32 instructions per token in the Sinkhorn
  backward). ``fused=False`` (interpret mode) rounds the product on its own
  (:func:`uncontracted`), whatever program the kernel ends up in. Either way a
  value's bits depend on its operands alone.
  """
  if fused:
    return _ptx_f32("fma.rn.f32 $0, $1, $2, $3;", a, b, c)
  return product(a, b, native=False) + c


def block_mask(start, block: int, limit: int):
  """Boolean [block] vector: which of the indices start..start+block-1 are < limit."""
  return start + jnp.arange(block) < limit


def load_block(ref, rows=None, cols=None):
  """Loads a 2-D block, zero-filling the rows/columns whose mask is False.

  ``rows``/``cols`` are boolean vectors from :func:`block_mask`, or ``None`` when
  the block is statically known to lie inside the array (no mask, no cost).
  """
  if rows is None and cols is None:
    return ref[...]
  if rows is None:
    mask = cols[None, :]
  elif cols is None:
    mask = rows[:, None]
  else:
    mask = rows[:, None] & cols[None, :]
  return pltriton.load(ref, mask=mask, other=0)


def store_block(ref, value, rows=None, cols=None):
  """Stores a 2-D block, skipping the rows/columns whose mask is False."""
  if rows is None and cols is None:
    ref[...] = value
    return
  if rows is None:
    mask = cols[None, :]
  elif cols is None:
    mask = rows[:, None]
  else:
    mask = rows[:, None] & cols[None, :]
  pltriton.store(ref, value, mask=mask)


def divide(x, y, *, native: bool):
  """Elementwise float32 ``x / y`` rounded once (IEEE), inside a kernel; operands broadcast.

  The Triton lowering of ``/`` on float32 is ``div.full.f32`` (approximate, up to
  2 ulp), so ``native=True`` (GPU only) issues ``div.rn.f32``. Interpret mode
  needs ``native=False``. Either way a value's bits depend on its operands alone.
  """
  return _ptx_f32("div.rn.f32 $0, $1, $2;", x, y) if native else x / y


def multiply(a, b, *, native: bool):
  """Elementwise float32 ``a * b`` rounded on its own whatever consumes it: on the
  GPU (``native``) one ``mul.rn.f32``, which ptxas never contracts into a fused
  multiply-add; in interpret mode :func:`uncontracted`."""
  return _ptx_f32("mul.rn.f32 $0, $1, $2;", a, b) if native else uncontracted(a * b,
                                                                               native=False)


__all__ = [
    "block_mask",
    "bucketed_grid",
    "clear_interpret_executables",
    "counted_axis_call",
    "counted_call",
    "counted_rows_call",
    "cdiv",
    "compiler_params",
    "divide",
    "dot_f32",
    "launcher",
    "load_block",
    "log2_approx",
    "lookup_tiles",
    "mosaic_gpu",
    "multiply",
    "multiply_add",
    "uncontracted",
    "pad_axis",
    "product",
    "reciprocal",
    "store_block",
    "sum_in_order",
    "synchronous_cpu_dispatch",
]
