"""PyTorch entry point to jdet's Triton GEMM, so a PyTorch rollout engine and a JAX
trainer can compute a token's logits with the same kernel and the same bits.

Needs ``torch`` and ``triton`` (and a CUDA GPU); jax is imported only for the
shared tile table and precision names. In a process that also imports
``jax_triton``: that import sets ``TRITON_CACHE_DIR`` to an empty string, which
Triton's own launcher refuses ("Could not create or locate cache dir"); set it
to a real folder after importing jax_triton.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import matmul_plan
from pallas_kernels.matmul import Layout


def _import_torch():
  try:
    import torch
    from pallas_kernels import triton_matmul
  except ImportError as err:
    raise ImportError(
        "jdet.interop.torch_matmul needs PyTorch and triton >= 3.6 "
        f"(python3 -m pip install torch triton). Import failed with: {err}") from err
  return torch, triton_matmul


def torch_matmul(a, b, *, precision: lax.Precision | None = None, out_dtype=None):
  """Batch-invariant ``a @ b`` for PyTorch CUDA tensors (forward only).

  Args:
    a: ``[..., M, K]`` torch tensor on a CUDA device, bfloat16, float16 or float32.
    b: ``[K, N]`` torch tensor on the same device (a shared weight).
    precision: as in :func:`jdet.matmul`: ``jax.lax.Precision.HIGHEST`` for IEEE
      float32 products, else TF32 for float32 inputs.
    out_dtype: torch dtype of the result; defaults to the promoted input dtype.

  Returns:
    ``[..., M, N]`` torch tensor. Row ``i`` depends only on ``a``'s row ``i`` and
    ``b`` (not on M), and equals, bit for bit, the row that
    ``jdet.matmul(..., backend="triton")`` computes from the same values: both
    launch :func:`pallas_kernels.triton_matmul.matmul_kernel` with the same tiles.
    No autograd: use ``jdet.matmul`` in the trainer.
  """
  torch, triton_matmul = _import_torch()
  float_dtypes = (torch.bfloat16, torch.float16, torch.float32)
  for name, x in (("a", a), ("b", b)):
    if not isinstance(x, torch.Tensor):
      raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in float_dtypes:
      raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.device.type != "cuda":
      raise ValueError(f"{name} must live on a CUDA device, got {x.device}")
  if a.dim() < 2 or b.dim() != 2:
    raise ValueError(f"a must be [..., M, K] and b [K, N], got a: {tuple(a.shape)}, "
                     f"b: {tuple(b.shape)}")
  k, n = b.shape
  if a.shape[-1] != k:
    raise ValueError(f"b must have K = {a.shape[-1]} rows to match a's last dim, got b: "
                     f"{tuple(b.shape)}")
  if k < 1 or n < 1:
    raise ValueError(f"K and N must be >= 1, got a: {tuple(a.shape)}, b: {tuple(b.shape)}")
  if b.device != a.device:
    raise ValueError(f"a and b must be on the same device, got {a.device} and {b.device}")
  compute_dtype = torch.promote_types(a.dtype, b.dtype)
  out_dtype = out_dtype or compute_dtype
  if out_dtype not in float_dtypes:
    raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
  rows = a.reshape(-1, k).to(compute_dtype)
  m = rows.shape[0]
  out = torch.empty((m, n), dtype=out_dtype, device=a.device)
  if m == 0:
    return out.reshape(*a.shape[:-1], n)
  rows = rows.contiguous()
  weight = b.to(compute_dtype).contiguous()
  as_jax = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
            torch.float32: jnp.float32}
  num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
  chunk = matmul_plan.fixed_contraction_chunk(Layout.NN, n, k)
  tiles = matmul_plan.triton_tiles(Layout.NN, m, n, as_jax[compute_dtype], as_jax[out_dtype],
                                   num_sms=num_sms, chunked=chunk is not None)
  grid, params = triton_matmul.matmul_launch(
      1, m, n, k, transpose_b=False, shared_b=True, tiles=tiles, precision=precision,
      contraction_chunk=chunk)
  triton_matmul.matmul_kernel[grid](rows, weight, out, num_warps=tiles.num_warps,
                                    num_stages=tiles.num_stages, **params)
  return out.reshape(*a.shape[:-1], n)
