"""How jdet picks the Pallas backend, and the argument checks every op shares."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
