"""jdet: deterministic, batch-invariant Pallas kernels for JAX.

Every op promises that output row ``i`` (a token, one matrix of a batch) is
bitwise independent of the other rows, of padding, chunking, ``jit`` and
``vmap``, and identical run after run, forward and backward.
"""

from jdet.attention import dot_product_attention, dot_product_attention_reference
from jdet.matmul import matmul, matmul_reference
from jdet.rms_norm import rms_norm, rms_norm_reference
from jdet.sinkhorn import sinkhorn, sinkhorn_reference, sinkhorn_residual
from jdet.softmax import (log_softmax, log_softmax_reference, logsumexp, logsumexp_reference,
                          softmax, softmax_reference)
from jdet.token_logprobs import token_logprobs, token_logprobs_reference
from jdet.tri_inverse import gdn_chunk_matrices, tri_inverse, tri_inverse_reference

__version__ = "0.1.0"

__all__ = ["dot_product_attention", "dot_product_attention_reference", "matmul",
           "matmul_reference", "rms_norm", "rms_norm_reference", "sinkhorn",
           "sinkhorn_reference", "sinkhorn_residual", "tri_inverse", "tri_inverse_reference",
           "gdn_chunk_matrices", "softmax", "softmax_reference", "log_softmax",
           "log_softmax_reference", "logsumexp", "logsumexp_reference", "token_logprobs",
           "token_logprobs_reference"]
