"""RL log-prob parity: the sampler's log-probs are the trainer's, bit for bit.

:func:`parity_check` runs :mod:`jdet.models.llama` the way an RL loop does, once
with jdet's ops and once with XLA's:

1. **Rollout.** Rounds of prompts, each round a batch of another size, prefilled
   and decoded with seeded sampling; each sequence stops at EOS or at its own
   budget. For every sampled token it records the sampler's log-prob, computed
   from the decode-time hidden state with ``token_logprobs``.
2. **Recompute.** The trainer's :func:`llama.logprobs` of the same tokens in
   differently composed batches (all at once; shuffled into batches of another
   size, padded longer, with filler rows) must equal the sampler's bitwise.
3. **Gradient** (jdet only). One example's GRPO gradient computed alone must
   equal, bitwise, its gradient computed first in batches of other sizes and
   padding whose other examples have advantage zero (their rows get zero
   cotangents, which the weight gradients' fixed-order reductions ignore).

The XLA run reports how many tokens differ and by how much. ``ok`` is true when
jdet's run has no differing bit anywhere and its model audits clean
(:func:`jdet.testing.audit`).

The rounds, the layouts and the gradient batches are independent programs, and
compiling them is most of a GPU run: each runs on its own thread (XLA compiles
without the GIL), and each result lands in its fixed place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jdet.models import llama
from jdet.testing import audit, bits


@dataclasses.dataclass(frozen=True)
class Setup:
  """One parity run. ``layouts`` and ``grad_batches`` are (batch size, extra padding)
  pairs; batch size 0 means every sequence in one batch."""
  model: llama.Config
  rounds: tuple[int, ...]          # prompts per rollout round
  prompt_lens: tuple[int, int]     # shortest and longest prompt
  max_new: int                     # most new tokens of a sequence (each draws its budget)
  layouts: tuple[tuple[int, int], ...]
  grad_batches: tuple[tuple[int, int], ...]
  grad_examples: int               # examples whose gradients are compared
  eos: int = 0
  temperature: float = 1.0
  seed: int = 0


SETUPS = {
    # Interpret-mode compiles dominate on a CPU: two batch sizes per stage.
    "cpu": Setup(model=llama.CONFIGS["cpu"], rounds=(3, 2), prompt_lens=(2, 6), max_new=6,
                 layouts=((0, 0), (2, 3)), grad_batches=((1, 0), (3, 4)), grad_examples=2),
    "gpu": Setup(model=llama.CONFIGS["gpu"], rounds=(48, 7, 96), prompt_lens=(4, 96),
                 max_new=96, layouts=((0, 0), (16, 5), (1, 0)),
                 grad_batches=((1, 0), (8, 0), (5, 17)), grad_examples=3),
}


@dataclasses.dataclass
class Sample:
  tokens: np.ndarray   # [n] int32: prompt then completion
  prompt_len: int
  logp: np.ndarray     # [n - prompt_len] float32: the sampler's log-prob of each completion token


# ---------------------------------------------------------------- rollout


def _sample(params, hidden, key, *, config, temperature, ops):
  """Samples one token per row of hidden [B, D]; returns it and its log-prob."""
  logits = llama.logits(params, hidden, config, ops=ops)
  token = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
  logp = llama.token_logprobs(params, hidden[:, None], token[:, None], config,
                              temperature=temperature, ops=ops)
  return token, logp[:, 0]


def _start(params, prompts, cache, prompt_lens, key, *, config, temperature, ops):
  """Prefills the prompts and samples each one's first token after its last prompt token."""
  hidden, cache = llama.prefill(params, prompts, cache, config, lengths=prompt_lens, ops=ops)
  last = hidden[jnp.arange(prompts.shape[0]), prompt_lens - 1]
  return *_sample(params, last, key, config=config, temperature=temperature, ops=ops), cache


def _step(params, token, cache, key, *, config, temperature, ops):
  """Feeds each sequence its last sampled token and samples the next."""
  hidden, cache = llama.decode_step(params, token, cache, config, ops=ops)
  return *_sample(params, hidden, key, config=config, temperature=temperature, ops=ops), cache


@functools.lru_cache(maxsize=None)
def _jitted(fn, config: llama.Config, temperature: float, ops: str):
  """``jax.jit(fn)`` with the static options bound, one per option set (so reruns
  reuse the compiled programs)."""
  return jax.jit(functools.partial(fn, config=config, temperature=temperature, ops=ops))


def _in_threads(tasks: list) -> list:
  """Runs the thunks concurrently; returns their results in order."""
  with concurrent.futures.ThreadPoolExecutor(len(tasks)) as pool:
    return [job.result() for job in [pool.submit(task) for task in tasks]]


def rollout(params, setup: Setup, ops: str) -> list[Sample]:
  """Samples the rounds' completions (each round on its own thread, its prompts
  drawn in round order); returns every sequence, round by round, with its log-probs."""
  c = setup.model
  start = _jitted(_start, c, setup.temperature, ops)
  step = _jitted(_step, c, setup.temperature, ops)
  rng = np.random.default_rng(setup.seed)
  shortest, longest = setup.prompt_lens
  max_len = longest + setup.max_new

  def sample_round(round_index, prompt_lens, budgets, prompts):
    batch = len(prompts)
    key = jax.random.fold_in(jax.random.key(setup.seed), round_index)
    token, logp, cache = start(params, prompts, llama.init_cache(c, batch, max_len),
                               prompt_lens, jax.random.fold_in(key, 0))
    completions = [[] for _ in range(batch)]
    logps = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    for i in range(1, setup.max_new + 1):
      token_np, logp_np = np.asarray(token), np.asarray(logp)
      for b in np.flatnonzero(~done):
        completions[b].append(int(token_np[b]))
        logps[b].append(logp_np[b])
        done[b] = token_np[b] == setup.eos or len(completions[b]) == budgets[b]
      if done.all():
        break
      token, logp, cache = step(params, token, cache, jax.random.fold_in(key, i))
    return [Sample(np.concatenate([prompts[b, :prompt_lens[b]],
                                   np.asarray(completions[b], np.int32)]),
                   int(prompt_lens[b]), np.asarray(logps[b], np.float32))
            for b in range(batch)]

  rounds = []
  for round_index, batch in enumerate(setup.rounds):
    prompt_lens = rng.integers(shortest, longest + 1, batch).astype(np.int32)
    budgets = rng.integers(1, setup.max_new + 1, batch)
    prompts = rng.integers(setup.eos + 1, c.vocab, (batch, longest)).astype(np.int32)
    rounds.append(functools.partial(sample_round, round_index, prompt_lens, budgets, prompts))
  return [sample for samples in _in_threads(rounds) for sample in samples]


# ---------------------------------------------------------------- training side


def _pack(samples, rows, width):
  """tokens [len(rows), width] (zero-padded) and lengths of the samples at ``rows``."""
  tokens = np.zeros((len(rows), width), np.int32)
  lengths = np.zeros(len(rows), np.int32)
  for j, s in enumerate(rows):
    n = len(samples[s].tokens)
    tokens[j, :n], lengths[j] = samples[s].tokens, n
  return tokens, lengths


def recompute(params, samples, setup: Setup, ops: str, batch_size: int, extra: int,
              order) -> list[np.ndarray]:
  """The trainer's log-probs of every sample's completion, computed in batches of
  ``batch_size`` (0: all at once) taken in ``order``, padded ``extra`` tokens past the
  longest sample; a short last batch is filled with other samples."""
  fn = _jitted(llama.logprobs, setup.model, setup.temperature, ops)
  size = batch_size or len(samples)
  width = max(len(s.tokens) for s in samples) + extra
  order = list(order)
  result = [None] * len(samples)
  for first in range(0, len(order), size):
    rows = order[first:first + size]
    fillers = order[::-1][:size - len(rows)]
    tokens, lengths = _pack(samples, rows + fillers, width)
    logp = np.asarray(fn(params, tokens, lengths=lengths))
    for j, s in enumerate(rows):
      sample = samples[s]
      result[s] = logp[j, sample.prompt_len - 1:len(sample.tokens) - 1]
  return result


def grpo_loss(params, tokens, lengths, prompt_lens, old_logp, advantages, config, *,
              temperature=1.0, ops="jdet"):
  """GRPO's policy-gradient term: -Σ_b A_b · mean over b's completion of
  exp(logp - old_logp). tokens [B, T]; lengths, prompt_lens, advantages [B];
  old_logp [B, T - 1] aligned with :func:`llama.logprobs`."""
  logp = llama.logprobs(params, tokens, config, lengths=lengths, temperature=temperature, ops=ops)
  target = jnp.arange(1, tokens.shape[1])[None, :]
  mask = (target >= prompt_lens[:, None]) & (target < lengths[:, None])
  count = jnp.maximum(jnp.sum(mask, axis=1), 1)
  weight = jnp.where(mask, (advantages / count)[:, None], 0.0)
  return -jnp.sum(weight * jnp.exp(logp - old_logp))


def _grpo_grad(params, *batch, config, temperature, ops):
  return jax.grad(grpo_loss)(params, *batch, config, temperature=temperature, ops=ops)


def _grpo_batch(samples, rows, width, advantages):
  tokens, lengths = _pack(samples, rows, width)
  old = np.zeros((len(rows), width - 1), np.float32)
  for j, s in enumerate(rows):
    sample = samples[s]
    old[j, sample.prompt_len - 1:len(sample.tokens) - 1] = sample.logp
  prompt_lens = np.asarray([samples[s].prompt_len for s in rows], np.int32)
  return tokens, lengths, prompt_lens, old, np.asarray(advantages, np.float32)


def example_gradients(params, samples, setup: Setup, ops: str, batch_size: int,
                      extra: int) -> list[list[np.ndarray]]:
  """The bits of each checked example's GRPO gradient leaves (the longest
  ``grad_examples`` completions), each computed first in a batch of ``batch_size``
  padded ``extra`` tokens whose other examples have advantage 0."""
  grad = _jitted(_grpo_grad, setup.model, setup.temperature, ops)
  width = max(len(s.tokens) for s in samples)
  by_length = sorted(range(len(samples)), key=lambda s: -len(samples[s].logp))
  advantages = np.random.default_rng(setup.seed + 1).standard_normal(len(samples)) + 0.5
  result = []
  for example in by_length[:setup.grad_examples]:
    others = [s for s in by_length if s != example]
    rows = [example] + [others[i % len(others)] for i in range(batch_size - 1)]
    adv = [advantages[example]] + [0.0] * (batch_size - 1)
    g = grad(params, *_grpo_batch(samples, rows, width + extra, adv))
    result.append([bits(x) for x in jax.tree.leaves(g)])
  return result


def _differing_leaves(per_batch) -> tuple[int, int]:
  """(differing, compared) leaves of every later batch's gradients against the first's."""
  differing = compared = 0
  for later in per_batch[1:]:
    for leaves, reference in zip(later, per_batch[0]):
      differing += sum(not np.array_equal(a, b) for a, b in zip(leaves, reference))
      compared += len(leaves)
  return differing, compared


# ---------------------------------------------------------------- the check


def _compare(samples, recomputed) -> tuple[int, float]:
  """(tokens whose log-prob bits differ, largest |difference|) against the sampler."""
  got = np.concatenate([r for r in recomputed])
  want = np.concatenate([s.logp for s in samples])
  return (int(np.sum(bits(got) != bits(want))),
          float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0)))


def run_ops(params, setup: Setup, ops: str, *, gradients: bool) -> dict:
  """Rollout, recompute in every layout, optionally the gradient check (the layouts
  and gradient batches on threads of their own), and the audit."""
  samples = rollout(params, setup, ops)
  rng = np.random.default_rng(setup.seed + 2)
  out = {"sequences": len(samples), "tokens": sum(len(s.logp) for s in samples),
         "layouts": {}, "mismatches": 0, "max_abs_diff": 0.0}
  labels, tasks = [], []
  for batch_size, extra in setup.layouts:
    order = range(len(samples)) if batch_size == 0 else rng.permutation(len(samples)).tolist()
    labels.append(f"{'one batch' if batch_size == 0 else f'shuffled batches of {batch_size}'}"
                  f", +{extra} padding")
    tasks.append(functools.partial(recompute, params, samples, setup, ops, batch_size, extra,
                                   order))
  if gradients:
    tasks += [functools.partial(example_gradients, params, samples, setup, ops, batch_size,
                                extra) for batch_size, extra in setup.grad_batches]
  results = _in_threads(tasks)
  for label, recomputed in zip(labels, results):
    mismatches, diff = _compare(samples, recomputed)
    out["layouts"][label] = mismatches
    out["mismatches"] += mismatches
    out["max_abs_diff"] = max(out["max_abs_diff"], diff)
  if gradients:
    out["grad_leaves_differing"], out["grad_leaves_compared"] = _differing_leaves(
        results[len(labels):])
  batch = _grpo_batch(samples, list(range(len(samples))), max(len(s.tokens) for s in samples),
                      np.ones(len(samples)))
  out["audit"] = [str(f) for f in audit(jax.grad(grpo_loss), params, *batch, setup.model,
                                        ops=ops)]
  out["audit"] += [str(f) for f in audit(_step, params, batch[0][:, 0],
                                         llama.init_cache(setup.model, len(samples), 8),
                                         jax.random.key(0), config=setup.model,
                                         temperature=setup.temperature, ops=ops)]
  return out


def parity_check(config_name: str = "cpu", *, xla_baseline: bool = True,
                 verbose: bool = True) -> dict:
  """Runs the parity check with ``SETUPS[config_name]``; returns the outcomes.

  Keys: ``"jdet"`` and, with ``xla_baseline``, ``"xla"`` (the same model on XLA's ops,
  which shows what jdet fixes; it does not decide ``"ok"``). Each: sequences, tokens,
  mismatches per layout and in all, max_abs_diff against the sampler, audit findings;
  jdet also gradient leaves differing/compared. ``"ok"``: jdet bitwise everywhere and a
  clean audit. ``"seconds"``: the run's wall time.
  """
  if config_name not in SETUPS:
    raise ValueError(f"config_name must be one of {sorted(SETUPS)}, got {config_name!r}")
  setup = SETUPS[config_name]
  began = time.perf_counter()
  params = llama.init_params(jax.random.key(setup.seed), setup.model)
  result = {"config": config_name, "jdet": run_ops(params, setup, "jdet", gradients=True)}
  if xla_baseline:
    result["xla"] = run_ops(params, setup, "xla", gradients=False)
  jd = result["jdet"]
  result["ok"] = (jd["mismatches"] == 0 and jd["grad_leaves_differing"] == 0
                  and not jd["audit"])
  result["seconds"] = time.perf_counter() - began
  if verbose:
    print(format_report(result))
  return result


def format_report(result: dict) -> str:
  jd = result["jdet"]
  lines = [f"RL log-prob parity ({result['config']}): {jd['sequences']} sequences from "
           f"{len(SETUPS[result['config']].rounds)} rollout rounds, {jd['tokens']} sampled tokens"]
  for name, run in ((name, result[name]) for name in ("jdet", "xla") if name in result):
    layouts = "; ".join(f"{k}: {v}" for k, v in run["layouts"].items())
    lines.append(f"  {name:>4}: trainer log-probs differing from the sampler's: "
                 f"{run['mismatches']} ({layouts}); max |dlogp| {run['max_abs_diff']:.3g}; "
                 f"audit findings: {len(run['audit'])}")
  lines.append(f"  jdet: per-example GRPO gradient leaves differing across batches: "
               f"{jd['grad_leaves_differing']} of {jd['grad_leaves_compared']}")
  for finding in jd["audit"]:
    lines.append(f"    audit: {finding}")
  lines.append(f"  {'PASS' if result['ok'] else 'FAIL'}: jdet sampler and trainer "
               f"{'agree bitwise' if result['ok'] else 'DIFFER'} "
               f"({result['seconds']:.0f} s)")
  return "\n".join(lines)
