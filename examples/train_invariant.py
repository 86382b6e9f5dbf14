"""A tiny model made batch-invariant with jdet, trained for a few SGD steps.

Each example is a chunk of T tokens. The model is a linear layer, an mHC-style
stream mixing whose per-token mixing matrix is projected with ``jdet.sinkhorn``,
and a gated-delta-rule chunk step whose ``inv(I + A)`` is ``jdet.tri_inverse``.
The same model written with ``jnp`` ops is the baseline.

After each step the script compares every example's loss and per-example
gradient computed in the full batch with the same example computed in smaller
batches: with jdet they are bitwise identical; with the jnp baseline they are
not. Run: ``python examples/train_invariant.py`` (CPU: under a minute).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jdet
from jdet.testing import bits

T, D, STREAMS, KEY_DIM = 16, 32, 4, 16
SUB_BATCHES = (1, 3)


def jdet_ops():
  return dict(matmul=jdet.matmul, sinkhorn=functools.partial(jdet.sinkhorn, iters=5),
              tri_inverse=jdet.tri_inverse)


def jnp_ops():
  return dict(matmul=jnp.matmul, sinkhorn=functools.partial(jdet.sinkhorn_reference, iters=5),
              tri_inverse=jdet.tri_inverse_reference)


def init_params(key):
  keys = jax.random.split(key, 5)
  scale = 1 / np.sqrt(D)
  return dict(w_in=jax.random.normal(keys[0], (D, D)) * scale,
              w_mix=jax.random.normal(keys[1], (D, STREAMS * STREAMS)) * scale,
              w_key=jax.random.normal(keys[2], (D, KEY_DIM)) * scale,
              w_beta=jax.random.normal(keys[3], (D, 1)) * scale,
              w_value=jax.random.normal(keys[4], (D, D)) * scale)


def per_example_loss(params, x, y, ops):
  """x, y: [B, T, D]; returns the [B] losses."""
  mm = ops["matmul"]
  batch = x.shape[0]
  h = jnp.tanh(mm(x, params["w_in"]))
  mixing = ops["sinkhorn"](mm(h, params["w_mix"]).reshape(batch, T, STREAMS, STREAMS))
  streams = h.reshape(batch, T, STREAMS, D // STREAMS)
  # mixed_i = sum_j mixing_ij * stream_j, added in a fixed order (elementwise only).
  mixed = functools.reduce(
      lambda acc, j: acc + mixing[..., :, j, None] * streams[..., j, None, :],
      range(1, STREAMS), mixing[..., :, 0, None] * streams[..., 0, None, :])
  mixed = mixed.reshape(batch, T, D)
  keys = mm(mixed, params["w_key"])
  keys = keys * jax.lax.rsqrt(jnp.sum(keys * keys, axis=-1, keepdims=True) + 1e-6)
  beta = jax.nn.sigmoid(mm(mixed, params["w_beta"]))
  a = beta * mm(keys, jnp.swapaxes(keys, -1, -2))      # A = beta_i k_i . k_j
  chunk_inverse = ops["tri_inverse"](-a)                 # inv(I + tril(A, -1))
  out = mm(chunk_inverse, mm(mixed, params["w_value"]))
  return jnp.mean((out - y) ** 2, axis=(1, 2))


def make_steps(ops):
  loss = functools.partial(per_example_loss, ops=ops)
  per_example_grads = jax.vmap(jax.grad(lambda p, x, y: loss(p, x[None], y[None])[0]),
                               in_axes=(None, 0, 0))

  @jax.jit
  def sgd_step(params, x, y, lr=0.1):
    grads = jax.grad(lambda p: jnp.mean(loss(p, x, y)))(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)

  return jax.jit(loss), jax.jit(per_example_grads), sgd_step


def mismatches(full, parts) -> int:
  """How many leaves of ``parts`` (sub-batch results, concatenated) differ in bits from ``full``."""
  return sum(not np.array_equal(bits(a), bits(b))
             for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(parts)))


def compare_batch_sizes(loss, grads, params, x, y) -> int:
  full_loss, full_grads = loss(params, x, y), grads(params, x, y)
  differing = 0
  for size in SUB_BATCHES:
    chunks = [slice(i, i + size) for i in range(0, x.shape[0] - size + 1, size)]
    part_loss = jnp.concatenate([loss(params, x[c], y[c]) for c in chunks])
    part_grads = jax.tree.map(lambda *g: jnp.concatenate(g),
                              *[grads(params, x[c], y[c]) for c in chunks])
    covered = len(chunks) * size
    differing += mismatches(full_loss[:covered], part_loss)
    differing += mismatches(jax.tree.map(lambda g: g[:covered], full_grads), part_grads)
  return differing


def main(steps: int = 3, batch: int = 6) -> dict[str, int]:
  """Trains both variants; returns, per variant, how many comparisons differed."""
  key_x, key_y, key_p = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (batch, T, D))
  y = jax.random.normal(key_y, (batch, T, D))
  result = {}
  for name, ops in (("jdet", jdet_ops()), ("jnp baseline", jnp_ops())):
    loss, grads, sgd_step = make_steps(ops)
    params = init_params(key_p)
    differing = 0
    for step in range(steps):
      differing += compare_batch_sizes(loss, grads, params, x, y)
      params = sgd_step(params, x, y)
      print(f"{name:>12} step {step}: mean loss {float(jnp.mean(loss(params, x, y))):.6f}, "
            f"leaves differing across batch sizes so far: {differing}")
    result[name] = differing
  return result


BATCH = 6

if __name__ == "__main__":
  outcome = main(batch=BATCH)
  print(f"jdet: {'bitwise identical' if outcome['jdet'] == 0 else 'DIFFERENT'} across batch "
        f"sizes {SUB_BATCHES} vs {BATCH}; jnp baseline: {outcome['jnp baseline']} leaves "
        f"differ.")
