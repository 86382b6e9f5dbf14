"""The Llama model's KV-cache paths and the RL parity demo (examples/rl_parity.py)."""

import functools
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.models import llama, parity
from jdet.bench import on_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = llama.CONFIGS["cpu"]


@functools.lru_cache(maxsize=None)
def _jit(fn, ops):
  return jax.jit(functools.partial(fn, config=CONFIG, ops=ops))


def test_chunked_prefill_and_decode_follow_the_training_forward():
  """With XLA's ops (any set of ops: this checks the cache plumbing, positions and
  masks), prompt chunks and decode steps give the training forward's hidden states."""
  params = llama.init_params(jax.random.key(0), CONFIG)
  tokens = jax.random.randint(jax.random.key(1), (3, 9), 1, CONFIG.vocab)
  full = np.asarray(_jit(llama.forward, "xla")(params, tokens))
  chunk_lens = np.array([[2, 3, 4], [3, 1, 2]])   # per sequence, two prefill chunks
  cache = llama.init_cache(CONFIG, 3, 12)
  got = [[] for _ in range(3)]
  for lens in chunk_lens:
    start = np.asarray(cache["lengths"])
    chunk = np.zeros((3, 4), np.int32)   # zero tokens pad each sequence's chunk
    for b in range(3):
      chunk[b, :lens[b]] = tokens[b, start[b]:start[b] + lens[b]]
    hidden, cache = _jit(llama.prefill, "xla")(params, chunk, cache, lengths=lens)
    for b in range(3):
      got[b].extend(np.asarray(hidden[b, :lens[b]]))
  for _ in range(2):
    start = np.asarray(cache["lengths"])
    hidden, cache = _jit(llama.decode_step, "xla")(params, tokens[jnp.arange(3), start], cache)
    for b in range(3):
      got[b].append(np.asarray(hidden[b]))
  np.testing.assert_array_equal(np.asarray(cache["lengths"]), chunk_lens.sum(0) + 2)
  for b in range(3):
    np.testing.assert_allclose(np.stack(got[b]), full[b, :len(got[b])], rtol=1e-5, atol=1e-5)


def test_logprobs_are_the_log_softmax_of_the_next_token():
  params = llama.init_params(jax.random.key(0), CONFIG)
  tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, CONFIG.vocab)
  hidden = _jit(llama.forward, "xla")(params, tokens)
  logits = np.asarray(hidden, np.float64) @ np.asarray(params["lm_head"], np.float64)
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(logp[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(_jit(llama.logprobs, "xla")(params, tokens), want,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(on_gpu(), reason="CPU-sized demo; on a GPU run examples/rl_parity.py")
def test_rl_parity_demo_is_bitwise_with_jdet():
  result = runpy.run_path(os.path.join(ROOT, "examples", "rl_parity.py"))["main"]("cpu")
  jd = result["jdet"]
  assert jd["tokens"] > 0 and jd["sequences"] == sum(parity.SETUPS["cpu"].rounds)
  assert jd["mismatches"] == 0, jd["layouts"]
  assert jd["grad_leaves_compared"] > 0 and jd["grad_leaves_differing"] == 0
  assert jd["audit"] == []
  assert result["xla"]["audit"], "the XLA model's matmuls and sums must be audited"
  assert result["ok"]


@pytest.mark.gpu
@pytest.mark.long
def test_rl_parity_demo_on_the_gpu():
  assert parity.parity_check("gpu", xla_baseline=False)["ok"]
