"""How jdet picks the Pallas backend, the argument checks every op shares, and the
guard that makes differentiating an op's backward rule a clear error."""

from __future__ import annotations

import functools

import math
import numbers
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _platform(arrays) -> str:
  """The platform of the first concrete input; under a trace, the default backend."""
  for x in arrays:
    try:
      return next(iter(x.devices())).platform
    except (AttributeError, StopIteration, jax.errors.ConcretizationTypeError):
      continue
  return jax.default_backend()


def use_interpret(interpret: bool | None, *arrays) -> bool:
  """Whether to run Pallas kernels in interpret mode.

  ``interpret=None`` picks by platform: the Triton lowering on an NVIDIA GPU,
  interpret mode on a CPU. Concrete inputs are asked for their device; under a
  trace the default backend decides.
  """
  if interpret is not None:
    if not isinstance(interpret, (bool, np.bool_)):
      raise TypeError(f"interpret must be None, True or False, got {interpret!r}")
    return bool(interpret)
  platform = _platform(arrays)
  if platform in ("gpu", "cuda"):
    return False
  if platform == "cpu":
    return True
  raise ValueError(
      f"jdet kernels run on NVIDIA GPUs (Pallas Triton) or on CPU (Pallas interpret "
      f"mode); the inputs live on platform {platform!r}.")


def check_float(name: str, x) -> jnp.dtype:
  """Returns x's dtype, or raises TypeError unless it is bfloat16/float16/float32."""
  dtype = jnp.dtype(x.dtype)
  if dtype not in FLOAT_DTYPES:
    raise TypeError(
        f"{name} must be bfloat16, float16 or float32, got {dtype}"
        + (" (float64 is not supported: cast to float32)" if dtype == np.float64 else ""))
  return dtype


def check_ndim(name: str, x, min_ndim: int, layout: str) -> None:
  if x.ndim < min_ndim:
    raise ValueError(f"{name} must have shape {layout} (rank >= {min_ndim}), got shape {x.shape}")


def as_array(name: str, x) -> jax.Array:
  """Converts array-likes; rejects non-arrays and float64 (which jnp would truncate)."""
  if not (isinstance(x, (jax.Array, np.ndarray, np.generic, list, tuple, int, float))
          or hasattr(x, "__jax_array__")):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if getattr(x, "dtype", None) == np.float64:
    check_float(name, x)
  return jnp.asarray(x)


def check_precision(name: str, precision, default: lax.Precision | None):
  """``precision`` as one ``lax.Precision`` (``default`` for None).

  Takes what ``jnp.dot`` takes for one precision: a ``lax.Precision``, a string
  ``lax.Precision`` accepts ("highest", "float32", "tensorfloat32", ...), or a
  pair of those naming the same precision; and the member names ("HIGHEST").
  jdet's kernels apply one precision to both operands, so a pair of different
  ones, and ``lax.DotAlgorithm`` presets, raise ValueError naming ``name``.
  """
  if precision is None:
    return default
  if isinstance(precision, (tuple, list)) and len(precision) == 2 and None not in precision:
    first, second = (check_precision(name, p, default) for p in precision)
    if first != second:
      raise ValueError(f"{name} must name one precision for both operands, got {precision!r}")
    return first
  if isinstance(precision, lax.Precision):
    return precision
  if isinstance(precision, str):
    if precision in lax.Precision.__members__:
      return lax.Precision[precision]
    try:
      return lax.Precision(precision)
    except ValueError:
      pass
  raise ValueError(
      f"{name} must be None, a jax.lax.Precision (DEFAULT, HIGH, HIGHEST), its name, "
      f"a string jax.lax.Precision accepts (e.g. 'highest', 'float32', 'tensorfloat32') "
      f"or a pair of equal ones; got {precision!r}")


_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_eps(eps) -> float:
  """``eps`` as a Python float, or TypeError/ValueError unless it is a positive normal
  float32 (the kernels compute in float32: 1e-50 would be 0 there)."""
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
    raise TypeError(f"eps must be a Python float, got {type(eps).__name__}")
  if not (math.isfinite(eps) and _FLOAT32_TINY <= eps <= _FLOAT32_MAX):
    raise ValueError(
        f"eps must be a positive normal float32 ({_FLOAT32_TINY:.3g} <= eps <= "
        f"{_FLOAT32_MAX:.3g}: the kernels compute in float32), got {eps}")
  return float(eps)


def differentiable_once(op: str, primal, fwd, bwd):
  """Defines the VJP of the ``jax.custom_vjp`` function ``primal`` as ``fwd``,
  ``bwd`` (``bwd(static, residuals, cotangent)``, like ``primal.defvjp``) and
  returns ``primal`` wrapped so that every derivative beyond the first raises
  one NotImplementedError naming ``op``.

  jdet's rules launch kernels that have no derivatives of their own (Pallas
  calls, host callbacks), so without this ``jax.grad`` of ``jax.grad`` fails
  deep inside JAX. ``fwd`` and ``bwd`` run inside a ``jax.custom_jvp`` whose JVP
  raises (undifferentiated it is inlined and changes no bits), and the forward-mode
  TypeError JAX raises for a ``custom_vjp`` (``jax.jvp``, ``jax.jacfwd``,
  ``jax.hessian``) becomes the same error. Every op defines its VJP with this.
  """
  message = (f"jdet.{op} is differentiable once, in reverse mode (jax.grad, jax.vjp): "
             f"higher-order derivatives (jax.grad of jax.grad, jax.hessian) and forward "
             f"mode (jax.jvp, jax.jacfwd) are not supported")

  def undifferentiable(fn, *args):
    """``fn(*args)`` inside a ``jax.custom_jvp`` whose JVP raises; the arguments that
    are not arrays (static configs) are closed over."""
    dynamic = [i for i, a in enumerate(args)
               if all(isinstance(leaf, (jax.Array, np.ndarray, np.generic))
                      for leaf in jax.tree.leaves(a))]

    @jax.custom_jvp
    def call(*values):
      merged = list(args)
      for i, value in zip(dynamic, values):
        merged[i] = value
      return fn(*merged)

    @call.defjvp
    def _differentiated(primals, tangents):
      raise NotImplementedError(message)

    return call(*(args[i] for i in dynamic))

  def guarded_fwd(*args):
    return undifferentiable(fwd, *args)

  def guarded_bwd(static, residuals, cotangent):
    return undifferentiable(functools.partial(bwd, static), residuals, cotangent)

  primal.defvjp(guarded_fwd, guarded_bwd)

  @functools.wraps(primal)
  def call(*args):
    try:
      return primal(*args)
    except TypeError as err:
      if "forward-mode autodiff" not in str(err):
        raise
      raise NotImplementedError(message) from err

  return call
