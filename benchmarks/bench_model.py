"""The Llama-style decoder of :mod:`jdet.models.llama` with jdet ops against the same model
with XLA ops: a training step's forward + backward, and decode tokens/s.

The training step is ``jax.grad`` of the mean token log-prob over every parameter;
decode is one ``decode_step`` of a batch against a KV cache holding ``--context``
tokens. Times are the harness's (CUPTI kernel time on a GPU), jdet and XLA in the
same process.

Run: ``PYTHONPATH=. python3 benchmarks/bench_model.py [--quick] [--layers 2]``.

``--first-call`` times instead what a rollout engine pays for a new batch size: the
decode step's first call (trace, compile, run) at each ``--decode-batch`` in turn
(default 8, 9, 10, 11, 12), each a new program, with XLA's kernel cache on (in a
fresh folder). jdet's Triton kernels read the batch size from an operand and run
on a bucketed grid (README, "New batch sizes without new compiles"), so a size
in a bucket seen before (10 after 9, 12 after 11) should find its kernels there.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import jax
import jax.numpy as jnp

from jdet import bench
from jdet.models import llama

# The realistic small size: D = 2048, 16 heads, T = 2048, batch 8, vocab 32k, bf16.
STEP_CONFIG = llama.Config(vocab=32000, dim=2048, n_layers=2, n_heads=16, n_kv_heads=4,
                           head_dim=128, hidden=5632, dtype=jnp.bfloat16)
QUICK_CONFIG = llama.Config()


def _training_step(config, ops):
  def loss(params, tokens):
    return jnp.mean(llama.logprobs(params, tokens, config, ops=ops))
  return jax.grad(loss)


def _decode(config, ops):
  def step(params, token, cache):
    hidden, _ = llama.decode_step(params, token, cache, config, ops=ops)
    return llama.logits(params, hidden, config, ops=ops)
  return step


def _decode_inputs(config, params, batch, context):
  cache = llama.init_cache(config, batch, context + 1)
  cache = dict(cache, lengths=jnp.full((batch,), context, jnp.int32))
  return params, jnp.zeros((batch,), jnp.int32), cache


def enable_kernel_cache():
  """XLA's kernel cache (and jax's compilation cache) in a fresh folder: called before
  the process compiles anything, as jax sets its cache up at the first compile."""
  jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jdet-first-call-"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_kernel_cache_file")


def first_call_rows(config, params, batches, context) -> list[bench.Row]:
  """The decode step's first-call seconds at each batch size in turn, jdet's and
  XLA's (see the module docstring; :func:`enable_kernel_cache` first)."""
  rows = []
  for batch in batches:
    args = _decode_inputs(config, params, batch, context)
    seconds = {ops: bench.first_call_seconds(_decode(config, ops), args) for ops in ("xla", "jdet")}
    rows.append(bench.Row("model", f"decode B={batch} context={context}", "first call",
                          seconds["jdet"] * 1e6, "same model, XLA ops", seconds["xla"] * 1e6))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny model (CPU smoke run)")
  parser.add_argument("--layers", type=int, default=STEP_CONFIG.n_layers)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--decode-batch", type=int, action="append",
                      help="decode batch sizes (repeatable); default 1, 8 and 64")
  parser.add_argument("--context", type=int, default=2048, help="tokens in the KV cache")
  parser.add_argument("--first-call", action="store_true",
                      help="the decode step's first call at each new batch size instead")
  args = parser.parse_args()
  if args.first_call:
    enable_kernel_cache()
  quick = args.quick or not bench.on_gpu()
  config = QUICK_CONFIG if quick else dataclasses.replace(STEP_CONFIG, n_layers=args.layers)
  batch, seq, context = (2, 16, 16) if quick else (args.batch, args.seq, args.context)
  print(f"# jdet.models.llama on {bench.device_description()}: {config}")
  if bench.interpret_warning():
    print(bench.interpret_warning())
  params = llama.init_params(jax.random.key(0), config)
  if args.first_call:
    batches = args.decode_batch or ((2, 3) if quick else (8, 9, 10, 11, 12))
    print(bench.markdown_table(first_call_rows(config, params, batches, context)))
    return
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab)
  rows = []
  step_us = {ops: bench.time_us(_training_step(config, ops), [(params, tokens)], repeats=5)
             for ops in ("xla", "jdet")}
  rows.append(bench.Row("model", f"train step B={batch} T={seq}", "fwd+bwd",
                        step_us["jdet"], "same model, XLA ops", step_us["xla"]))
  for decode_batch in args.decode_batch or ((2,) if quick else (1, 8, 64)):
    inputs = _decode_inputs(config, params, decode_batch, context)
    decode_us = {ops: bench.time_us(_decode(config, ops), [inputs]) for ops in ("xla", "jdet")}
    rows.append(bench.Row("model", f"decode B={decode_batch} context={context}", "decode step",
                          decode_us["jdet"], "same model, XLA ops", decode_us["xla"],
                          {"jdet tokens/s": f"{decode_batch / decode_us['jdet'] * 1e6:.0f}",
                           "XLA tokens/s": f"{decode_batch / decode_us['xla'] * 1e6:.0f}"}))
  print(bench.markdown_table(rows))


if __name__ == "__main__":
  main()
